"""ref_config.py: the job-config reader of the PyTorch reference (moetron_ref.py), importable without torch or numpy.

What it is: a reader of the engine's TOML job configs (src/job/config.cpp) that knows every key the engine
writes, in two classes:
  - MODELLED: the keys the reference computes with ([model], [training], [optimizer], [lr_scheduler]), with the
    engine's defaults (include/moetron/{config,spec}.h) and, for string-valued ones, the values the engine
    accepts (CHOICES);
  - IGNORED: the keys that do not change what the reference computes (names and paths, the parallel layout,
    checkpoints, recompute, FP8 precision, logging, profiling, hardware): read, checked by name, unused.
A key in neither class is an error naming it, and so is a value the reference does not implement (REFUSALS):
model.ffn = "gelu", model.dropout > 0, model.expert_act = "clamped_swiglu" (the engine refuses these three as well) and
model.capacity_factor > 0 (the engine drops tokens; the reference is dropless). Defaults always load.

What it is not: the engine's validation (config_validate.cpp, spec.cpp). Sizes, divisibility and the parallel
rules are not checked here; a config the engine rejects for those reasons may still load.

tests/torch_ref/check_configs.py holds MODELLED, IGNORED and CHOICES to the keys and values of the configs the
engine writes, so a key or an enum value added to the engine fails that check until it is classified here.
Needs Python 3.11 (tomllib).
"""
try:
    import tomllib
except ImportError:  # pragma: no cover
    tomllib = None


class ConfigError(ValueError):
    """A config the reference cannot read: an unknown key, a value of the wrong type, an unknown enum value."""


class Unsupported(ConfigError):
    """A config that names a value the reference does not implement. `refusals` lists them as
    (section.key, value, why, engine_refuses): engine_refuses is true where the engine refuses the value too."""

    def __init__(self, source, refusals):
        self.refusals = refusals
        lines = [f"{k} = {value_text(v)}: {why}" for k, v, why, _ in refusals]
        super().__init__(f"{source}: not implemented by moetron_ref.py: " + "; ".join(lines))


# The keys the reference computes with, and the engine's defaults.
MODELLED = {
    "model": dict(vocab_size=0, d_model=0, n_layers=0, first_k_dense=0, dense_layers=[], inter_size=0,
                  ffn="swiglu", dropout=0.0, attention_impl="flash", expert_act="swiglu",
                  norm_eps=1e-6, tie_embeddings=False, init_std=0.02, rope_theta=10000.0, attn_type="mha",
                  n_heads=0, n_kv_heads=0, head_dim=0, qk_norm=False, q_lora_rank=0, kv_lora_rank=0,
                  qk_nope_head_dim=0, qk_rope_head_dim=0, v_head_dim=0, n_routed_experts=0, n_shared_experts=0,
                  moe_inter_size=0, topk=0, score_func="softmax", n_group=1, topk_group=1, norm_topk_prob=False,
                  route_scale=1.0, load_balance="aux_loss", aux_coef=0.001, aux_seq_wise=False,
                  bias_update_rate=0.001, bias_update="sign", sinkhorn_iters=0, route_capacity=0.0, z_loss_coef=0.0,
                  capacity_factor=0.0, drop_policy="probs", mtp_layers=0, mtp_loss_weight=0.3),
    "training": dict(seq_len=0, micro_batch_size=1, global_batch_size=0, steps=1, seed=0, max_norm=1.0,
                     dataset="synthetic", dataset_path="", val_interval=0, val_steps=0, compute_dtype="auto",
                     attention_dtype="auto", threads=0, memory_check=True, nonfinite="halt", device="cpu"),
    "optimizer": dict(name="adamw", lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, muon_momentum=0.95,
                      muon_nesterov=True, muon_ns_steps=5),
    "lr_scheduler": dict(warmup_steps=0, decay_type="cosine", min_lr_ratio=0.1),
}

# Every value the engine accepts for the string-valued MODELLED keys that are enumerations (the other string
# keys, training.dataset and dataset_path, are free text). A value outside its list is an error; a value in it
# that the reference does not implement is in REFUSALS. Notes on the values accepted without a difference:
#   model.attention_impl: flash and unfused compute the same attention (the planner prices them differently);
#   model.drop_policy: matters only with capacity_factor > 0, which is refused;
#   training.compute_dtype: the precision of the engine's run; `gen` writes its float64 and bf16-emulating
#     sets whatever it says;
#   training.attention_dtype: the precision of the engine's attention products (bf16 rounds q, k, v, P, dS),
#     a rounding like compute_dtype's, not the model;
#   training.nonfinite: what the engine does with a non-finite step; a finite step is the same either way;
#   training.device: where the engine computes (the same model; "cuda" is refused by the engine's trainer for now).
CHOICES = {
    "model.ffn": ("swiglu", "gelu"),
    "model.attention_impl": ("flash", "unfused"),
    "model.expert_act": ("swiglu", "clamped_swiglu"),
    "model.attn_type": ("mha", "gqa", "mla"),
    "model.score_func": ("softmax", "sigmoid"),
    "model.load_balance": ("none", "aux_loss", "aux_free"),
    "model.bias_update": ("sign", "proportional"),
    "model.drop_policy": ("probs", "position"),
    "training.compute_dtype": ("auto", "bf16", "fp32"),
    "training.attention_dtype": ("auto", "bf16", "fp32"),
    "training.nonfinite": ("halt", "skip"),
    "training.device": ("cpu", "cuda"),
    "optimizer.name": ("adamw", "muon"),
    "lr_scheduler.decay_type": ("cosine", "linear", "none"),
}

# Keys read and not used: none of them changes the forward, backward or AdamW step of one process on one
# micro-batch, which is all the reference computes (parallel runs are meant to compute the same sums; FP8 and
# the EP dispatch precision change the rounding, like training.compute_dtype, not the model).
IGNORED = {
    "job": ("name", "dump_folder", "description"),
    "parallelism": ("tp", "cp", "expert_tp", "sequence_parallel", "dp_replicate", "dp_shard", "ep", "pp",
                    "ranks_per_node", "ep_dispatcher", "ep_transport", "fp8_dispatch", "zero", "pp_schedule",
                    "pp_virtual_stages", "pp_microbatches", "pp_layout", "pp_schedule_csv",
                    "pp_first_stage_less_layers",
                    "pp_last_stage_less_layers", "ep_overlap", "ep_overlap_split", "ep_pair_backward", "ep_baton",
                    "ep_link"),
    "checkpoint": ("enable", "interval", "keep_latest_k", "folder", "async"),
    "activation_checkpoint": ("mode", "layer_ids", "stage_ids", "modules"),
    "quantize": ("recipe", "format", "scaling", "amax_history_len", "modules", "cache_fp8_activations"),
    "comm": ("timeout_s", "mpi_wait", "mpi_max_nap_us", "mpi_thread"),
    "metrics": ("log_interval", "peak_tflops", "jsonl"),
    "profiling": ("enable", "start_step", "end_step", "folder", "max_events"),
    "hardware": ("name", "num_nodes", "gpus_per_node"),
}

# Values the reference refuses: (section.key, test of the value, why, whether the engine refuses it too).
# The engine's refusals are in Model::Model (src/model/model.cpp).
REFUSALS = (
    ("model.expert_act", lambda v: v != "swiglu",
     "the reference implements SwiGLU experts only (the engine refuses GPT-OSS's clamped SwiGLU too: planned only)", True),
    ("model.ffn", lambda v: v != "swiglu",
     "the reference implements the SwiGLU MLP only (the engine refuses the GELU MLP too: planned only)", True),
    ("model.dropout", lambda v: v != 0,
     "the reference has no dropout (the engine refuses dropout > 0 too: planned only)", True),
    ("optimizer.name", lambda v: v != "adamw",
     "the reference implements AdamW only (the engine's Muon is held to its float64 twin by the op harness and "
     "tests/unit/test_muon.cpp; the muon_* keys are read and unused)", False),
    ("model.capacity_factor", lambda v: v != 0,
     "the reference implements dropless MoE only (capacity_factor = 0); the engine's token dropping is not "
     "mirrored", False),
)


def known_keys():
    """Every "section.key" the reference knows (MODELLED and IGNORED)."""
    keys = {f"{s}.{k}" for s, d in MODELLED.items() for k in d}
    keys |= {f"{s}.{k}" for s, ks in IGNORED.items() for k in ks}
    return keys


def value_text(v):
    """v as TOML writes it (for messages)."""
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, bool):
        return "true" if v else "false"
    return repr(v)


def _type_name(v):
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "float"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return type(v).__name__


def _typed(name, default, v, source):
    """v checked against the type of the default, as the engine's loader does (an integer is a float too)."""
    if isinstance(default, bool):
        ok = isinstance(v, bool)
    elif isinstance(default, int):
        ok = isinstance(v, int) and not isinstance(v, bool)
    elif isinstance(default, float):
        ok = isinstance(v, (int, float)) and not isinstance(v, bool)
        if ok:
            v = float(v)
    elif isinstance(default, str):
        ok = isinstance(v, str)
    else:  # the list keys (model.dense_layers) hold integers
        ok = isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
    if not ok:
        raise ConfigError(f"{source}: {name}: expected {_type_name(default)}, got {_type_name(v)} {value_text(v)}")
    return v


def _override_value(default, text):
    """An override's text as the engine reads it (config.cpp from_text): bare strings, lists with or without
    brackets, true/false/1/0 for booleans."""
    t = text.strip()
    if isinstance(default, bool):
        return {"true": True, "1": True, "false": False, "0": False}.get(t, t)
    if isinstance(default, list):
        inner = t[1:-1] if t.startswith("[") and t.endswith("]") else t
        items = [x.strip() for x in inner.split(",") if x.strip()]
        try:
            return [int(x) for x in items]
        except ValueError:
            return t
    if isinstance(default, (int, float)):
        try:
            return int(t)
        except ValueError:
            try:
                return float(t)
            except ValueError:
                return t
    if len(t) >= 2 and t[0] == t[-1] and t[0] in "\"'":
        return t[1:-1]
    return t


def config_from_toml_text(text, overrides=(), source="config"):
    """The reference's config: {section: {key: value}}; MODELLED sections complete with defaults and resolved
    (n_kv_heads, head_dim, global_batch_size as the engine resolves them), IGNORED sections as given.
    overrides: "--section.key=value" strings, applied after the file. Raises ConfigError (unknown key, wrong
    type, unknown enum value) or Unsupported (a value the reference does not implement)."""
    if tomllib is None:
        raise ConfigError("ref_config.py needs Python 3.11 or later (tomllib)")
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: TOML syntax error: {e}") from None
    for o in overrides:
        body = o[2:] if o.startswith("--") else o
        if "=" not in body or "." not in body.split("=", 1)[0]:
            raise ConfigError(f"override '{o}': expected --section.key=value")
        k, v = body.split("=", 1)
        sec, key = k.strip().split(".", 1)
        default = MODELLED.get(sec, {}).get(key, "")
        raw.setdefault(sec, {})[key] = _override_value(default, v)

    unknown = []
    for sec, body in raw.items():
        if sec not in MODELLED and sec not in IGNORED:
            unknown.append(sec)
            continue
        if not isinstance(body, dict):
            raise ConfigError(f"{source}: {sec}: expected a table ([{sec}]), got {_type_name(body)}")
        allowed = MODELLED.get(sec, {}).keys() | set(IGNORED.get(sec, ()))
        unknown += [f"{sec}.{k}" for k in body if k not in allowed]
    if unknown:
        raise ConfigError(f"{source}: keys unknown to moetron_ref.py: {sorted(unknown)} (classify each in "
                          "tools/torch_ref/ref_config.py: MODELLED with its default, or IGNORED)")

    cfg = {}
    for sec, defaults in MODELLED.items():
        got = raw.get(sec, {})
        cfg[sec] = {k: _typed(f"{sec}.{k}", d, got[k], source) if k in got else
                    (list(d) if isinstance(d, list) else d) for k, d in defaults.items()}
    for sec in IGNORED:
        if sec in raw:
            cfg[sec] = dict(raw[sec])

    for name, choices in CHOICES.items():
        sec, key = name.split(".", 1)
        if cfg[sec][key] not in choices:
            raise ConfigError(f"{source}: {name}: expected one of {'|'.join(choices)}, got {value_text(cfg[sec][key])}")
    refused = []
    for name, bad, why, engine in REFUSALS:
        sec, key = name.split(".", 1)
        if bad(cfg[sec][key]):
            refused.append((name, cfg[sec][key], why, engine))
    if refused:
        raise Unsupported(source, refused)

    m = cfg["model"]
    if m["attn_type"] != "mla":  # ModelSpec::resolve
        if m["n_kv_heads"] == 0:
            m["n_kv_heads"] = m["n_heads"]
        if m["head_dim"] == 0 and m["n_heads"] > 0 and m["d_model"] % m["n_heads"] == 0:
            m["head_dim"] = m["d_model"] // m["n_heads"]
    t = cfg["training"]
    if t["global_batch_size"] == 0:  # JobConfig::resolve
        p = cfg.get("parallelism", {})
        dp = p.get("dp_replicate", 1) * p.get("dp_shard", 1)
        t["global_batch_size"] = t["micro_batch_size"] * dp * max(1, p.get("pp_microbatches", 0))
    return cfg


def load_config(path, overrides=()):
    with open(path, "r", encoding="utf-8") as f:
        return config_from_toml_text(f.read(), overrides, source=path)


def is_moe_layer(m, l):
    if m["n_routed_experts"] <= 0 or l < m["first_k_dense"]:
        return False
    return l not in m["dense_layers"]
