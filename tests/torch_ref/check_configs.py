"""check_configs.py: holds the PyTorch reference's config reader (tools/torch_ref/ref_config.py) to the engine.

What it checks, without torch or numpy (it fails if importing the reader pulls either in):
  (a) every preset in configs/*.toml and configs/anchors/*.toml, and the reference's own variants
      (tests/data/ref/*.toml and the config_toml stored in tests/data/ref/*.safetensors), loads in the reader,
      or is refused only for values the engine refuses too; each such refusal is confirmed by running
      `moetron debug dump-init` on the preset, which must fail naming one of the refused keys;
  (b) the configs the engine writes load: the config.toml of a one-step `moetron train` of ds_tiny and the
      config_toml of `moetron debug dump-init` on ds_tiny and on a minimal config (the model's sizes and
      seq_len, nothing else), and their modelled values ([model], [training], [optimizer], [lr_scheduler])
      equal the reader's own reading of the same file and overrides (so every default of the reader is the
      engine's);
  (c) the keys the engine writes are exactly the keys the reader knows (a key missing from either side is named),
      and for every string-valued key of the modelled sections the engine's accepted values (from its error
      message for a bad value) are the reader's CHOICES, so a new enum value cannot pass unnoticed.
--dumped FILE adds a config written by the engine (or an edited copy) to (b) and (c).

What it is not: a test of the reference's numbers (tests/unit/test_reference.cpp) and not a check of the
engine's own config validation (tests/unit/test_config.cpp). It runs the engine on ds_tiny and a smaller model
only (one training step, two dumps, and config loads that fail before anything is built).

Exit status: 0 when everything holds, 1 with a FAIL line per problem otherwise, 2 for usage errors.
Usage: check_configs.py --moetron build/moetron [--configs configs] [--workdir DIR] [--dumped FILE ...]
"""
import argparse
import glob
import json
import os
import resource
import shutil
import struct
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tools", "torch_ref"))
import ref_config as RC  # noqa: E402

try:
    import tomllib
except ImportError:  # pragma: no cover
    tomllib = None

PROBE = "__not_a_value__"
DUMP_INIT_AS_LIMIT = 16 << 30  # address space for a dump-init that must fail before allocating the model


class Report:
    def __init__(self):
        self.failures = 0

    def ok(self, msg):
        print(f"ok: {msg}", flush=True)

    def fail(self, msg):
        self.failures += 1
        print(f"FAIL: {msg}", flush=True)


def run(cmd, limit_as=None, timeout=300):
    """(exit status, stdout + stderr) of cmd."""
    pre = None
    if limit_as:
        def pre():
            resource.setrlimit(resource.RLIMIT_AS, (limit_as, limit_as))
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                           preexec_fn=pre)
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout} s"
    return p.returncode, p.stdout


def safetensors_metadata(path):
    """The __metadata__ of a safetensors file (stdlib: 8-byte little-endian header length, JSON header)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n).decode("utf-8")).get("__metadata__", {}) or {}


def toml_keys(text):
    """{"section.key"} of a TOML config."""
    return {f"{s}.{k}" for s, body in tomllib.loads(text).items() if isinstance(body, dict) for k in body}


def short(text, n=400):
    text = " ".join(text.split())
    return text if len(text) <= n else text[:n] + " ..."


def check_presets(rep, moetron, configs, workdir):
    """(a): the presets and the reference's variants."""
    presets = sorted(glob.glob(os.path.join(configs, "*.toml")) + glob.glob(os.path.join(configs, "anchors", "*.toml")))
    if not presets:
        rep.fail(f"no presets found under {configs}")
    for path in presets:
        name = os.path.relpath(path, os.path.dirname(configs))
        try:
            RC.load_config(path)
            rep.ok(f"{name}: loads")
            continue
        except RC.Unsupported as e:
            refusals, why = e.refusals, str(e)
        except RC.ConfigError as e:
            rep.fail(f"{name}: the reference cannot read this preset: {e}")
            continue
        ours = [k for k, _, _, engine in refusals if not engine]
        if ours:
            rep.fail(f"{name}: refused for values the engine trains: {ours} ({why})")
            continue
        # The engine must refuse it too: dump-init builds the Model, whose constructor refuses these values
        # before allocating anything (the address-space cap turns a model that does get built into a fast failure).
        rc, out = run([moetron, "debug", "dump-init", path, os.path.join(workdir, "refused.safetensors")],
                      limit_as=DUMP_INIT_AS_LIMIT, timeout=60)
        named = [k for k, _, _, _ in refusals if k.split(".", 1)[1] in out]
        what = ", ".join(f"{k} = {RC.value_text(v)}" for k, v, _, _ in refusals)
        if rc != 0 and named:
            rep.ok(f"{name}: not trained by the engine ({what}; the engine refuses {named[0]}): refused by the "
                   "reference too")
        else:
            rep.fail(f"{name}: the reference refuses {what}, but `moetron debug dump-init` did not refuse any of "
                     f"these keys (exit {rc}: {short(out)}); if the engine trains this now, the reference must "
                     "implement it (tools/torch_ref)")

    for path in sorted(glob.glob(os.path.join(ROOT, "tests", "data", "ref", "*.toml"))):
        name = os.path.relpath(path, ROOT)
        try:
            RC.load_config(path)
            rep.ok(f"{name}: loads")
        except RC.ConfigError as e:
            rep.fail(f"{name}: a reference variant does not load: {e}")
        st = path[:-len(".toml")] + ".safetensors"
        if not os.path.exists(st):
            continue
        try:
            text = safetensors_metadata(st)["config_toml"]
        except (OSError, ValueError, KeyError, struct.error) as e:
            rep.fail(f"{os.path.relpath(st, ROOT)}: no readable config_toml metadata ({e})")
            continue
        try:
            RC.config_from_toml_text(text, source=os.path.relpath(st, ROOT) + " (config_toml)")
            rep.ok(f"{os.path.relpath(st, ROOT)}: its stored config loads")
        except RC.ConfigError as e:
            rep.fail(str(e))


# The smallest config the engine accepts: every key but these few takes its default, so the engine's reading of
# it holds every default of the reader's MODELLED table to the engine's.
MINIMAL = """[model]
vocab_size = 64
d_model = 32
n_layers = 1
inter_size = 64
n_heads = 2

[training]
seq_len = 8
"""


def dump_init_config(rep, moetron, config, out):
    """The config_toml that `moetron debug dump-init CONFIG OUT` writes, or None (a FAIL reported)."""
    rc, log = run([moetron, "debug", "dump-init", config, out])
    if rc != 0 or not os.path.exists(out):
        rep.fail(f"`moetron debug dump-init {os.path.basename(config)}` failed (exit {rc}: {short(log)})")
        return None
    try:
        return safetensors_metadata(out)["config_toml"]
    except (OSError, ValueError, KeyError, struct.error) as e:
        rep.fail(f"{out}: no readable config_toml metadata ({e})")
        return None


def engine_written(rep, moetron, configs, workdir):
    """(b): run the engine; returns [(label, TOML text, (source config, overrides))] of the configs it wrote."""
    tiny = os.path.join(configs, "ds_tiny.toml")
    out = []
    run_dir = os.path.join(workdir, "train")
    shutil.rmtree(run_dir, ignore_errors=True)
    ov = ["--training.steps=1", "--training.dataset=synthetic", f"--job.dump_folder={run_dir}"]
    rc, log = run([moetron, "train", tiny, *ov, "--quiet"])
    cfg_path = os.path.join(run_dir, "config.toml")
    if rc != 0 or not os.path.exists(cfg_path):
        rep.fail(f"`moetron train ds_tiny.toml {' '.join(ov)}` wrote no config.toml (exit {rc}: {short(log)})")
    else:
        with open(cfg_path, encoding="utf-8") as f:
            out.append((f"config.toml of `moetron train ds_tiny.toml` ({cfg_path})", f.read(), (tiny, ov)))
    dump = os.path.join(workdir, "init.safetensors")
    text = dump_init_config(rep, moetron, tiny, dump)
    if text is not None:
        out.append((f"config_toml of `moetron debug dump-init ds_tiny.toml` ({dump})", text, (tiny, [])))
    minimal = os.path.join(workdir, "minimal.toml")
    with open(minimal, "w", encoding="utf-8") as f:
        f.write(MINIMAL)
    text = dump_init_config(rep, moetron, minimal, os.path.join(workdir, "minimal.safetensors"))
    if text is not None:
        out.append(("config_toml of `moetron debug dump-init` on a minimal config (every other key its default)",
                    text, (minimal, [])))
    return out


def check_written(rep, label, text, source):
    """(b) for one written config: it loads, and its modelled values are the reader's reading of its source."""
    try:
        cfg = RC.config_from_toml_text(text, source=label)
    except RC.ConfigError as e:
        rep.fail(f"the reference cannot read a config the engine wrote: {e}")
        return
    if source is None:
        rep.ok(f"{label}: loads")
        return
    path, ov = source
    try:
        mine = RC.load_config(path, ov)
    except RC.ConfigError as e:
        rep.fail(f"{os.path.basename(path)} with {ov}: {e}")
        return
    diffs = {f"{s}.{k}": (mine[s][k], cfg[s][k]) for s in RC.MODELLED for k in RC.MODELLED[s]
             if mine[s][k] != cfg[s][k]}
    if diffs:
        rep.fail(f"{label}: the reference reads {os.path.basename(path)} differently from the engine (reference, "
                 f"engine): {diffs}; a default in tools/torch_ref/ref_config.py MODELLED is not the engine's")
    else:
        rep.ok(f"{label}: loads, and every modelled value equals the reference's own reading of "
               f"{os.path.basename(path)}")


def check_keys(rep, label, text):
    """(c): the written keys against the reader's."""
    engine = toml_keys(text)
    known = RC.known_keys()
    new, gone = sorted(engine - known), sorted(known - engine)
    if new:
        rep.fail(f"{label}: the engine writes keys unknown to the reference: {new}; classify each in "
                 "tools/torch_ref/ref_config.py (MODELLED with its default, or IGNORED; a value the reference "
                 "cannot compute goes in REFUSALS)")
    if gone:
        rep.fail(f"{label}: the reference knows keys the engine does not write: {gone}; remove them from "
                 "tools/torch_ref/ref_config.py")
    if not new and not gone:
        rep.ok(f"{label}: its {len(engine)} keys are the reference's known keys")


def check_choices(rep, moetron, configs, workdir, text):
    """(c): the accepted values of every string-valued modelled key, asked of the engine with a bad value."""
    tiny = os.path.join(configs, "ds_tiny.toml")
    raw = tomllib.loads(text)
    for sec in RC.MODELLED:
        for key, val in raw.get(sec, {}).items():
            if not isinstance(val, str):
                continue
            name = f"{sec}.{key}"
            # The second override fails the load whether or not the first is accepted: nothing is built.
            rc, out = run([moetron, "debug", "dump-init", tiny, os.path.join(workdir, "probe.safetensors"),
                           f"--{name}={PROBE}", "--training.steps=not_an_integer"], timeout=60)
            marker = f"{name}: expected one of "
            ours = RC.CHOICES.get(name)
            if marker in out:
                engine = tuple(out.split(marker, 1)[1].split(",", 1)[0].strip().split("|"))
                if ours is None:
                    rep.fail(f"{name}: the engine accepts only {engine}; list them in tools/torch_ref/ref_config.py "
                             "CHOICES")
                elif set(engine) != set(ours):
                    rep.fail(f"{name}: the engine accepts {engine}, the reference {ours} (update "
                             "tools/torch_ref/ref_config.py CHOICES, and REFUSALS for a value it does not implement)")
                else:
                    rep.ok(f"{name}: the engine's values {'|'.join(engine)} are the reference's")
            elif "training.steps" in out and rc != 0:
                if ours is not None:
                    rep.fail(f"{name}: free text for the engine, an enumeration {ours} for the reference")
                else:
                    rep.ok(f"{name}: free text for both")
            else:
                rep.fail(f"{name}: could not ask the engine for its values (exit {rc}: {short(out)})")


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--moetron", required=True, help="the moetron binary")
    ap.add_argument("--configs", default=os.path.join(ROOT, "configs"), help="the presets folder (configs/)")
    ap.add_argument("--workdir", help="where the engine writes (default: a temporary folder, removed)")
    ap.add_argument("--dumped", action="append", default=[], help="another config the engine wrote (TOML)")
    a = ap.parse_args(argv)
    if tomllib is None:
        print("check_configs.py needs Python 3.11 or later (tomllib)", file=sys.stderr)
        return 2
    if not os.access(a.moetron, os.X_OK):
        print(f"check_configs.py: {a.moetron} is not an executable", file=sys.stderr)
        return 2
    rep = Report()
    heavy = sorted(m for m in ("torch", "numpy") if m in sys.modules)
    if heavy:
        rep.fail(f"importing tools/torch_ref/ref_config.py imported {heavy}: the config reader must not need them")
    else:
        rep.ok("tools/torch_ref/ref_config.py imports without torch or numpy")

    workdir = a.workdir or tempfile.mkdtemp(prefix="moetron_ref_configs.")
    os.makedirs(workdir, exist_ok=True)
    try:
        check_presets(rep, a.moetron, a.configs, workdir)
        written = engine_written(rep, a.moetron, a.configs, workdir)
        for path in a.dumped:
            with open(path, encoding="utf-8") as f:
                written.append((path, f.read(), None))
        for label, text, source in written:
            check_written(rep, label, text, source)
            try:
                check_keys(rep, label, text)
            except tomllib.TOMLDecodeError as e:
                rep.fail(f"{label}: not TOML: {e}")
        if written:
            check_choices(rep, a.moetron, a.configs, workdir, written[0][1])
    finally:
        if not a.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    if rep.failures:
        print(f"check_configs.py: {rep.failures} problem(s)", flush=True)
        return 1
    print("check_configs.py: the reference reads every config the engine writes", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
