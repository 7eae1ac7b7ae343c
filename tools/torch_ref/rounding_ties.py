"""rounding_ties.py: explain engine-vs-emu differences by bf16 rounding ties (analysis tool, not a test).

The emu reference rounds every matmul operand to bf16 where model.cpp does, in float64. A value within fp32
noise of a bf16 rounding midpoint may round the other way in the engine (fp32): a 2^-8 jump of one element.
This script re-runs the emu reference with such roundings reversed, greedily: for every matmul operand element
within THRESH (relative) of a midpoint, reverse it and keep the reversal if it reduces the difference to the
engine's outputs by 10 % or more: first forward operands against the logits, then backward dy operands against
the worst gradient. It prints what it kept and the errors before and after.

Usage (the engine outputs come from the reference test):
  MOETRON_REF_DUMP=/tmp/eng build/tests/unit_tests --gtest_filter='*Reference*'
  /usr/bin/python3 tools/torch_ref/rounding_ties.py mha /tmp/eng [THRESH=4e-7]
Slow-ish: one forward/backward per candidate (a few hundred candidates per variant).
"""
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moetron_ref as R  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def ulp_bf16(a):
    return torch.pow(2.0, torch.floor(torch.log2(a.abs().clamp_min(1e-300))) - 7)


def near_midpoint(x, thresh):
    a = x.detach().reshape(-1).abs()
    u = ulp_bf16(a)
    frac = a / u - torch.floor(a / u)
    d = (frac - 0.5).abs() * u / a.clamp_min(1e-300)
    return [int(i) for i in torch.nonzero(d < thresh).reshape(-1)]


def main(argv):
    if len(argv) < 2:
        print(__doc__)
        return 2
    v, engdir = argv[0], argv[1]
    thresh = float(argv[2]) if len(argv) > 2 else 4e-7
    ref, meta = R.read_safetensors(os.path.join(ROOT, "tests", "data", "ref", v + ".safetensors"))
    eng, _ = R.read_safetensors(os.path.join(engdir, v + ".engine.safetensors"))
    cfg = R.config_from_toml_text(meta["config_toml"])
    m = cfg["model"]
    B, T = int(meta["B"]), int(meta["T"])
    names = [n for n, _, _ in R.param_specs(m)]
    nmoe = sum(R.is_moe_layer(m, l) for l in range(m["n_layers"]))
    P = {n: torch.tensor(ref["param." + n], dtype=torch.float64).requires_grad_(True) for n in names}
    bias = {i: torch.tensor(ref[f"expert_bias.{i}"], dtype=torch.float64) for i in range(nmoe)}
    tok = torch.tensor(ref["tokens"], dtype=torch.int64)
    tgt = torch.tensor(ref["targets"], dtype=torch.int64)
    reversed_ = set()  # (kind 'f'|'b', call index, flat element)
    calls = {"f": 0, "b": 0}
    found = {"f": [], "b": []}

    def rnd(x, kind):
        k = calls[kind]
        calls[kind] += 1
        found[kind].append((k, near_midpoint(x, thresh)))
        xr = R.bf16_round(x)
        mine = [i for (kk, c, i) in reversed_ if kk == kind and c == k]
        if mine:
            xf, rf = x.reshape(-1), xr.reshape(-1).clone()
            for i in mine:
                rf[i] = rf[i] - torch.sign(rf[i] - xf[i]) * ulp_bf16(xf[i:i + 1])[0]
            xr = rf.view_as(xr)
        return xr

    class Lin16(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            xr, wr = rnd(x, "f"), R.bf16_round(w)
            ctx.save_for_backward(xr, wr)
            return xr @ wr

        @staticmethod
        def backward(ctx, dy):
            xr, wr = ctx.saved_tensors
            dyr = rnd(dy, "b")
            return dyr @ wr.transpose(-1, -2), xr.transpose(-1, -2) @ dyr

    R._Lin16 = Lin16

    def run():
        calls["f"] = calls["b"] = 0
        found["f"], found["b"] = [], []
        for p in P.values():
            p.grad = None
        st = R.State(biases={i: b.clone() for i, b in bias.items()})
        tot, _, _, _, logits = R.forward(P, tok, tgt, cfg, R.Prec("emu"), st, B, T)
        tot.backward()
        return logits.detach().numpy()

    def lerr(lg):
        return np.linalg.norm(lg - eng["logits"]) / np.linalg.norm(eng["logits"])

    def gerr():
        return max(np.linalg.norm(P[n].grad.numpy() - eng["grad." + n]) / np.linalg.norm(eng["grad." + n])
                   for n in names)

    base = lerr(run())
    g0 = gerr()
    fwd, bwd = list(found["f"]), list(found["b"])
    print(f"{v}: logits {base:.2e}, worst gradient {g0:.2e}; "
          f"{sum(len(i) for _, i in fwd)} forward / {sum(len(i) for _, i in bwd)} backward candidates")
    cur = base
    for c, idxs in fwd:
        for i in idxs:
            reversed_.add(("f", c, i))
            e = lerr(run())
            if e < 0.9 * cur:
                cur = e
                print(f"  reversed forward operand {c} element {i}: logits {e:.2e}")
            else:
                reversed_.discard(("f", c, i))
    run()
    cur = gerr()
    for c, idxs in bwd:
        for i in idxs:
            reversed_.add(("b", c, i))
            run()
            e = gerr()
            if e < 0.9 * cur:
                cur = e
                print(f"  reversed backward dy {c} element {i}: worst gradient {e:.2e}")
            else:
                reversed_.discard(("b", c, i))
    lg = run()
    print(f"{v}: after {len(reversed_)} reversals: logits {lerr(lg):.2e}, worst gradient {gerr():.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
