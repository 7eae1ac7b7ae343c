"""moetron_ref.py: the moetron model (src/model/model.cpp) written again in PyTorch, for two uses:

  1. the reference for tests/unit/test_reference.cpp (llm.c's train_gpt2.py / test_gpt2.c pattern):
     `moetron_ref.py gen DUMP.safetensors OUT.safetensors` reads the engine's initial parameters and a batch
     (written by `moetron debug dump-init`), runs forward / backward and 5 AdamW steps in float64 and writes
     the logits, losses, gradients and parameters after 5 steps;
  2. the eager PyTorch model of bench/torch_ds_mini.py (float32 parameters, fp32 or CPU bf16 autocast).

It is NOT a second engine: no data pipeline, no checkpoints, no capacity dropping (capacity_factor must be 0).
The config reader is ref_config.py (no torch needed): it knows every key the engine writes and refuses by name
the values this file does not implement (model.ffn = "gelu", model.dropout > 0, capacity_factor > 0).

Everything mirrors model.cpp and the kernel headers:
  - parameter names, shapes and layouts are the engine's: weights [in, out]; embed and head [V, d]; fused
    w13 = [gate | up]; MHA/GQA wqkv = [q heads | k heads | v heads] (with qk_norm: attn.q_head_norm and
    attn.k_head_norm [head_dim], Qwen3's per-head RMSNorm of q and k before RoPE); MLA wdq, q_norm, wuq (or wq), wdkv, wkr,
    kv_norm, wukv (per head [k_nope | v]); experts [E, d, 2F] and [E, F, d]; shared experts one SwiGLU of
    width n_shared * F;
  - RoPE half-split (rope.h) on the whole head (MHA/GQA) or on the decoupled rotary slice (MLA: q heads at
    offset qk_nope_head_dim, the single shared k_pe head);
  - router (router.h): softmax / sigmoid scores, Sinkhorn column factors and bias for selection only,
    group-limited top-k (group score max for softmax, top-2 sum for sigmoid, as model.cpp chooses), ties to the lower index, norm_topk,
    route_scale, aux loss global or per sequence with f held constant, z-loss;
  - cross-entropy mean over the B*T tokens (ce_scale = 1/N), targets -1 ignored;
  - AdamW exactly as optim.h, with the trainer's clipping (clip_coefficient) and lr_at schedule, decay only
    on matrices (decay=true in model.cpp: every parameter except the RMSNorm weights).

Precision modes (`Prec`):
  fp64    every op in float64: the mathematically exact model;
  emu     float64, but every matmul operand is rounded to bf16 exactly where model.cpp rounds it (x16 / W16 in
          the forward, dy16 in both backward GEMMs; the router gate stays unrounded like the engine's fp32
          gate GEMM). This removes the bf16 error from the comparison and leaves only fp32-vs-fp64
          accumulation, so the C++ test can use tight tolerances;
  autocast float32 parameters, matmuls under torch.autocast("cpu", bfloat16) (benchmark only);
  fp32     float32 parameters and matmuls, no autocast (benchmark only: the engine's compute_dtype = "fp32").
Prec.moe picks how the routed experts run: `loop` (per expert, the reference form), `sorted` (one gather, per-expert
matmuls on its blocks, one scatter) or `padded` (torch.bmm over a zero-padded [E, C, d] gather); the last two are
the benchmark's faster alternatives and compute the same sums.

Only /usr/bin/python3 (Debian python3-torch 1.13) has torch on this machine.
"""
import json
import math
import os
import struct
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ref_config import (MODELLED, ConfigError, Unsupported, config_from_toml_text, is_moe_layer,  # noqa: E402,F401
                        known_keys, load_config)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# ---------------------------------------------------------------------------------------------------------
# safetensors (stdlib reader / writer: 8-byte LE header length, JSON header, row-major LE data)

_ST_DTYPES = {"F32": (np.float32, 4), "F64": (np.float64, 8), "I32": (np.int32, 4), "I64": (np.int64, 8),
              "U8": (np.uint8, 1)}


def read_safetensors(path):
    """Returns ({name: numpy array}, metadata dict)."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n].decode("utf-8"))
    meta = header.pop("__metadata__", {}) or {}
    base = 8 + n
    out = {}
    for name, info in header.items():
        dt = info["dtype"]
        if dt not in _ST_DTYPES:
            raise ValueError(f"{path}: tensor {name}: unsupported dtype {dt}")
        npdt, size = _ST_DTYPES[dt]
        b, e = info["data_offsets"]
        arr = np.frombuffer(data[base + b:base + e], dtype=npdt).copy()
        shape = info["shape"]
        if arr.size != (math.prod(shape) if shape else 1):
            raise ValueError(f"{path}: tensor {name}: {arr.size} elements for shape {shape}")
        out[name] = arr.reshape(shape)
    return out, meta


def write_safetensors(path, tensors, metadata=None):
    """tensors: {name: numpy array} of float32 / int32 (written in name order)."""
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        if a.dtype == np.float32:
            dt = "F32"
        elif a.dtype == np.int32:
            dt = "I32"
        else:
            raise ValueError(f"tensor {name}: write float32 or int32, not {a.dtype}")
        raw = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    h = json.dumps(header, separators=(",", ":")).encode("utf-8")
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


# ---------------------------------------------------------------------------------------------------------
# config: the same TOML as the engine, read by ref_config.py (no torch there: tests/torch_ref/check_configs.py
# imports it in CI). DEFAULTS is its MODELLED table: the keys the reference computes with and their defaults.

DEFAULTS = MODELLED


# ---------------------------------------------------------------------------------------------------------
# parameters: the engine's list (model.cpp Impl::build), in its order

def attn_dims(m):
    """The attention widths of model section m: (mla, dn, dr, dv, rq, rkv, dqk, hd, hkv); the other family's are 0."""
    if m["attn_type"] == "mla":
        dn, dr, dv = m["qk_nope_head_dim"], m["qk_rope_head_dim"], m["v_head_dim"]
        return True, dn, dr, dv, m["q_lora_rank"], m["kv_lora_rank"], dn + dr, 0, 0
    hd = m["head_dim"]
    return False, 0, 0, hd, 0, 0, hd, hd, m["n_kv_heads"]


def param_specs(m):
    """[(name, shape, kind)] with kind 'ones' (RMSNorm weights, no decay) or 'normal' (matrices, decay)."""
    V, d, H = m["vocab_size"], m["d_model"], m["n_heads"]
    ps = [("embed", (V, d), "normal")]
    mla, dn, dr, dv, rq, rkv, dqk, hd, hkv = attn_dims(m)
    E, Fe = m["n_routed_experts"], m["moe_inter_size"]
    Fs = m["n_shared_experts"] * Fe
    L, D = m["n_layers"], m["mtp_layers"]
    for l in range(L + D):  # the decoder layers, then the MTP depths' blocks (the last layer's kind)
        p = f"layers.{l}." if l < L else f"mtp.{l - L}.block."
        if l >= L:
            q = f"mtp.{l - L}."
            ps += [(q + "enorm", (d,), "ones"), (q + "hnorm", (d,), "ones"), (q + "eh_proj", (2 * d, d), "normal"),
                   (q + "norm", (d,), "ones")]
        ps.append((p + "attn_norm", (d,), "ones"))
        if mla:
            if rq > 0:
                ps += [(p + "attn.wdq", (d, rq), "normal"), (p + "attn.q_norm", (rq,), "ones"),
                       (p + "attn.wuq", (rq, H * dqk), "normal")]
            else:
                ps.append((p + "attn.wq", (d, H * dqk), "normal"))
            ps += [(p + "attn.wdkv", (d, rkv), "normal"), (p + "attn.wkr", (d, dr), "normal"),
                   (p + "attn.kv_norm", (rkv,), "ones"), (p + "attn.wukv", (rkv, H * (dn + dv)), "normal")]
        else:
            ps.append((p + "attn.wqkv", (d, (H + 2 * hkv) * hd), "normal"))
            if m["qk_norm"]:
                ps += [(p + "attn.q_head_norm", (hd,), "ones"), (p + "attn.k_head_norm", (hd,), "ones")]
        ps.append((p + "attn.wo", (H * dv, d), "normal"))
        ps.append((p + "ffn_norm", (d,), "ones"))
        if not is_moe_layer(m, min(l, L - 1)):
            F_ = m["inter_size"]
            ps += [(p + "mlp.w13", (d, 2 * F_), "normal"), (p + "mlp.w2", (F_, d), "normal")]
        else:
            ps += [(p + "moe.gate", (d, E), "normal"), (p + "moe.experts.w13", (E, d, 2 * Fe), "normal"),
                   (p + "moe.experts.w2", (E, Fe, d), "normal")]
            if Fs > 0:
                ps += [(p + "moe.shared.w13", (d, 2 * Fs), "normal"), (p + "moe.shared.w2", (Fs, d), "normal")]
    ps.append(("final_norm", (d,), "ones"))
    if not m["tie_embeddings"]:
        ps.append(("head", (V, d), "normal"))
    return ps


def init_params(m, dtype=torch.float32, seed=0):
    """Fresh parameters for the benchmark (torch RNG, not the engine's Philox: values differ, shapes agree)."""
    g = torch.Generator().manual_seed(seed)
    P = {}
    for name, shape, kind in param_specs(m):
        if kind == "ones":
            t = torch.ones(shape, dtype=dtype)
        else:
            t = torch.randn(shape, generator=g, dtype=torch.float32).mul_(m["init_std"]).to(dtype)
        P[name] = t.requires_grad_(True)
    return P


def decays(name):
    return not name.endswith("norm")  # model.cpp: decay=false exactly for the RMSNorm weights


# ---------------------------------------------------------------------------------------------------------
# precision

def bf16_round(x):
    """Round to bf16 (round to nearest even) and back, keeping x's dtype."""
    return x.to(torch.float32).to(torch.bfloat16).to(x.dtype)


class _Lin16(torch.autograd.Function):
    """y = bf16(x) @ bf16(w); backward rounds dy once to bf16 and uses it for both GEMMs (model.cpp lin_*)."""

    @staticmethod
    def forward(ctx, x, w):
        xr, wr = bf16_round(x), bf16_round(w)
        ctx.save_for_backward(xr, wr)
        return xr @ wr

    @staticmethod
    def backward(ctx, dy):
        xr, wr = ctx.saved_tensors
        dyr = bf16_round(dy)
        return dyr @ wr.transpose(-1, -2), xr.transpose(-1, -2) @ dyr


class Prec:
    """How forward() computes: `mode` the precision, `moe` how moe_ffn runs the routed experts.

    mode: fp64 | emu (see the module docstring) | autocast (float32 parameters, the caller enters
          torch.autocast("cpu", bfloat16)) | fp32 (float32 parameters and matmuls, no autocast; the engine's
          compute_dtype = "fp32"). fp32 and autocast compute matmuls plainly; autocast does the casting.
    moe:  loop   one index_select / matmul pair / index_add per expert (the reference form);
          sorted one gather of all routed rows in expert order, per-expert matmul pairs on torch.split
                 blocks, one index_add back;
          padded every expert's rows gathered into one zero-padded [E, C, d] tensor, C = the most rows any
          expert got in this call, then torch.bmm against the [E, d, 2F] and [E, F, d] weights and one
          scatter back.
          The three add the same products, sorted and padded in other orders: they agree to rounding.
    """

    MODES = ("fp64", "emu", "autocast", "fp32")
    MOE = ("loop", "sorted", "padded")

    def __init__(self, mode, moe="loop"):
        if mode not in self.MODES:
            raise ValueError(f"Prec: mode {mode!r} is not one of {self.MODES}")
        if moe not in self.MOE:
            raise ValueError(f"Prec: moe {moe!r} is not one of {self.MOE}")
        self.mode = mode
        self.moe = moe

    def mm(self, x, w):
        """x [..., in] @ w [in, out] with the engine's bf16 operands (emu) or plainly."""
        if self.mode == "emu":
            return _Lin16.apply(x, w)
        return x @ w

    def bmm(self, x, w):
        """x [E, C, in] @ w [E, in, out], rounded like mm (emu) or plainly (torch.bmm)."""
        if self.mode == "emu":
            return _Lin16.apply(x, w)
        return torch.bmm(x, w)


# ---------------------------------------------------------------------------------------------------------
# layers

def rmsnorm(x, w, eps):
    xf = x.float() if x.dtype == torch.bfloat16 else x
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf * rstd * w


def rope_tables(T, R, theta, dtype):
    """cos/sin [T, R/2]: angle t * theta^(-2i/R) (rope.h)."""
    i = torch.arange(R // 2, dtype=torch.float64)
    inv = theta ** (-2.0 * i / R)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cos(ang).to(dtype), torch.sin(ang).to(dtype)


def rope(x, cos, sin):
    """Half-split rotation of the last dim of x [B, T, ..., R]; cos/sin [T, R/2]."""
    half = x.shape[-1] // 2
    x0, x1 = x[..., :half], x[..., half:]
    shape = [1, cos.shape[0]] + [1] * (x.dim() - 3) + [half]
    c, s = cos.view(shape), sin.view(shape)
    return torch.cat([x0 * c - x1 * s, x1 * c + x0 * s], dim=-1)


def causal_attention(q, k, v, scale):
    """q [B, T, H, Dqk], k [B, T, H, Dqk], v [B, T, H, Dv] -> out [B, T, H * Dv]. Scores and softmax in
    float32 at least (float64 in the reference); under autocast the two matmuls run in bf16."""
    B, T, H, _ = q.shape
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    s = q @ k.transpose(-1, -2)
    if s.dtype != torch.float64:
        s = s.float()
    s = (s * scale).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.softmax(s, dim=-1) @ v
    return o.transpose(1, 2).reshape(B, T, -1)


def swiglu(gu):
    """silu(gate) * up of gu = [gate | up]; chunk, not two slices: its backward is one cat, not two full-size
    zero gradients added together (same values)."""
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u


# ---------------------------------------------------------------------------------------------------------
# router (router.h)

def _stable_desc_order(x):
    """Indices sorting x [N, M] by decreasing value, ties to the lower index."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices


def route(logits, bias, m, T, forced_idx=None):
    """Returns (topk_idx [N, k], topk_w [N, k], counts [E], aux, z, margin).
    logits [N, E] (float32 or float64, not rounded); bias [E] tensor or None; margin = the smallest gap between
    the last chosen and the first rejected selection score (and between the kept and dropped groups)."""
    N, E = logits.shape
    k, ng, tg = m["topk"], m["n_group"], m["topk_group"]
    sigmoid = m["score_func"] == "sigmoid"
    s = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, dim=-1)
    q = s.detach()
    iters = m.get("sinkhorn_iters", 0)
    if iters > 0:  # Sinkhorn selection (router.h): column factors c of the call's score matrix, mean 1; q = s * c
        sd = s.detach().to(torch.float64)
        c = torch.ones(E, dtype=torch.float64)
        for _ in range(iters):
            r = 1.0 / (sd * c).sum(dim=1)
            c = (N / E) / (sd * r[:, None]).sum(dim=0)
        c = c / c.mean()
        q = q * c.to(torch.float32).to(q.dtype)
    q = q + (bias.to(s.dtype) if bias is not None else 0)
    margin = math.inf
    if ng > 1:
        G = E // ng
        qg = q.view(N, ng, G)
        if sigmoid:  # GroupScore::Top2Sum (model.cpp ties the group score to the score function)
            top = torch.sort(qg, dim=-1, descending=True).values
            gs = top[..., 0] + top[..., 1] if G >= 2 else top[..., 0]
        else:  # GroupScore::Max
            gs = qg.max(dim=-1).values
        order = _stable_desc_order(gs)
        if tg < ng:
            gsorted = gs.gather(1, order)
            margin = min(margin, float((gsorted[:, tg - 1] - gsorted[:, tg]).min()))
        keep = torch.zeros(N, ng, dtype=torch.bool)
        keep.scatter_(1, order[:, :tg], True)
        eligible = keep[:, :, None].expand(N, ng, G).reshape(N, E)
        qsel = q.masked_fill(~eligible, float("-inf"))
    else:
        qsel = q
    order = _stable_desc_order(qsel)
    idx = order[:, :k]
    qs = qsel.gather(1, order)
    if k < E:
        gap = qs[:, k - 1] - qs[:, k]
        gap = gap[torch.isfinite(gap)]
        if gap.numel():
            margin = min(margin, float(gap.min()))
    cap = m.get("route_capacity", 0.0)
    if cap > 0:  # capacity routing (router.h): tokens in order take their best experts below C assignments
        C = math.ceil(cap * N * k / E - 1e-9)
        cnt, qq, rows = [0] * E, q.tolist(), []
        for n in range(N):
            row = []
            for _ in range(k):
                best = -1
                for e in range(E):
                    if e not in row and cnt[e] < C and (best < 0 or qq[n][e] > qq[n][best]):
                        best = e
                if best < 0:  # fewer than k experts with room: the best unused one (router.cpp)
                    for e in range(E):
                        if e not in row and (best < 0 or qq[n][e] > qq[n][best]):
                            best = e
                row.append(best)
                cnt[best] += 1
            rows.append(row)
        idx = torch.tensor(rows, dtype=torch.int64)
    if forced_idx is not None:
        idx = forced_idx
    w = s.gather(1, idx)
    if m["norm_topk_prob"]:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    w = w * m["route_scale"]
    counts = torch.bincount(idx.reshape(-1), minlength=E)
    # aux loss: model.cpp enables it for load_balance = aux_loss, and for aux_free when aux_coef > 0
    lb = m["load_balance"]
    aux = logits.new_zeros(())
    if lb == "aux_loss" or (lb == "aux_free" and m["aux_coef"] > 0):
        sp = s / (s.sum(-1, keepdim=True) + 1e-20) if sigmoid else s
        Ts = T if m["aux_seq_wise"] else N
        S = N // Ts
        oh = F.one_hot(idx.reshape(S, Ts * k), E).to(s.dtype)  # f: counts per sequence, no gradient
        f = oh.sum(1) / (Ts * k)                                  # [S, E]
        P = sp.view(S, Ts, E).mean(1)                             # [S, E]
        aux = (m["aux_coef"] * E * (f * P).sum(-1)).mean()
    z = logits.new_zeros(())
    if m["z_loss_coef"] > 0:
        z = m["z_loss_coef"] * torch.logsumexp(logits, dim=-1).pow(2).mean()
    return idx, w, counts, aux, z, margin


# ---------------------------------------------------------------------------------------------------------
# the model

class State:
    """Per-call inputs and outputs besides parameters: expert biases, forced selections, recorded routing."""

    def __init__(self, biases=None, forced=None):
        self.biases = biases or {}   # moe layer index -> [E] tensor (aux_free)
        self.forced = forced         # list of [N, k] index tensors per MoE layer, or None
        self.idx, self.counts, self.margins = [], [], []


def forward(P, tokens, targets, cfg, prec, st, B, T):
    """Returns (total loss for backward, ce mean, aux sum, z sum, logits [N, V])."""
    m = cfg["model"]
    V, d, H, eps = m["vocab_size"], m["d_model"], m["n_heads"], m["norm_eps"]
    N = B * T
    pdt = P["embed"].dtype
    mla, dn, dr, dv, rq, rkv, dqk, hd, hkv = attn_dims(m)
    cos, sin = rope_tables(T, dr if mla else hd, m["rope_theta"], pdt)
    scale = 1.0 / math.sqrt(dqk)
    mm = prec.mm
    x = P["embed"][tokens]  # [N, d]
    st.aux_sum = x.new_zeros(())
    st.z_sum = x.new_zeros(())
    st.moe_i = 0
    L = m["n_layers"]
    for l in range(L):
        x = block(P, f"layers.{l}.", x, is_moe_layer(m, l), cfg, prec, st, B, T, cos, sin)
    hf = rmsnorm(x, P["final_norm"], eps)
    head = P["embed"] if m["tie_embeddings"] else P["head"]
    logits = mm(hf, head.t())  # [N, V]
    ce = F.cross_entropy(logits.float() if logits.dtype == torch.bfloat16 else logits, targets,
                         ignore_index=-1, reduction="sum") / N
    # Multi-token prediction (model_mtp.cpp): depth k = 1..D at position i reads t_{i+k} = targets[i+k-1] and
    # predicts targets[i+k]; positions past the sequence (or with an ignored token) take token 0 and no target.
    # Each depth's mean over its T - k positions per sequence; loss = weight * mean over depths.
    D = m["mtp_layers"]
    st.mtp_ce = []
    mtp = x.new_zeros(())
    h = x
    tg = targets.view(B, T)
    for k in range(1, D + 1):
        q = f"mtp.{k - 1}."
        tin = torch.full((B, T), -1, dtype=torch.int64)
        tout = torch.full((B, T), -1, dtype=torch.int64)
        tin[:, :T - k + 1] = tg[:, k - 1:]
        tout[:, :T - k] = tg[:, k:]
        tout = torch.where(tin >= 0, tout, torch.full_like(tout, -1)).view(-1)
        tin = torch.where(tin >= 0, tin, torch.zeros_like(tin)).view(-1)
        cat = torch.cat([rmsnorm(P["embed"][tin], P[q + "enorm"], eps), rmsnorm(h, P[q + "hnorm"], eps)], dim=-1)
        h = block(P, q + "block.", mm(cat, P[q + "eh_proj"]), is_moe_layer(m, L - 1), cfg, prec, st, B, T, cos, sin)
        lk = mm(rmsnorm(h, P[q + "norm"], eps), head.t())
        cek = F.cross_entropy(lk.float() if lk.dtype == torch.bfloat16 else lk, tout, ignore_index=-1,
                              reduction="sum")
        st.mtp_ce.append(cek)
        mtp = mtp + cek / (B * (T - k))
    if D > 0:
        mtp = mtp * (m["mtp_loss_weight"] / D)
    st.mtp = mtp
    total = ce + st.aux_sum + st.z_sum + mtp
    return total, ce, st.aux_sum, st.z_sum, logits


def block(P, p, x, moe, cfg, prec, st, B, T, cos, sin):
    """One decoder layer (parameters under prefix p) on x [N, d]; MoE statistics into st."""
    m = cfg["model"]
    d, H, eps = m["d_model"], m["n_heads"], m["norm_eps"]
    N = B * T
    mla, dn, dr, dv, rq, rkv, dqk, hd, hkv = attn_dims(m)
    scale = 1.0 / math.sqrt(dqk)
    mm = prec.mm
    if True:
        h = rmsnorm(x, P[p + "attn_norm"], eps)
        if not mla:
            qkv = mm(h, P[p + "attn.wqkv"]).view(B, T, H + 2 * hkv, hd)
            qk = qkv[:, :, :H + hkv]
            if m["qk_norm"]:  # per-head RMSNorm over head_dim, before RoPE (Qwen3)
                qk = torch.cat([rmsnorm(qk[:, :, :H], P[p + "attn.q_head_norm"], eps),
                                rmsnorm(qk[:, :, H:], P[p + "attn.k_head_norm"], eps)], dim=2)
            qk = rope(qk, cos, sin)
            q, k = qk[:, :, :H], qk[:, :, H:]
            v = qkv[:, :, H + hkv:]
            if hkv != H:
                k = k.repeat_interleave(H // hkv, dim=2)
                v = v.repeat_interleave(H // hkv, dim=2)
        else:
            if rq > 0:
                cq = rmsnorm(mm(h, P[p + "attn.wdq"]), P[p + "attn.q_norm"], eps)
                q = mm(cq, P[p + "attn.wuq"])
            else:
                q = mm(h, P[p + "attn.wq"])
            q = q.view(B, T, H, dqk)
            q = torch.cat([q[..., :dn], rope(q[..., dn:], cos, sin)], dim=-1)
            ckv = rmsnorm(mm(h, P[p + "attn.wdkv"]), P[p + "attn.kv_norm"], eps)
            kpe = rope(mm(h, P[p + "attn.wkr"]).view(B, T, 1, dr), cos, sin)
            kv = mm(ckv, P[p + "attn.wukv"]).view(B, T, H, dn + dv)
            k = torch.cat([kv[..., :dn], kpe.expand(B, T, H, dr)], dim=-1)
            v = kv[..., dn:]
        ao = causal_attention(q, k, v, scale).reshape(N, H * dv)
        x = x + mm(ao, P[p + "attn.wo"])
        h2 = rmsnorm(x, P[p + "ffn_norm"], eps)
        if not moe:
            y = mm(swiglu(mm(h2, P[p + "mlp.w13"])), P[p + "mlp.w2"])
        else:
            y = moe_ffn(P, p, h2, m, prec, st, st.moe_i, T)
            st.aux_sum = st.aux_sum + st.last_aux
            st.z_sum = st.z_sum + st.last_z
            st.moe_i += 1
        x = x + y
    return x


def moe_ffn(P, p, h2, m, prec, st, moe_i, T):
    """Routed experts (prec.moe: `loop` or `padded`, see Prec) plus the shared experts."""
    N, d = h2.shape
    E, k = m["n_routed_experts"], m["topk"]
    gate = P[p + "moe.gate"]
    if torch.is_autocast_cpu_enabled():
        with torch.autocast("cpu", enabled=False):  # the engine's gate GEMM is fp32
            logits = h2.float() @ gate.float()
    else:
        logits = h2 @ gate  # unrounded, like model.cpp's gemm_f32
    forced = st.forced[moe_i] if st.forced is not None else None
    idx, w, counts, aux, z, margin = route(logits, st.biases.get(moe_i), m, T, forced)
    st.idx.append(idx)
    st.counts.append(counts)
    st.margins.append(margin)
    st.last_aux, st.last_z = aux, z
    # expert-major plan, stable in (token, slot) order (permute.h)
    flat = idx.reshape(-1)
    perm = torch.sort(flat, stable=True).indices
    tok = perm // k
    wflat = w.reshape(-1)
    W13, W2 = P[p + "moe.experts.w13"], P[p + "moe.experts.w2"]
    if prec.moe == "padded":
        y = _experts_padded(h2, W13, W2, flat, perm, tok, wflat, counts, prec)
    elif prec.moe == "sorted":
        y = _experts_sorted(h2, W13, W2, perm, tok, wflat, counts, prec.mm)
    else:
        y = _experts_loop(h2, W13, W2, perm, tok, wflat, counts, prec.mm)
    if m["n_shared_experts"] > 0:
        ys = prec.mm(swiglu(prec.mm(h2, P[p + "moe.shared.w13"])), P[p + "moe.shared.w2"])
        y = y + ys
    return y


def _experts_loop(h2, W13, W2, perm, tok, wflat, counts, mm):
    """The eager standard: per expert, index_select its rows, two matmuls, weight, index_add (expert order).
    The expert weights are taken apart with unbind (one stack in the backward) rather than W[e] (a full-size
    zero gradient per expert), and y grows in place; neither changes a sum."""
    N, d = h2.shape
    bounds = [0] + torch.cumsum(counts, 0).tolist()
    W13s, W2s = W13.unbind(0), W2.unbind(0)
    y = None
    for e in range(W13.shape[0]):
        b, en = bounds[e], bounds[e + 1]
        if en == b:
            continue
        te = tok[b:en]
        xe = h2.index_select(0, te)
        ze = mm(swiglu(mm(xe, W13s[e])), W2s[e])
        ze = ze * wflat.index_select(0, perm[b:en])[:, None].to(ze.dtype)
        if y is None:
            y = torch.zeros(N, d, dtype=ze.dtype)
        y.index_add_(0, te, ze)
    return y if y is not None else torch.zeros(N, d, dtype=h2.dtype)


def _experts_sorted(h2, W13, W2, perm, tok, wflat, counts, mm):
    """One gather of all routed rows in expert order, torch.split into the experts' blocks, two matmuls per
    expert, torch.cat, one weighting and one index_add: the loop's sums without its per-expert gathers and
    scatters over all N rows (whose backward passes each touch an [N, d] tensor)."""
    N, d = h2.shape
    cnt = counts.tolist()
    W13s, W2s = W13.unbind(0), W2.unbind(0)
    outs = [mm(swiglu(mm(xe, W13s[e])), W2s[e])
            for e, xe in enumerate(torch.split(h2.index_select(0, tok), cnt)) if cnt[e] > 0]
    ys = torch.cat(outs)
    ys = ys * wflat.index_select(0, perm)[:, None].to(ys.dtype)
    return torch.zeros(N, d, dtype=ys.dtype).index_add(0, tok, ys)


def _experts_padded(h2, W13, W2, flat, perm, tok, wflat, counts, prec):
    """Batched experts: row r of the expert-sorted plan (expert e, j-th row of e) goes to slot e * C + j of a
    zero [E * C, d] tensor, C = max(counts); two torch.bmm; the slots are read back, weighted and index_added
    into the tokens in the same (expert, row) order as the loop. Padding rows stay zero (SwiGLU(0) = 0) and
    are never read back, so they add nothing to the output or the gradients."""
    N, d = h2.shape
    E = W13.shape[0]
    R = flat.numel()
    C = int(counts.max())
    start = torch.cumsum(counts, 0) - counts                       # first sorted row of each expert
    es = flat.index_select(0, perm)                                 # expert of each sorted row
    slot = es * C + (torch.arange(R) - start.index_select(0, es))  # its padded slot
    xp = h2.new_zeros(E * C, d).index_copy(0, slot, h2.index_select(0, tok))
    hp = swiglu(prec.bmm(xp.view(E, C, d), W13))                    # [E, C, F]
    yp = prec.bmm(hp, W2).reshape(E * C, d)
    ye = yp.index_select(0, slot) * wflat.index_select(0, perm)[:, None].to(yp.dtype)
    return torch.zeros(N, d, dtype=ye.dtype).index_add(0, tok, ye)


# ---------------------------------------------------------------------------------------------------------
# optimizer and schedule (trainer.cpp lr_at, optim.h)

def lr_at(cfg, step, total):
    o, s = cfg["optimizer"], cfg["lr_scheduler"]
    lr = o["lr"]
    if s["warmup_steps"] > 0 and step <= s["warmup_steps"]:
        return lr * step / s["warmup_steps"]
    if s["decay_type"] == "none":
        return lr
    span = total - s["warmup_steps"]
    pr = min(1.0, (step - s["warmup_steps"]) / span) if span > 0 else 1.0
    mn = s["min_lr_ratio"]
    f = mn + (1 - mn) * 0.5 * (1 + math.cos(math.pi * pr)) if s["decay_type"] == "cosine" else 1 - (1 - mn) * pr
    return lr * f


def clip_coefficient(norm, max_norm):
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))


@torch.no_grad()
def adamw_step(P, grads, M, Vv, cfg, step, lr, clip):
    """Textbook AdamW (optim.h order): gi = g * clip; m, v; decoupled decay; bias-corrected update."""
    o = cfg["optimizer"]
    b1, b2, eps, wd = o["beta1"], o["beta2"], o["eps"], o["weight_decay"]
    bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
    for name, p in P.items():
        g = grads[name] * clip
        M[name].mul_(b1).add_((1 - b1) * g)
        Vv[name].mul_(b2).add_((1 - b2) * g * g)
        if decays(name):
            p.mul_(1 - lr * wd)
        p.sub_(lr / bc1 * M[name] / (Vv[name].sqrt() / math.sqrt(bc2) + eps))


def update_bias(bias, counts, rate, form="sign"):
    """router_update_bias: bias_e += rate * sign(mean_count - counts_e); form "proportional"
    (router_update_bias_proportional): bias_e += rate * clamp((mean - counts_e) / mean, -1, 1), no step at mean 0."""
    c = counts.to(torch.float64)
    mean = c.sum() / c.numel()
    if form == "proportional":
        if float(mean) > 0:
            bias += rate * torch.clamp((mean - c) / mean, -1.0, 1.0).to(bias.dtype)
        return
    bias += rate * torch.sign(mean - c).to(bias.dtype)


# ---------------------------------------------------------------------------------------------------------
# reference generation

def train_reference(cfg, P0, biases0, tokens, targets, B, T, mode, steps, forced_steps=None):
    """Runs `steps` trainer steps (one micro-batch each, same batch) in float64 with precision `mode`.
    Returns a dict with step-1 logits / losses / grads, per-step losses, final params and biases, and the
    routing of every step (to replay in another mode)."""
    m = cfg["model"]
    prec = Prec(mode)
    P = {n: torch.tensor(a, dtype=torch.float64).requires_grad_(True) for n, a in P0.items()}
    biases = {i: torch.tensor(b, dtype=torch.float64) for i, b in biases0.items()}
    M = {n: torch.zeros_like(p) for n, p in P.items()}
    Vv = {n: torch.zeros_like(p) for n, p in P.items()}
    tok = torch.tensor(tokens, dtype=torch.int64)
    tgt = torch.tensor(targets, dtype=torch.int64)
    out = {"losses": [], "aux_losses": [], "z_losses": [], "grad_norms": [], "lrs": [], "routing": [],
           "margins": [], "counts": []}
    for step in range(1, steps + 1):
        st = State(biases={i: b.clone() for i, b in biases.items()},
                   forced=forced_steps[step - 1] if forced_steps is not None else None)
        for p in P.values():
            p.grad = None
        total, ce, aux, z, logits = forward(P, tok, tgt, cfg, prec, st, B, T)
        total.backward()
        grads = {n: p.grad.detach().clone() for n, p in P.items()}
        gn = math.sqrt(sum(float((g * g).sum()) for g in grads.values()))
        clip = clip_coefficient(gn, cfg["training"]["max_norm"])
        lr = lr_at(cfg, step, steps)
        out.setdefault("mtp_losses", []).append(float(st.mtp))
        if step == 1:
            out["mtp_ce"] = [float(c) for c in st.mtp_ce]
            out["logits"] = logits.detach().clone()
            out["grads"] = grads
            out["loss"], out["aux_loss"], out["z_loss"] = float(ce), float(aux), float(z)
        out["losses"].append(float(ce))
        out["aux_losses"].append(float(aux))
        out["z_losses"].append(float(z))
        out["grad_norms"].append(gn)
        out["lrs"].append(lr)
        out["routing"].append([i.clone() for i in st.idx])
        out["margins"].append(min(st.margins) if st.margins else math.inf)
        out["counts"].append([c.clone() for c in st.counts])
        adamw_step(P, grads, M, Vv, cfg, step, lr, clip)
        if m["load_balance"] == "aux_free":
            for i, c in enumerate(st.counts):
                update_bias(biases[i], c, m["bias_update_rate"], m.get("bias_update", "sign"))
    out["params"] = {n: p.detach().clone() for n, p in P.items()}
    out["biases"] = biases
    return out


def gen(dump_path, out_path, steps=5, toml_path=None):
    t, meta = read_safetensors(dump_path)
    cfg = config_from_toml_text(meta["config_toml"], source=f"{dump_path} (config_toml)")  # every key explicit
    if toml_path:  # this file's TOML loader + defaults must agree with the engine's on the original file
        mine = load_config(toml_path)
        for sec in MODELLED:
            if mine[sec] != cfg[sec]:
                diff = {k: (mine[sec][k], cfg[sec][k]) for k in cfg[sec] if mine[sec][k] != cfg[sec][k]}
                raise SystemExit(f"{toml_path}: [{sec}] read differently by moetron_ref.py (mine, engine): {diff}")
    B, T = int(meta["B"]), int(meta["T"])
    m = cfg["model"]
    assert B == cfg["training"]["micro_batch_size"] and T == cfg["training"]["seq_len"]
    specs = param_specs(m)
    names = [n for n, _, _ in specs]
    got = sorted(k[len("param."):] for k in t if k.startswith("param."))
    if sorted(names) != got:
        raise SystemExit(f"parameter set differs from the engine's:\n ref {sorted(names)}\n engine {got}")
    for n, shape, _ in specs:
        if tuple(t["param." + n].shape) != tuple(shape):
            raise SystemExit(f"{n}: engine shape {t['param.' + n].shape}, reference {shape}")
    P0 = {n: t["param." + n] for n in names}
    nmoe = sum(is_moe_layer(m, l) for l in range(m["n_layers"]))
    nmoe += m["mtp_layers"] if is_moe_layer(m, m["n_layers"] - 1) else 0  # the MTP blocks' MoE layers follow
    biases0 = {i: t[f"expert_bias.{i}"] for i in range(nmoe)}
    tokens, targets = t["tokens"], t["targets"]
    torch.set_num_threads(1)

    emu = train_reference(cfg, P0, biases0, tokens, targets, B, T, "emu", steps)
    # fp64: the exact model with the routing held fixed to the emu run's choice at every step (top-k is
    # piecewise constant; near-ties would otherwise flip experts between bf16 and fp64 and no tolerance fits)
    ex = train_reference(cfg, P0, biases0, tokens, targets, B, T, "fp64", steps, forced_steps=emu["routing"])
    # free fp64: the exact model choosing its own routing at every step. The engine's fp32 compute path routes
    # by fp32 logits, which agree with fp64 except within ~1e-7 of a tie, so it is held to this set.
    free = train_reference(cfg, P0, biases0, tokens, targets, B, T, "fp64", steps)
    flips = sum(int((a != b).any(dim=1).sum()) for a, b in zip(free["routing"][0], emu["routing"][0]))

    f32 = lambda x: np.asarray(x.detach().numpy() if torch.is_tensor(x) else x, dtype=np.float32)
    o = {"tokens": tokens.astype(np.int32), "targets": targets.astype(np.int32)}
    for n in names:
        o["param." + n] = P0[n].astype(np.float32)
    for i, b in biases0.items():
        o[f"expert_bias.{i}"] = b.astype(np.float32)
    for prefix, r in (("", ex), ("emu.", emu), ("f64.", free)):
        o[prefix + "logits"] = f32(r["logits"])
        o[prefix + "loss"] = f32([r["loss"]])
        o[prefix + "aux_loss"] = f32([r["aux_loss"]])
        o[prefix + "z_loss"] = f32([r["z_loss"]])
        o[prefix + "losses"] = f32(r["losses"])
        o[prefix + "grad_norms"] = f32(r["grad_norms"])
        if m["mtp_layers"] > 0:  # the MTP loss per step and each depth's cross-entropy sum at step 1
            o[prefix + "mtp_losses"] = f32(r["mtp_losses"])
            o[prefix + "mtp_ce"] = f32(r["mtp_ce"])
        for n in names:
            o[prefix + "grad." + n] = f32(r["grads"][n])
            o[prefix + "step5." + n] = f32(r["params"][n])
        for i, b in r["biases"].items():
            o[prefix + f"step5.expert_bias.{i}"] = f32(b)
    for i, c in enumerate(emu["counts"][0]):
        o[f"counts.{i}"] = c.numpy().astype(np.int32)
    for s_, cs in enumerate(emu["counts"]):  # tokens per expert at every step (the bias updates follow them)
        for i, c in enumerate(cs):
            o[f"emu.counts.step{s_ + 1}.{i}"] = c.numpy().astype(np.int32)
    for s_, cs in enumerate(free["counts"]):
        for i, c in enumerate(cs):
            o[f"f64.counts.step{s_ + 1}.{i}"] = c.numpy().astype(np.int32)
    lrs = ",".join(f"{x:.9g}" for x in emu["lrs"])
    md = dict(meta)
    md.update({"generator": "tools/torch_ref/moetron_ref.py gen", "torch": torch.__version__, "steps": str(steps),
               "lrs": lrs, "routing_margin_min": f"{min(emu['margins']):.3e}",
               "fp64_free_routing_flips_step1": str(flips),
               "f64_routing_margin_min": f"{min(free['margins']):.3e}"})
    write_safetensors(out_path, o, md)
    print(f"{out_path}: loss {ex['loss']:.6f} (emu {emu['loss']:.6f}) aux {ex['aux_loss']:.3e} z {ex['z_loss']:.3e} "
          f"grad norm {ex['grad_norms'][0]:.4f} losses {[round(x, 5) for x in ex['losses']]} lrs {lrs} "
          f"routing margin {min(emu['margins']):.2e}, free-fp64 routing flips at step 1: {flips}")


def main(argv):
    if len(argv) >= 3 and argv[0] == "gen":
        gen(argv[1], argv[2], 5, argv[3] if len(argv) > 3 else None)
        return 0
    print(__doc__)
    print("usage: moetron_ref.py gen DUMP.safetensors OUT.safetensors [CONFIG.toml (cross-check)]")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
