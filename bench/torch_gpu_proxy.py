#!/usr/bin/env python3
"""torch_gpu_proxy.py: the PyTorch side of issue 32's speed comparison: a DeepSeek-V2-Lite-dimension proxy with fewer
layers, trained at sequence 4096 in bf16 on one GPU, eager and with torch.compile; prints tokens/s and MFU against
a bf16 matmul rate measured in the same process.

Written from the model description (DeepSeek-V2 paper, V2-Lite config): d_model 2048, vocab 102400, MLA with 16
heads, no query compression, kv_lora_rank 512, qk_nope 128 + qk_rope 64, v_head 128; RMSNorm; first layer dense
SwiGLU (10944), the others MoE: 64 routed experts of 1408 with top-6 softmax routing (no group limit) plus 2 shared
experts; RoPE theta 10000; untied embedding and head. Not the engine's reference (tools/torch_ref is): no aux
loss, no load balancing, random weights, random tokens: a speed proxy only.
Usage: torch_gpu_proxy.py [--layers 4] [--seq 4096] [--batch 1] [--steps 6] [--modes eager,compile]
Prints one "PROXY <mode> tokens/s <x> mfu <y>" line per mode and exits 0; a mode that fails prints why.
"""
import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

D, V, H, KV_RANK, NOPE, ROPE, VD = 2048, 102400, 16, 512, 128, 64, 128
DENSE_FF, E, TOPK, EXPERT_FF, SHARED = 10944, 64, 6, 1408, 2


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.w, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.w


def rope(x, cos, sin):  # half-split convention, x [B, H, T, R]
    h = x.shape[-1] // 2
    x0, x1 = x[..., :h], x[..., h:]
    return torch.cat([x0 * cos - x1 * sin, x1 * cos + x0 * sin], dim=-1)


class MLA(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq = nn.Linear(D, H * (NOPE + ROPE), bias=False)
        self.wkv_a = nn.Linear(D, KV_RANK + ROPE, bias=False)
        self.kv_norm = RMSNorm(KV_RANK)
        self.wkv_b = nn.Linear(KV_RANK, H * (NOPE + VD), bias=False)
        self.wo = nn.Linear(H * VD, D, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, H, NOPE + ROPE).transpose(1, 2)
        q_nope, q_pe = q.split([NOPE, ROPE], dim=-1)
        kv_a = self.wkv_a(x)
        c_kv, k_pe = kv_a.split([KV_RANK, ROPE], dim=-1)
        kv = self.wkv_b(self.kv_norm(c_kv)).view(B, T, H, NOPE + VD).transpose(1, 2)
        k_nope, v = kv.split([NOPE, VD], dim=-1)
        q_pe = rope(q_pe, cos, sin)
        k_pe = rope(k_pe.view(B, 1, T, ROPE), cos, sin).expand(B, H, T, ROPE)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe], dim=-1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 / math.sqrt(NOPE + ROPE))
        return self.wo(o.transpose(1, 2).reshape(B, T, H * VD))


class SwiGLU(nn.Module):
    def __init__(self, ff):
        super().__init__()
        self.gu = nn.Linear(D, 2 * ff, bias=False)
        self.down = nn.Linear(ff, D, bias=False)

    def forward(self, x):
        g, u = self.gu(x).chunk(2, dim=-1)
        return self.down(F.silu(g) * u)


class MoE(nn.Module):
    def __init__(self, grouped):
        super().__init__()
        self.gate = nn.Linear(D, E, bias=False)
        self.w_gu = nn.Parameter(torch.randn(E, D, 2 * EXPERT_FF) * 0.02)
        self.w_down = nn.Parameter(torch.randn(E, EXPERT_FF, D) * 0.02)
        self.shared = SwiGLU(SHARED * EXPERT_FF)
        self.grouped = grouped

    def experts(self, xs, counts):
        if self.grouped:
            offs = torch.cumsum(counts, 0).to(torch.int32)
            gu = torch._grouped_mm(xs, self.w_gu, offs=offs)
            g, u = gu.chunk(2, dim=-1)
            return torch._grouped_mm(F.silu(g) * u, self.w_down, offs=offs)
        out, start = [], 0
        for e, c in enumerate(counts.tolist()):  # eager loop: one host read-back of the counts
            xe = xs[start:start + c]
            g, u = (xe @ self.w_gu[e]).chunk(2, dim=-1)
            out.append((F.silu(g) * u) @ self.w_down[e])
            start += c
        return torch.cat(out)

    def forward(self, x):
        B, T, _ = x.shape
        xt = x.view(-1, D)
        scores = self.gate(xt).float().softmax(-1)
        w, idx = scores.topk(TOPK, dim=-1)
        flat = idx.view(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=E)
        xs = xt[order // TOPK]
        ys = self.experts(xs, counts)
        y = torch.zeros_like(xt)
        y.index_add_(0, order // TOPK, ys * w.view(-1)[order].unsqueeze(-1).to(ys.dtype))
        return (y + self.shared(xt)).view(B, T, D)


class Block(nn.Module):
    def __init__(self, moe, grouped):
        super().__init__()
        self.n1, self.attn, self.n2 = RMSNorm(D), MLA(), RMSNorm(D)
        self.ffn = MoE(grouped) if moe else SwiGLU(DENSE_FF)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.n1(x), cos, sin)
        return x + self.ffn(self.n2(x))


class Proxy(nn.Module):
    def __init__(self, layers, grouped):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([Block(i > 0, grouped) for i in range(layers)])
        self.norm, self.head = RMSNorm(D), nn.Linear(D, V, bias=False)

    def forward(self, tok, cos, sin):
        x = self.emb(tok)
        for b in self.blocks:
            x = b(x, cos, sin)
        return self.head(self.norm(x))


def active_params(layers):
    attn = D * H * (NOPE + ROPE) + D * (KV_RANK + ROPE) + KV_RANK * H * (NOPE + VD) + H * VD * D
    dense = 3 * D * DENSE_FF
    moe = D * E + 3 * D * EXPERT_FF * (TOPK + SHARED)
    return layers * attn + dense + (layers - 1) * moe + V * D  # head (the embedding is a lookup)


def train_flops_per_token(layers, T):
    attn = layers * 2 * 2 * (T / 2) * H * ((NOPE + ROPE) + VD) / 2  # causal: half the pairs, QK^T and PV
    return 6 * active_params(layers) + 3 * attn


def measure_matmul():
    n = 8192
    a, b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16), torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        a @ b
    e.record()
    torch.cuda.synchronize()
    return 2 * n ** 3 * 10 / (s.elapsed_time(e) * 1e-3)


def run(mode, a, peak):
    torch.manual_seed(0)
    grouped = hasattr(torch, "_grouped_mm") and not a.no_grouped
    model = Proxy(a.layers, grouped).cuda().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    T = a.seq
    inv = 1.0 / (10000 ** (torch.arange(0, ROPE, 2, device="cuda").float() / ROPE))
    ang = torch.arange(T, device="cuda").float()[:, None] * inv[None]
    cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
    step_model = torch.compile(model) if mode == "compile" else model
    tok = torch.randint(0, V, (a.batch, T + 1), device="cuda")

    def step():
        logits = step_model(tok[:, :-1], cos, sin)
        loss = F.cross_entropy(logits.float().view(-1, V), tok[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    t0 = time.time()
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    warm = time.time() - t0
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(a.steps):
        step()
    e.record()
    torch.cuda.synchronize()
    sec = s.elapsed_time(e) * 1e-3 / a.steps
    tps = a.batch * T / sec
    mfu = tps * train_flops_per_token(a.layers, T) / peak
    print(f"PROXY {mode:8s} tokens/s {tps:10.0f} mfu {100 * mfu:5.1f} % step {sec * 1e3:8.1f} ms warmup {warm:6.1f} s "
          f"grouped_mm={grouped} mem {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--modes", default="eager,compile")
    ap.add_argument("--no-grouped", action="store_true", help="loop over experts instead of torch._grouped_mm")
    a = ap.parse_args()
    peak = measure_matmul()
    print(f"PROXY matmul_bf16_8192 {peak / 1e12:.1f} TFLOP/s (the MFU denominator)", flush=True)
    print(f"PROXY model layers={a.layers} seq={a.seq} batch={a.batch} active_params={active_params(a.layers) / 1e9:.2f}B "
          f"train_flops/token={train_flops_per_token(a.layers, a.seq) / 1e9:.2f}G", flush=True)
    for mode in a.modes.split(","):
        try:
            run(mode, a, peak)
        except Exception as ex:  # report and go on to the next mode
            print(f"PROXY {mode} failed: {type(ex).__name__}: {str(ex).splitlines()[0][:300]}", flush=True)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


if __name__ == "__main__":
    main()
