#!/usr/bin/env python3
"""check_keys_honoured.py: every key of the engine's config is honoured or refused, never silently ignored.

For each key the engine writes into a run's config.toml (the whole field table), a short ds_tiny run sets
it to a value other than the default and the result is compared with the same run without it. Each key
states what must change:
  loss     the losses in metrics.jsonl differ (the key changes what is computed);
  refuse   the run exits 1..125 with a message naming the key (or the given text);
  note     the run prints "note: <key> = ..." (the key has no effect in this layout, and the run says so);
  check    a named check on the run's files or output (keys that change what is written, not computed);
  any      one of several of the above (e.g. bf16 is computed where it is native and refused elsewhere).
A key of the field table without an entry here fails the check, so a new key needs one.
Keys whose effect needs several ranks (ep, pp, zero, ...) are refused or noted here on one process; the MPI
layout sweep (tests/mpi/test_mpi_layouts.cpp) holds their multi-rank behaviour to the single-process run.

Usage: check_keys_honoured.py --moetron BIN --config configs/ds_tiny.toml --workdir DIR [--only KEY,...]
Exit 0 when every key behaves as stated, 1 otherwise (every failing key is listed). Not a test of the
values' effects beyond "something changed": the unit tests, the op harness and the sweep check those.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib

BASE = ["--training.steps=4", "--metrics.log_interval=1", "--metrics.peak_tflops=1", "--training.dataset=synthetic",
        "--training.compute_dtype=fp32", "--lr_scheduler.warmup_steps=1"]


class Run:
    def __init__(self, rc, out, folder):
        self.rc, self.out, self.folder = rc, out, folder
        self.records = []
        path = os.path.join(folder, "metrics.jsonl")
        if os.path.exists(path):
            self.records = [json.loads(line) for line in open(path) if line.strip()]
        self.losses = [r.get("loss") for r in self.records]
        self.files = sorted(os.path.relpath(os.path.join(d, f), folder)
                            for d, _, fs in os.walk(folder) for f in fs) if os.path.isdir(folder) else []

    def peak(self, category):
        return max((r["mem_peak_by_category"].get(category, 0) for r in self.records), default=0)


class Walker:
    def __init__(self, a):
        self.a, self.n, self.cache = a, 0, {}

    def run(self, extra, env=None):
        key = (tuple(extra), tuple(sorted((env or {}).items())))
        if key in self.cache:
            return self.cache[key]
        self.n += 1
        folder = os.path.join(self.a.workdir, f"run{self.n}")
        shutil.rmtree(folder, ignore_errors=True)
        cmd = [self.a.moetron, "train", self.a.config, *BASE, f"--job.dump_folder={folder}", *extra]
        e = dict(os.environ, OMP_NUM_THREADS="2", **(env or {}))
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=e, timeout=300,
                           cwd=self.a.workdir)
        r = Run(p.returncode, p.stdout, folder)
        self.cache[key] = r
        return r


def ok(r):
    return None if r.rc == 0 else f"exit {r.rc}: {r.out.strip().splitlines()[-1:] if r.out.strip() else ''}"


# --- expectations: each returns None when it holds, else why not ---------------------------------------------------
def loss(ctx=(), extra=()):
    """extra: further overrides of the changed run only (a key that needs a companion to be valid)."""
    def f(w, key, val):
        ref, new = w.run(list(ctx)), w.run([*ctx, f"--{key}={val}", *extra])
        why = ok(ref) or ok(new)
        if why:
            return why
        if not new.losses or new.losses == ref.losses:
            return f"losses unchanged ({new.losses[:2]}...)"
        return None
    f.kind = "loss"
    return f


def refuse(text=None, ctx=()):
    def f(w, key, val):
        r = w.run([*ctx, f"--{key}={val}"])
        if not 1 <= r.rc <= 125:
            return f"exit {r.rc}, expected a refusal"
        # the key, with its section or alone as a word (the mesh names "dp_shard (2)")
        named = text in r.out if text else re.search(r"(?<![\w.])(%s\.)?%s\b" % tuple(map(re.escape, key.split("."))), r.out)
        return None if named else f"the refusal does not name {text or key!r}: {r.out.strip()[-300:]}"
    f.kind = "refuse"
    return f


def note(ctx=()):
    def f(w, key, val):
        r = w.run([*ctx, f"--{key}={val}"])
        why = ok(r)
        if why:
            return why
        return None if re.search(r"note: " + re.escape(key) + r" = ", r.out) else "no 'note: %s = ...' line" % key
    f.kind = "note"
    return f


def check(fn, ctx=(), env=None):
    """fn(new_run, ref_run) -> None or why."""
    def f(w, key, val):
        ref, new = w.run(list(ctx), env), w.run([*ctx, f"--{key}={val}"], env)
        return fn(new, ref)
    f.kind = "check"
    return f


def any_of(*exps):
    def f(w, key, val):
        whys = [e(w, key, val) for e in exps]
        return None if any(y is None for y in whys) else " / ".join(whys)
    f.kind = "any"
    return f


def out_has(rx):
    return lambda new, ref: ok(new) or (None if re.search(rx, new.out) else f"output lacks {rx!r}")


def file_exists(pattern):
    def fn(new, ref):
        return ok(new) or (None if any(re.fullmatch(pattern, f) for f in new.files)
                           and not any(re.fullmatch(pattern, f) for f in ref.files)
                           else f"no new file matching {pattern!r} (files: {new.files[:12]})")
    return fn


def peak_moves(category, lower):
    """The activation (or other category) peak of the changed run is below (lower) or above the reference's."""
    def fn(new, ref):
        why = ok(new) or ok(ref)
        if why:
            return why
        a, b = new.peak(category), ref.peak(category)
        return None if (a < b if lower else a > b) else f"{category} peak {a} not {'below' if lower else 'above'} {b}"
    return fn


def peak_lower(category):
    return peak_moves(category, True)


def peak_higher(category):
    return peak_moves(category, False)


def records_differ(field):
    def fn(new, ref):
        why = ok(new) or ok(ref)
        if why:
            return why
        a, b = [r.get(field) for r in new.records], [r.get(field) for r in ref.records]
        return None if a != b else f"{field} unchanged: {a}"
    return fn


def step_folders(new, ref):
    why = ok(new)
    if why:
        return why
    steps = sorted({f.split("/")[1] for f in new.files if f.startswith("ckpt/") and "/" in f[5:]})
    return None if steps else f"no checkpoint under ckpt/: {new.files[:12]}"


CK = ["--checkpoint.enable=true", "--checkpoint.folder=ckpt", "--checkpoint.interval=1"]
MLA = ["--model.attn_type=mla", "--model.q_lora_rank=32", "--model.kv_lora_rank=16", "--model.qk_nope_head_dim=16",
       "--model.qk_rope_head_dim=8", "--model.v_head_dim=16"]
FP8 = ["--quantize.recipe=tensorwise"]
DENSE = ["--model.n_routed_experts=0", "--model.n_shared_experts=0"]

# key: (non-default value, expectation)
KEYS = {
    "job.name": ("walk_name", check(out_has(r"training walk_name:"))),
    "job.dump_folder": ("(set by this script for every run)",
                        check(lambda new, ref: ok(ref) or (None if "metrics.jsonl" in ref.files else "no metrics.jsonl"))),
    "job.description": ("a walk", check(lambda new, ref: ok(new) or (
        None if "a walk" in open(os.path.join(new.folder, "config.toml")).read() else "not in config.toml"))),
    "model.vocab_size": (256, loss()),
    "model.d_model": (32, loss()),
    "model.n_layers": (2, loss()),
    "model.first_k_dense": (2, loss()),
    "model.dense_layers": ("[2]", loss(["--model.first_k_dense=0"])),
    "model.inter_size": (64, loss()),
    "model.ffn": ("gelu", refuse("model.ffn = gelu", DENSE)),
    "model.dropout": (0.1, refuse()),
    "model.attention_impl": ("unfused", refuse()),
    "model.expert_act": ("clamped_swiglu", refuse()),
    "model.norm_eps": (0.1, loss()),
    "model.tie_embeddings": ("true", loss()),
    "model.init_std": (0.05, loss()),
    "model.rope_theta": (100.0, loss()),
    "model.attn_type": ("gqa", loss(extra=["--model.n_kv_heads=2"])),
    "model.n_heads": (2, loss(["--model.head_dim=32"])),
    "model.n_kv_heads": (1, loss(["--model.attn_type=gqa"])),
    "model.head_dim": (8, loss()),
    "model.qk_norm": ("true", loss()),
    "model.q_lora_rank": (16, loss(MLA)),
    "model.kv_lora_rank": (8, loss(MLA)),
    "model.qk_nope_head_dim": (8, loss(MLA)),
    "model.qk_rope_head_dim": (4, loss(MLA)),
    "model.v_head_dim": (8, loss(MLA)),
    "model.n_routed_experts": (4, loss()),
    "model.n_shared_experts": (0, loss()),
    "model.moe_inter_size": (16, loss()),
    "model.topk": (1, loss()),
    "model.score_func": ("sigmoid", loss()),
    "model.n_group": (2, loss()),
    "model.topk_group": (2, loss(["--model.n_group=4", "--model.topk=2"])),
    "model.norm_topk_prob": ("true", loss()),
    "model.route_scale": (2.5, loss()),
    "model.load_balance": ("aux_free", loss()),
    "model.aux_coef": (0.5, loss()),
    "model.aux_seq_wise": ("false", loss()),
    "model.bias_update_rate": (0.1, loss(["--model.load_balance=aux_free"])),
    "model.sinkhorn_iters": (4, loss()),
    "model.route_capacity": (1.0, loss()),
    "model.bias_update": ("proportional", loss(["--model.load_balance=aux_free", "--model.bias_update_rate=0.1"])),
    "model.z_loss_coef": (0.1, loss()),
    "model.capacity_factor": (0.5, loss()),
    "model.drop_policy": ("position", loss(["--model.capacity_factor=0.5"])),
    "model.mtp_layers": (1, loss()),  # the MTP depths' gradients change the main model's losses from step 2
    "model.mtp_loss_weight": (0.1, loss(["--model.mtp_layers=1"])),
    "training.seq_len": (16, loss()),
    "training.micro_batch_size": (2, check(peak_lower("activations"))),
    "training.global_batch_size": (16, loss()),
    "training.steps": (2, check(lambda new, ref: ok(new) or (None if len(new.records) == 2 else f"{len(new.records)} records"))),
    "training.seed": (7, loss()),
    "training.max_norm": (0.01, loss()),
    "training.dataset": ("no_such_corpus", refuse("dataset 'no_such_corpus'")),
    "training.dataset_path": ("/no/such/dir", any_of(note(), refuse("/no/such/dir", ["--training.dataset=no_such_corpus"]))),
    "training.val_interval": (2, check(lambda new, ref: ok(new) or (
        None if any("val_loss" in r for r in new.records) else "no val_loss"), ["--training.val_steps=1"])),
    "training.val_steps": (2, any_of(note(), check(records_differ("val_loss"), ["--training.val_interval=2"]))),
    "training.compute_dtype": ("bf16", any_of(loss(), refuse())),
    # BASE computes in fp32: bf16 attention is refused naming the key (under bf16 compute it changes the losses:
    # tests/unit/test_trainer.cpp, ComputeDtype.AttentionDtypeKeyChoosesTheAttentionProducts).
    "training.attention_dtype": ("bf16", refuse()),
    "training.threads": (1, check(out_has(r"threads=1\b"))),
    "training.memory_check": ("false", check(out_has(r"memory check: off"))),
    "training.device": ("cuda", refuse('training.device = "cuda"')),
    "training.nonfinite": ("skip", check(lambda new, ref: (None if new.rc == 0 and ref.rc != 0 and
                                                           any(r.get("skipped") for r in new.records)
                                                           else f"halt exit {ref.rc}, skip exit {new.rc}"),
                                         env={"MOETRON_FAULT": "nan:rank=0:step=2:phase=backward"})),
    "optimizer.name": ("muon", loss()),
    "optimizer.muon_momentum": (0.5, loss(["--optimizer.name=muon"])),
    "optimizer.muon_nesterov": ("false", loss(["--optimizer.name=muon"])),
    "optimizer.muon_ns_steps": (2, loss(["--optimizer.name=muon"])),
    "optimizer.lr": (0.01, loss()),
    "optimizer.beta1": (0.5, loss()),
    "optimizer.beta2": (0.5, loss()),
    "optimizer.eps": (0.1, loss()),
    "optimizer.weight_decay": (0.9, loss()),
    "lr_scheduler.warmup_steps": (3, loss()),
    "lr_scheduler.decay_type": ("linear", loss()),
    "lr_scheduler.min_lr_ratio": (0.9, loss()),
    "parallelism.tp": (2, refuse()),
    "parallelism.cp": (2, refuse()),
    "parallelism.expert_tp": (2, refuse()),
    "parallelism.sequence_parallel": ("false", note()),
    "parallelism.dp_replicate": (2, refuse()),
    "parallelism.dp_shard": (2, refuse()),
    "parallelism.ep": (2, refuse()),
    "parallelism.pp": (2, refuse()),
    "parallelism.ranks_per_node": (1, note()),
    "parallelism.ep_dispatcher": ("sync_free", refuse()),
    "parallelism.ep_transport": ("shm", refuse()),
    "parallelism.fp8_dispatch": ("true", refuse()),
    "parallelism.zero": (1, note()),
    # one pipeline rank still runs the schedule: gpipe holds both micro-batches' activations, 1f1b one
    "parallelism.pp_schedule": ("gpipe", check(peak_higher("activations"))),
    "parallelism.pp_virtual_stages": (2, any_of(note(), refuse())),
    "parallelism.pp_microbatches": (4, any_of(note(), refuse())),
    "parallelism.pp_layout": ("Et|tL", any_of(note(), refuse())),
    "parallelism.pp_schedule_csv": ("/no/such.csv", any_of(note(), refuse())),
    "parallelism.pp_first_stage_less_layers": (1, any_of(note(), refuse())),
    "parallelism.pp_last_stage_less_layers": (1, any_of(note(), refuse())),
    "parallelism.ep_overlap": ("true", any_of(note(), refuse())),
    "parallelism.ep_overlap_split": ("true", refuse()),
    # how ep_overlap's lanes run: one process has no EP (ep_overlap needs ep > 1), so noted; the MPI layout sweep
    # runs every value (tests/mpi/test_mpi_layouts.cpp, EpOverlapIsBitwiseThePlainInterleavedRun)
    "parallelism.ep_pair_backward": ("b", note()),
    "parallelism.ep_baton": ("turn", note()),
    "parallelism.ep_link": ("paced", note()),
    "checkpoint.enable": ("true", check(file_exists(r"checkpoint/step-?\d+/.*"))),
    "checkpoint.interval": (1, check(lambda new, ref: ok(new) or ok(ref) or (
        None if len(set(f.split("/")[1] for f in new.files if f.startswith("ckpt/")))
        > len(set(f.split("/")[1] for f in ref.files if f.startswith("ckpt/"))) else "no more checkpoints"),
        ["--checkpoint.enable=true", "--checkpoint.folder=ckpt", "--checkpoint.keep_latest_k=0"])),
    "checkpoint.keep_latest_k": (1, check(lambda new, ref: ok(new) or ok(ref) or (
        None if len(set(f.split("/")[1] for f in new.files if f.startswith("ckpt/")))
        < len(set(f.split("/")[1] for f in ref.files if f.startswith("ckpt/"))) else "no fewer checkpoints"), CK)),
    "checkpoint.folder": ("elsewhere", check(file_exists(r"elsewhere/.*"), ["--checkpoint.enable=true"])),
    "checkpoint.async": ("true", check(out_has(r"written in the background"), CK)),
    "activation_checkpoint.mode": ("full", check(peak_lower("activations"))),
    "activation_checkpoint.layer_ids": ("[0]", check(lambda new, ref: ok(new) or ok(ref) or (
        None if new.peak("activations") > ref.peak("activations") else "layer_ids changed nothing"),
        ["--activation_checkpoint.mode=full"])),
    "activation_checkpoint.stage_ids": ("[1]", any_of(note(["--activation_checkpoint.mode=full"]),
                                                      refuse(ctx=["--activation_checkpoint.mode=full"]))),
    "activation_checkpoint.modules": ('["attention_core","norm"]', check(peak_lower("activations"),
        ["--activation_checkpoint.mode=selective", '--activation_checkpoint.modules=["attention_core"]'])),
    "quantize.recipe": ("tensorwise", loss()),
    "quantize.format": ("hybrid", loss(FP8)),
    "quantize.scaling": ("delayed", loss(FP8)),
    "quantize.amax_history_len": (1, loss([*FP8, "--quantize.scaling=delayed"])),
    "quantize.modules": ('["attention"]', loss(FP8)),
    "quantize.cache_fp8_activations": ("true", any_of(loss(["--quantize.recipe=rowwise"]),
                                                      check(records_differ("mem_peak_by_category"),
                                                            ["--quantize.recipe=rowwise"]))),
    "comm.timeout_s": (5.0, any_of(note(), check(out_has(r"watchdog")))),
    # how MPI waits and the thread level MPI_Init is asked for: one process waits on no other rank
    "comm.mpi_wait": ("spin", note()),
    "comm.mpi_max_nap_us": (1000, note()),
    "comm.mpi_thread": ("funneled", note()),
    "metrics.log_interval": (2, check(lambda new, ref: ok(new) or (
        None if len(new.records) < len(ref.records) else "as many records"))),
    "metrics.peak_tflops": (2.0, check(records_differ("mfu"))),
    "metrics.jsonl": ("false", check(lambda new, ref: ok(new) or (
        None if "metrics.jsonl" not in new.files else "metrics.jsonl written"))),
    "profiling.enable": ("true", check(file_exists(r"profile/rank0\.trace\.json"))),
    "profiling.start_step": (3, check(lambda new, ref: ok(new) or ok(ref) or trace_steps_differ(new, ref),
                                      ["--profiling.enable=true"])),
    "profiling.end_step": (2, check(lambda new, ref: ok(new) or ok(ref) or trace_steps_differ(new, ref),
                                    ["--profiling.enable=true"])),
    "profiling.folder": ("tr", check(file_exists(r"tr/rank0\.trace\.json"), ["--profiling.enable=true"])),
    "profiling.max_events": (10, check(lambda new, ref: ok(new) or ok(ref) or trace_steps_differ(new, ref),
                                       ["--profiling.enable=true"])),
    "hardware.name": ("h100", note()),
    "hardware.num_nodes": (2, note()),
    "hardware.gpus_per_node": (4, note()),
}


def trace_steps_differ(new, ref):
    def events(run):
        path = next((os.path.join(run.folder, f) for f in run.files if f.endswith("rank0.trace.json")), None)
        if not path:
            return None
        return len(json.load(open(path)).get("traceEvents", []))
    a, b = events(new), events(ref)
    if a is None or b is None:
        return "no trace written"
    return None if a != b else f"the trace has the same {a} events"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--moetron", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--only", default="", help="comma-separated keys to check (default: all)")
    a = ap.parse_args()
    a.moetron, a.config = os.path.abspath(a.moetron), os.path.abspath(a.config)
    os.makedirs(a.workdir, exist_ok=True)
    w = Walker(a)
    base = w.run([])
    if base.rc != 0:
        print(f"FAIL: the baseline run failed (exit {base.rc}):\n{base.out[-2000:]}")
        return 1
    table = tomllib.load(open(os.path.join(base.folder, "config.toml"), "rb"))
    engine_keys = [f"{s}.{k}" for s, kv in table.items() for k in kv]
    failures = []
    for k in engine_keys:
        if k not in KEYS:
            failures.append(f"{k}: no entry in {os.path.basename(__file__)} (say how the engine honours it)")
    for k in KEYS:
        if k not in engine_keys:
            failures.append(f"{k}: listed here but not in the engine's config.toml")
    only = [k for k in a.only.split(",") if k]
    checked = 0
    for k, (val, exp) in KEYS.items():
        if exp is None or (only and k not in only) or k not in engine_keys:
            continue
        checked += 1
        why = exp(w, k, val)
        status = "ok" if why is None else "FAIL"
        print(f"{status:4} {k} = {val} ({exp.kind})" + ("" if why is None else f": {why}"))
        if why is not None:
            failures.append(f"{k} = {val}: {why}")
    print(f"{checked} keys checked in {w.n} runs; {len(failures)} failures")
    for f in failures:
        print(f"FAIL: {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
