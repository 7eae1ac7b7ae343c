"""torch_ds_mini.py: the PyTorch eager baseline for `moetron train configs/ds_mini.toml`.

The same model code as the reference (tools/torch_ref/moetron_ref.py: same parameters, layouts, router,
losses), float32 parameters, and either
  --dtype fp32  float32 matmuls, no autocast (the engine's training.compute_dtype = "fp32"), or
  --dtype bf16  matmuls under torch.autocast("cpu", dtype=torch.bfloat16), the router gate in fp32;
routed experts one of
  --moe loop    per expert index_select, two matmuls, index_add (the usual eager MoE),
  --moe sorted  one index_select of all routed rows in expert order, torch.split, two matmuls per expert,
                torch.cat, one index_add,
  --moe padded  every expert's rows gathered into one zero-padded [E, C, d] tensor (C = the most rows any
                expert got), torch.bmm against the [E, d, 2F] / [E, F, d] weights, one scatter back;
explicit causal attention (torch 1.13 has no scaled_dot_product_attention), torch.optim.AdamW with decay on
matrices only, gradient clipping and the config's lr schedule. One micro-batch (training.micro_batch_size x
seq_len, 8 x 256 for ds_mini) of random tokens per step.

Before training it prints the BLAS / oneDNN (MKL-DNN) set-up torch runs with and times a 2048^3 fp32 torch.mm
(`mm_gflops:`), the matmul ceiling to hold the training throughput against. Unless --no-check, it first
checks sorted and padded against loop: on a small float64 MoE layer (loss and every gradient within 1e-10
relative) and on the first ds_mini batch in the chosen dtype (loss within 1e-5 relative for fp32, 2e-3 for
bf16; every parameter's gradient norm likewise). Last it prints `tokens_per_s: X` over the steps after the warm-up and the
model FLOP rate (moetron's count: src/job/accounting.cpp flops_per_token, causal attention).

Not a training script (random tokens, no data, no checkpoints). Run with /usr/bin/python3 (Debian
python3-torch 1.13); bench/train_vs_torch.sh runs it against the engine.
"""
import argparse
import math
import os
import re
import statistics
import sys
import time


def parse_args():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=os.path.join(here, "..", "configs", "ds_mini.toml"))
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                    help="fp32: float32 matmuls; bf16: CPU autocast to bfloat16 (default fp32)")
    ap.add_argument("--moe", choices=("loop", "sorted", "padded"), default="loop",
                    help="routed-expert implementation (default loop)")
    ap.add_argument("--steps", type=int, default=6, help="timed steps after the warm-up")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-check", action="store_true", help="skip the MoE variant checks")
    ap.add_argument("--no-peak", action="store_true", help="skip the 2048^3 torch.mm timing")
    ap.add_argument("overrides", nargs="*", help="--section.key=value, as for moetron (e.g. --model.n_layers=2)")
    a, rest = ap.parse_known_args()
    bad = [x for x in rest if not re.fullmatch(r"--\w+\.\w+=.*", x)]
    if bad:
        ap.error(f"unrecognized arguments: {' '.join(bad)} (config overrides are --section.key=value)")
    a.overrides = list(a.overrides) + rest
    if a.threads < 1:
        ap.error(f"--threads {a.threads}: must be at least 1")
    if a.steps < 1 or a.warmup < 0:
        ap.error(f"--steps {a.steps} --warmup {a.warmup}: need steps >= 1, warmup >= 0")
    return a


# torch's BLAS here is Debian's generic libblas.so.3 (OpenBLAS through alternatives), which keeps its own
# thread pool: torch.set_num_threads does not reach it, so its thread count is set before torch loads.
_ARGS = parse_args()
for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_v, str(_ARGS.threads))

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools", "torch_ref"))
import moetron_ref as R  # noqa: E402


def print_setup(threads):
    """The BLAS, oneDNN and ISA torch computes with (torch.__config__.show() and the loaded libraries)."""
    show = torch.__config__.show()
    blas = re.search(r"BLAS_INFO=([^,\s]+)", show)
    cap = re.search(r"CPU capability usage: (\S+)", show)
    dnnl = re.search(r"MKL-DNN v(\S+)", show)
    torch.ones(64, 64) @ torch.ones(64, 64)  # make sure the BLAS library is loaded before reading the maps
    libs = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if re.search(r"lib(open)?blas|libmkl|libdnnl|libmkldnn", os.path.basename(path)):
                    libs.add(path)
    except OSError:
        pass
    print(f"torch {torch.__version__}: BLAS_INFO={blas.group(1) if blas else '?'} "
          f"(loaded: {', '.join(sorted(libs)) or 'none found in /proc/self/maps'}); "
          f"mkldnn available {torch.backends.mkldnn.is_available()} (v{dnnl.group(1) if dnnl else '?'}); "
          f"CPU capability {cap.group(1) if cap else '?'}; threads torch {torch.get_num_threads()} "
          f"(asked {threads}) OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS')}", flush=True)
    # Debian's torch takes whichever libblas.so.3 the alternatives system points at: without an OpenBLAS package
    # that is the reference (netlib) BLAS, some 30x slower, and the comparison would not give torch its best.
    if any(re.search(r"/blas/libblas\.so", p) for p in libs):
        print("WARNING: torch runs on the reference (netlib) BLAS, not OpenBLAS: install libopenblas0-pthread; "
              "this run does not give PyTorch its best", flush=True)
    env = {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "DNNL_MAX_CPU_ISA", "OPENBLAS_CORETYPE")
           if k in os.environ}
    if env:
        print("isa caps: " + " ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    if torch.get_num_threads() != threads:
        raise SystemExit(f"torch.set_num_threads({threads}) left {torch.get_num_threads()} threads")


def mm_peak(n=2048, reps=5):
    """Best and median GFLOPS of an n^3 fp32 torch.mm (after one untimed call)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    g = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        g.append(2.0 * n ** 3 / (time.perf_counter() - t0) / 1e9)
    return max(g), statistics.median(g)


def train_flops_per_token(cfg):
    """moetron's model FLOPs per trained token (accounting.cpp flops_per_token, causal): 3 x forward, forward
    = 2 x active matmul parameters (router gate included) + QK^T and PV over (T + 1) / 2 keys + the head."""
    m, T = cfg["model"], cfg["training"]["seq_len"]
    if m["attn_type"] == "mla":
        raise SystemExit("train_flops_per_token: MLA is not counted here (ds_mini is MHA)")
    d, H, hd, hkv = m["d_model"], m["n_heads"], m["head_dim"], m["n_kv_heads"]
    attn_p = d * (H + 2 * hkv) * hd + H * hd * d
    core = 2.0 * H * (hd + hd) * (T + 1) / 2.0
    fwd = 0.0
    for l in range(m["n_layers"]):
        if R.is_moe_layer(m, l):
            fe = 3 * d * m["moe_inter_size"]
            ffn = m["n_routed_experts"] * d + m["topk"] * fe + m["n_shared_experts"] * fe
        else:
            ffn = 3 * d * m["inter_size"]
        fwd += 2.0 * (attn_p + ffn) + core
    fwd += 2.0 * m["vocab_size"] * d
    return 3.0 * fwd


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


def check_small_fp64(seed):
    """sorted and padded vs loop on one small MoE layer in float64: loss and every gradient within 1e-10."""
    m = dict(R.DEFAULTS["model"], d_model=48, n_routed_experts=8, n_shared_experts=1, moe_inter_size=20, topk=3,
             aux_coef=0.01, aux_seq_wise=True)
    g = torch.Generator().manual_seed(seed + 7)
    N, T, d, E, Fe = 64, 16, 48, 8, 20
    base = {"moe.gate": (d, E), "moe.experts.w13": (E, d, 2 * Fe), "moe.experts.w2": (E, Fe, d),
            "moe.shared.w13": (d, 2 * Fe), "moe.shared.w2": (Fe, d)}
    P0 = {n: torch.randn(s, generator=g, dtype=torch.float64) * 0.3 for n, s in base.items()}
    bias = torch.zeros(E, dtype=torch.float64)
    bias[5] = -1e3  # a selection bias keeps expert 5 empty: the no-rows path runs too
    h0 = torch.randn(N, d, generator=g, dtype=torch.float64)
    proj = torch.randn(N, d, generator=g, dtype=torch.float64)
    res = {}
    for moe in R.Prec.MOE:
        P = {n: t.clone().requires_grad_(True) for n, t in P0.items()}
        h = h0.clone().requires_grad_(True)
        st = R.State(biases={0: bias})
        y = R.moe_ffn(P, "", h, m, R.Prec("fp64", moe), st, 0, T)
        loss = (y * proj).sum() + st.last_aux
        loss.backward()
        res[moe] = (float(loss), {"h": h.grad, **{n: p.grad for n, p in P.items()}}, st.counts[0])
    la, ga, ca = res["loop"]
    if int(ca.min()) != 0:
        raise SystemExit(f"check: small float64 MoE layer: expected an expert without rows, got {ca.tolist()}")
    msg = []
    for moe in R.Prec.MOE[1:]:
        lb, gb, _ = res[moe]
        worst = max(float((ga[n] - gb[n]).abs().max() / ga[n].abs().max()) for n in ga)
        if not (rel(lb, la) <= 1e-10 and worst <= 1e-10):
            raise SystemExit(f"check: small float64 MoE layer: {moe} vs loop loss {lb!r} vs {la!r}, worst gradient "
                             f"difference {worst:.3e} (relative to its max): must be within 1e-10")
        msg.append(f"{moe} = loop (loss rel {rel(lb, la):.1e}, gradients rel {worst:.1e})")
    print(f"check: small float64 MoE layer (E 8, top-3, rows per expert {ca.tolist()}): " + ", ".join(msg),
          flush=True)


def step_loss_and_grads(P, tok, tgt, cfg, prec, autocast, B, T):
    for p in P.values():
        p.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        total, ce, aux, _, _ = R.forward(P, tok, tgt, cfg, prec, R.State(), B, T)
    total.backward()
    out = float(total), {n: float(p.grad.double().norm()) for n, p in P.items()}
    for p in P.values():
        p.grad = None
    return out


def check_first_batch(P, tok, tgt, cfg, mode, autocast, B, T):
    """sorted and padded vs loop on the first benchmark batch, in the benchmark's dtype."""
    tol = 1e-5 if mode == "fp32" else 2e-3
    la, ga = step_loss_and_grads(P, tok, tgt, cfg, R.Prec(mode, "loop"), autocast, B, T)
    bad = []
    for moe in R.Prec.MOE[1:]:
        lb, gb = step_loss_and_grads(P, tok, tgt, cfg, R.Prec(mode, moe), autocast, B, T)
        worst_n = max(ga, key=lambda n: rel(gb[n], ga[n]))
        worst = rel(gb[worst_n], ga[worst_n])
        print(f"check: first batch ({mode}): loss loop {la:.7f} {moe} {lb:.7f} (rel {rel(lb, la):.1e}); worst "
              f"gradient norm rel {worst:.1e} ({worst_n}); tolerance {tol:.0e}", flush=True)
        if not (rel(lb, la) <= tol and worst <= tol):
            bad.append(moe)
    if bad:
        raise SystemExit(f"check: {' and '.join(bad)} MoE disagree(s) with loop beyond {tol:.0e} on the first batch")


def main():
    a = _ARGS
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    print_setup(a.threads)
    if not a.no_peak:
        best, med = mm_peak()
        print(f"mm_gflops: {best:.1f}  (2048^3 fp32 torch.mm, best of 5; median {med:.1f})", flush=True)
    cfg = R.load_config(a.config, a.overrides)
    m, tr = cfg["model"], cfg["training"]
    B, T, V = tr["micro_batch_size"], tr["seq_len"], m["vocab_size"]
    P = R.init_params(m, torch.float32, seed=a.seed)
    o = cfg["optimizer"]
    groups = [{"params": [p for n, p in P.items() if R.decays(n)], "weight_decay": o["weight_decay"]},
              {"params": [p for n, p in P.items() if not R.decays(n)], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=o["lr"], betas=(o["beta1"], o["beta2"]), eps=o["eps"])
    params = list(P.values())
    mode = "fp32" if a.dtype == "fp32" else "autocast"
    autocast = a.dtype == "bf16"
    prec = R.Prec(mode, a.moe)
    nparams = sum(p.numel() for p in params)
    total_steps = a.warmup + a.steps
    fpt = train_flops_per_token(cfg)
    print(f"ds_mini in torch: {m['n_layers']} layers, {nparams / 1e6:.1f}M params, micro-batch {B} x {T}, "
          f"{'fp32' if a.dtype == 'fp32' else 'bf16 autocast'}, MoE {a.moe}, {total_steps} steps ({a.warmup} "
          f"warm-up), {fpt / 1e9:.3f} GFLOP per trained token", flush=True)
    batches = [(torch.randint(0, V, (B * T,)), torch.randint(0, V, (B * T,))) for _ in range(total_steps)]
    if not a.no_check:
        check_small_fp64(a.seed)
        check_first_batch(P, batches[0][0], batches[0][1], cfg, mode, autocast, B, T)
    times = []
    for step in range(1, total_steps + 1):
        tok, tgt = batches[step - 1]
        st = R.State()
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            total, ce, aux, z, _ = R.forward(P, tok, tgt, cfg, prec, st, B, T)
        total.backward()
        if tr["max_norm"] > 0:
            torch.nn.utils.clip_grad_norm_(params, tr["max_norm"])
        lr = R.lr_at(cfg, step, total_steps)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        times.append(dt)
        most = max(int(c.max()) for c in st.counts) if st.counts else 0
        print(f"step {step:3d}  loss {float(ce):.4f}  aux {float(aux):.4f}  most rows/expert {most}  {dt:.3f} s  "
              f"{B * T / dt:.0f} tok/s", flush=True)
        if not math.isfinite(float(ce)):
            raise SystemExit("loss is not finite")
    timed = times[a.warmup:]
    tps = B * T * len(timed) / sum(timed)
    print(f"model GFLOPS: {tps * fpt / 1e9:.1f} (tokens/s x {fpt / 1e9:.3f} GFLOP per token)")
    print(f"tokens_per_s: {tps:.1f}")


if __name__ == "__main__":
    main()
