"""torch_ds_mini.py: the PyTorch eager baseline for `moetron train configs/ds_mini.toml`.

The same model code as the reference (tools/torch_ref/moetron_ref.py: same parameters, layouts, router,
losses), float32 parameters, matmuls under torch.autocast("cpu", dtype=torch.bfloat16), the router gate in
fp32 (as the engine), MoE the standard eager way (loop over experts, index_select / index_add), explicit
causal attention (torch 1.13 has no scaled_dot_product_attention), torch.optim.AdamW with decay on matrices
only, gradient clipping and the config's lr schedule. One micro-batch (training.micro_batch_size x seq_len,
8 x 256 for ds_mini) of random tokens per step. Prints per-step times and, last, `tokens_per_s: X` over the
steps after the warm-up.

Not a training script (random tokens, no data, no checkpoints). Run with /usr/bin/python3 (Debian
python3-torch 1.13); bench/train_vs_torch.sh runs it against the engine.
"""
import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools", "torch_ref"))
import moetron_ref as R  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs",
                                                     "ds_mini.toml"))
    ap.add_argument("--steps", type=int, default=6, help="timed steps after the warm-up")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("overrides", nargs="*", help="--section.key=value, as for moetron")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    cfg = R.load_config(a.config, a.overrides)
    m, tr = cfg["model"], cfg["training"]
    B, T, V = tr["micro_batch_size"], tr["seq_len"], m["vocab_size"]
    P = R.init_params(m, torch.float32, seed=a.seed)
    o = cfg["optimizer"]
    groups = [{"params": [p for n, p in P.items() if R.decays(n)], "weight_decay": o["weight_decay"]},
              {"params": [p for n, p in P.items() if not R.decays(n)], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=o["lr"], betas=(o["beta1"], o["beta2"]), eps=o["eps"])
    params = list(P.values())
    prec = R.Prec("autocast")
    nparams = sum(p.numel() for p in params)
    total_steps = a.warmup + a.steps
    print(f"torch {torch.__version__} threads {torch.get_num_threads()}: {m['n_layers']} layers, {nparams / 1e6:.1f}M "
          f"params, micro-batch {B} x {T}, bf16 autocast, {total_steps} steps ({a.warmup} warm-up)", flush=True)
    times, losses = [], []
    for step in range(1, total_steps + 1):
        tok = torch.randint(0, V, (B * T,))
        tgt = torch.randint(0, V, (B * T,))
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            total, ce, aux, z, _ = R.forward(P, tok, tgt, cfg, prec, R.State(), B, T)
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
        losses.append(float(ce))
        print(f"step {step:3d}  loss {float(ce):.4f}  aux {float(aux):.4f}  {dt:.3f} s  {B * T / dt:.0f} tok/s",
              flush=True)
        if not math.isfinite(float(ce)):
            raise SystemExit("loss is not finite")
    timed = times[a.warmup:]
    tps = B * T * len(timed) / sum(timed)
    print(f"tokens_per_s: {tps:.1f}")


if __name__ == "__main__":
    main()
