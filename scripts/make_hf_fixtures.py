#!/usr/bin/env python
"""Build the Hugging Face checkpoint fixtures under ``tests/fixtures/hf/``.

Three kinds, all written by the frameworks themselves (nothing hand-made):

* ``trainer_*``: an HF ``Trainer`` run under DeepSpeed (``deepspeed --num_gpus 2 --no_local_rank``,
  gloo on CPU; ``scripts/_fixture_hf_trainer.py``). The fixture folder is the run's
  ``output_dir``: one or two ``checkpoint-N`` folders exactly as Trainer wrote them, minus
  DeepSpeed's copied ``zero_to_fp32.py`` / ``zero_to_torch.py`` (generic scripts, 41 KB, and ruff
  would lint them under ``tests/``).
* ``accelerate_fsdp_llama``: FSDP2 training (``torchrun``, gloo) saved by Accelerate's
  ``save_fsdp_model`` / ``save_fsdp_optimizer`` with Trainer's arguments into ``checkpoint-3/``
  (``scripts/_fixture_hf_fsdp.py``); ``hf_files/`` holds config and tokenizer apart from it.
* ``pretrained_*``: ``model.save_pretrained`` + ``tokenizer.save_pretrained`` folders
  (``scripts/_fixture_hf_pretrained.py``); the fixture folder is the model folder.

Every fixture has ``reference/`` (safetensors tensors of the live model at save time, see the job
scripts) and a ``fixture.json``: the recipe (``_fixture_hf_recipe.py``; a job can rebuild the setup
from it), the command, what training logged, cross-checks against DeepSpeed's own converters, and
every file's bytes, sha256 and pickled globals.

Usage::

    python scripts/make_hf_fixtures.py                      # all fixtures
    python scripts/make_hf_fixtures.py --only trainer_llama_zero3 --only pretrained_llama
    python scripts/make_hf_fixtures.py --out /tmp/hf        # somewhere else
    python scripts/make_hf_fixtures.py --list

A fixture is generated into a temporary folder and swapped into place only when the job succeeded
and the output is complete. After a rerun the script reports, per fixture, which files differ from
the ``fixture.json`` it replaces (see tests/fixtures/hf/README.md for what is expected to differ).
DeepSpeed's CPU all-reduce buffers (``/dev/shm/deepspeed_allreduce_buffer_*_<port>_*``) of every
port used are deleted after each launch.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import _fixture_hf_recipe as R
from ds_launch import cleanup_shm, job_env, launcher_cmd, root_cause, run_job
from make_fixtures import PortAllocator, pickle_bytes_globals, pickle_globals, sha256, swap_into_place

SCRIPTS = Path(__file__).resolve().parent
REPO = SCRIPTS.parent
DEFAULT_OUT = REPO / "tests" / "fixtures" / "hf"
TRAINER_SCRIPT = SCRIPTS / "_fixture_hf_trainer.py"
FSDP_SCRIPT = SCRIPTS / "_fixture_hf_fsdp.py"
PRETRAINED_SCRIPT = SCRIPTS / "_fixture_hf_pretrained.py"
HELPER_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")
LAUNCH_TIMEOUT_S = 900

NOTE_ZERO3_TWO = ("save_steps=1 with save_total_limit=2: Trainer saved checkpoint-1, -2 and -3 and rotated "
                  "checkpoint-1 away, so the output_dir holds two checkpoints (get_last_checkpoint picks "
                  "checkpoint-3).")
NOTE_STOP = ("Planned for max_steps=6 and stopped right after the checkpoint of step 3 (a callback sets "
             "TrainerControl.should_training_stop in on_save, after trainer_state.json was written): what an "
             "interrupted run leaves. Resuming with the recipe's arguments runs steps 4-6.")


@dataclass
class HfFixture:
    name: str
    kind: str  # "trainer" | "fsdp" | "pretrained"
    recipe: dict
    notes: list = field(default_factory=list)


FIXTURES = [
    HfFixture("trainer_llama_zero3", "trainer", R.trainer_recipe("llama", 3, save_steps=1, save_total_limit=2),
              [NOTE_STOP, NOTE_ZERO3_TWO]),
    HfFixture("trainer_llama_zero2", "trainer", R.trainer_recipe("llama", 2), [NOTE_STOP]),
    HfFixture("trainer_llama_zero3_bf16", "trainer", R.trainer_recipe("llama", 3, bf16=True), [NOTE_STOP]),
    HfFixture("trainer_llama_zero2_bf16", "trainer", R.trainer_recipe("llama", 2, bf16=True), [NOTE_STOP]),
    HfFixture("trainer_qwen2_tied_zero2", "trainer", R.trainer_recipe("qwen2_tied", 2), [NOTE_STOP]),
    HfFixture("trainer_qwen2_tied_zero3", "trainer", R.trainer_recipe("qwen2_tied", 3), [NOTE_STOP]),
    HfFixture("accelerate_fsdp_llama", "fsdp", R.fsdp_recipe()),
    HfFixture("pretrained_llama", "pretrained", R.pretrained_recipe("llama")),
    HfFixture("pretrained_llama_sharded", "pretrained", R.pretrained_recipe("llama", max_shard_size="40KB")),
    HfFixture("pretrained_qwen2_tied", "pretrained", R.pretrained_recipe("qwen2_tied")),
    HfFixture("pretrained_llama_bf16", "pretrained", R.pretrained_recipe("llama", dtype="bfloat16")),
    HfFixture("pretrained_deepseek_v3", "pretrained", R.pretrained_recipe("deepseek_v3")),  # MLA, dense
    HfFixture("pretrained_mixtral", "pretrained", R.pretrained_recipe("mixtral")),  # MoE, the Hub's per-expert layout
    HfFixture("pretrained_qwen3_moe", "pretrained", R.pretrained_recipe("qwen3_moe")),  # AutoEP's qwen3_moe preset
    HfFixture("pretrained_deepseek_v3_moe", "pretrained", R.pretrained_recipe("deepseek_v3_moe")),  # AutoEP deepseek_v3
    HfFixture("pretrained_qwen2_moe", "pretrained", R.pretrained_recipe("qwen2_moe")),  # AutoEP's qwen3_moe on Qwen2-MoE
    HfFixture("pretrained_deepseek_v2", "pretrained", R.pretrained_recipe("deepseek_v2")),  # AutoEP's deepseek_v2
    HfFixture("pretrained_qwen3_5_moe", "pretrained", R.pretrained_recipe("qwen3_5_moe")),  # AutoEP's qwen3_5_moe
    HfFixture("pretrained_minimax_m3", "pretrained", R.pretrained_recipe("minimax_m3")),  # AutoEP's minimax_m3
]
BY_NAME = {f.name: f for f in FIXTURES}


def log(msg: str) -> None:
    print(f"[make_hf_fixtures] {msg}", flush=True)


def versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for mod in ("torch", "deepspeed", "transformers", "accelerate", "safetensors", "tokenizers"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as exc:  # pragma: no cover
            out[mod] = f"unavailable: {exc}"
    return out


def json_safe(obj):
    """JSON without NaN/Infinity: non-finite floats become strings ("Infinity", as Python prints)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "Infinity" if obj > 0 else "-Infinity" if obj < 0 else "NaN"
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def file_table(root: Path) -> dict:
    """Every file under ``root`` (but fixture.json): bytes, sha256 and, for torch zip archives and
    raw pickles (DCP ``.metadata``), the pickled globals."""
    table = {}
    for p in sorted(root.rglob("*")):
        if not p.is_file() or p.name == "fixture.json":
            continue
        rel = p.relative_to(root).as_posix()
        info = {"bytes": p.stat().st_size, "sha256": sha256(p)}
        if p.suffix == ".distcp":
            info.update(distcp_summary(p))
        elif zipfile.is_zipfile(p) and not p.suffix == ".safetensors":
            try:
                info["pickle_globals"] = pickle_globals(p)
            except Exception as exc:  # pragma: no cover
                info["pickle_globals_error"] = repr(exc)
        elif p.name == ".metadata":
            info["pickle_globals"] = pickle_bytes_globals(p.read_bytes())
        table[rel] = info
    return table


def distcp_summary(path: Path) -> dict:
    """A DCP ``.distcp`` file is a run of ``torch.save`` archives, one per stored item (a tensor
    chunk, or a pickled Python value for ``BytesStorageMetadata`` entries) at the offsets the
    folder's ``.metadata`` records. The union of their pickled globals, and the item counts."""
    import pickle

    md = pickle.loads((path.parent / ".metadata").read_bytes())  # our own fresh file
    data = path.read_bytes()
    found: set[str] = set()
    items = 0
    for info in md.storage_data.values():
        if str(info.relative_path) != path.name:
            continue
        items += 1
        with zipfile.ZipFile(io.BytesIO(data[info.offset:info.offset + info.length])) as zf:
            pkl = [n for n in zf.namelist() if n.endswith("data.pkl")][0]
            found.update(pickle_bytes_globals(zf.read(pkl)))
    return {"items": items, "pickle_globals": sorted(found)}


def compare_with_previous(dest: Path, new_files: dict) -> dict:
    """Which files differ from the fixture.json being replaced (a determinism report)."""
    old_json = dest / "fixture.json"
    if not old_json.is_file():
        return {"previous": None}
    old = json.loads(old_json.read_text()).get("files", {})
    same = sorted(k for k in new_files if k in old and old[k]["sha256"] == new_files[k]["sha256"])
    changed = sorted(k for k in new_files if k in old and old[k]["sha256"] != new_files[k]["sha256"])
    return {"identical": len(same), "changed": changed, "added": sorted(set(new_files) - set(old)),
            "removed": sorted(set(old) - set(new_files))}


def hf_job_env() -> dict[str, str]:
    """``ds_launch.job_env`` plus a torch-extensions folder of this interpreter's environment:
    DeepSpeed JIT-builds its CPU all-reduce op (``deepspeed_shm_comm``) into
    ``~/.cache/torch_extensions`` by default, a folder every virtual environment on the machine
    shares; two environments alternating there rebuild it each time (about a minute on 2 cores)."""
    env = job_env(SCRIPTS)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    return env


def launch(cmd: list[str], cwd: Path, log_path: Path, timeout_s: float) -> float:
    t0 = time.time()
    try:
        rc = run_job(cmd, cwd=cwd, env=hf_job_env(), log_path=log_path, timeout_s=timeout_s)
    except TimeoutError:
        raise RuntimeError(f"launch timed out after {timeout_s}s (log: {log_path})") from None
    seconds = time.time() - t0
    if rc != 0:
        lines = open(log_path, errors="replace").readlines()
        raise RuntimeError(f"launch exited with {rc} after {seconds:.1f}s: {root_cause(lines)}\n"
                           f"log tail ({log_path}):\n{''.join(lines[-40:])}")
    return seconds


# --------------------------------------------------------------------------------------------
# Cross-checks of the reference tensors against DeepSpeed's own converters (own fresh files)
# --------------------------------------------------------------------------------------------


def _equal_tables(a: dict, b: dict) -> dict:
    """``a`` (the reference) against ``b`` (what a converter or file holds): ``equal`` when both
    have the same keys and bit-equal values (flattened: ZeRO-3's universal files are 1-D);
    ``only_converter`` keys are listed with the reference keys whose values they equal (a tied
    alias such as lm_head.weight -> model.embed_tokens.weight)."""
    import torch

    same = lambda x, y: x.numel() == y.numel() and torch.equal(x.reshape(-1), y.reshape(-1).to(x.dtype))  # noqa: E731
    keys_a, keys_b = set(a), set(b)
    common = sorted(keys_a & keys_b)
    unequal = [k for k in common if not same(a[k], b[k])]
    extra = {k: [r for r in sorted(a) if same(a[r], b[k])] for k in sorted(keys_b - keys_a)}
    return {"equal": not unequal and keys_a == keys_b, "equal_on_common_keys": not unequal, "unequal": unequal,
            "only_reference": sorted(keys_a - keys_b), "only_converter": extra}


def cross_check_trainer(fixture: Path, checkpoints: list[str], stage: int, work: Path) -> dict:
    """For each checkpoint: DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint`` against the
    live fp32 masters; for the last one also ``ds_to_universal``'s fp32 / exp_avg / exp_avg_sq
    against the live masters and moments; for ZeRO-1/2 Trainer's ``model.safetensors`` against the
    live module weights."""
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    out = {}
    for ckpt in checkpoints:
        ref = fixture / "reference" / ckpt
        fp32 = load_file(ref / "fp32.safetensors")
        res = {}
        try:
            z2f = get_fp32_state_dict_from_zero_checkpoint(str(fixture / ckpt))
            res["zero_to_fp32"] = _equal_tables(fp32, {k: v.float() for k, v in z2f.items()})
        except Exception as exc:
            res["zero_to_fp32"] = {"error": f"{type(exc).__name__}: {exc}"}
        st = fixture / ckpt / "model.safetensors"
        if st.is_file():
            res["trainer_model_safetensors_vs_live_module"] = _equal_tables(load_file(ref / "model.safetensors"),
                                                                             load_file(st))
        out[ckpt] = res

    last = checkpoints[-1]
    tag = (fixture / last / "latest").read_text().strip()
    ucp = work / "ucp" / tag
    cmd = [sys.executable, "-W", "ignore", "-m", "deepspeed.checkpoint.ds_to_universal",
           "--input_folder", str(fixture / last / tag), "--output_folder", str(ucp), "--inject_missing_state",
           "--num_extract_workers", "1", "--num_merge_workers", "1"]
    with open(work / "ds_to_universal.log", "w") as logf:
        rc = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT, cwd=work, timeout=600).returncode
    if rc != 0:
        out["ds_to_universal"] = {"error": f"exit {rc}", "command": " ".join(cmd[1:])}
        return out
    res = {"command": "python -m deepspeed.checkpoint.ds_to_universal --input_folder <checkpoint>/<tag> "
                      "--output_folder OUT --inject_missing_state"}
    for key in ("fp32", "exp_avg", "exp_avg_sq"):
        ref = load_file(fixture / "reference" / last / f"{key}.safetensors")
        conv = {}
        for d in sorted((ucp / "zero").iterdir()):
            if d.is_dir() and (d / f"{key}.pt").is_file():
                obj = torch.load(d / f"{key}.pt", weights_only=False)  # our own fresh converter output
                conv[d.name] = obj["param"] if isinstance(obj, dict) else obj
        res[key] = _equal_tables(ref, conv)
    out["ds_to_universal"] = res
    return out


def dedupe_masters(ref: Path, rel: str) -> dict:
    """The reference files by role. Under fp32 training the fp32 masters are bit-equal to the live
    module's weights (same keys: no tied duplicate); then ``fp32.safetensors`` is dropped and the
    ``fp32`` role points at ``model.safetensors``."""
    import torch
    from safetensors.torch import load_file

    roles = {"model": "model.safetensors", "fp32": "fp32.safetensors", "exp_avg": "exp_avg.safetensors",
             "exp_avg_sq": "exp_avg_sq.safetensors", "logits": "logits.safetensors"}
    model, fp32 = load_file(ref / "model.safetensors"), load_file(ref / "fp32.safetensors")
    if sorted(model) == sorted(fp32) and all(model[k].dtype == fp32[k].dtype and torch.equal(model[k], fp32[k])
                                             for k in model):
        (ref / "fp32.safetensors").unlink()
        roles["fp32"] = "model.safetensors"
    return {role: f"{rel}/{name}" for role, name in roles.items()}


# --------------------------------------------------------------------------------------------
# One fixture
# --------------------------------------------------------------------------------------------


def spec_for(fx: HfFixture, work: Path) -> dict:
    return {"recipe": fx.recipe, "output_dir": fx.name, "reference_dir": str(work / "reference"),
            "report_path": str(work / "report.json"), "hf_files_dir": str(work / "hf_files")}


def run_trainer(fx: HfFixture, work: Path, port: int, timeout_s: int) -> tuple[Path, dict]:
    world = int(fx.recipe["world_size"])
    (work / "spec.json").write_text(json.dumps(spec_for(fx, work), indent=1))
    cmd = launcher_cmd() + ["--num_gpus", str(world), "--no_local_rank", "--master_port", str(port),
                            str(TRAINER_SCRIPT), "--spec", "spec.json"]
    try:
        seconds = launch(cmd, work, work / "launch.log", timeout_s)
    finally:
        removed = cleanup_shm(port)
        if removed:
            log(f"{fx.name}: removed {len(removed)} /dev/shm buffer(s) for port {port}")
    fixture = work / fx.name
    report = json.loads((work / "report.json").read_text())
    checkpoints = sorted((p.name for p in fixture.glob("checkpoint-*")), key=lambda n: int(n.split("-")[1]))
    if not checkpoints:
        raise RuntimeError(f"no checkpoint-N in {fixture}")
    for ckpt in checkpoints:
        for helper in HELPER_SCRIPTS:
            (fixture / ckpt / helper).unlink(missing_ok=True)
        if not (fixture / ckpt / "latest").is_file():
            raise RuntimeError(f"{ckpt} has no 'latest'")
    ref = fixture / "reference"
    ref.mkdir()
    for ckpt in checkpoints:  # references of the checkpoints Trainer kept (save_total_limit)
        shutil.move(str(work / "reference" / ckpt), str(ref / ckpt))
    history = [h for h in report["log_history"] if "loss" in h]
    (ref / "losses.json").write_text(json.dumps(history, indent=1) + "\n")
    cross = cross_check_trainer(fixture, checkpoints, int(fx.recipe["ds_config"]["zero_optimization"]["stage"]),
                                work)
    reference_files = {c: dedupe_masters(ref / c, f"reference/{c}") for c in checkpoints}
    meta = {
        "command": f"deepspeed --num_gpus {world} --no_local_rank --master_port PORT "
                   "scripts/_fixture_hf_trainer.py --spec SPEC.json (cwd: a work folder holding the output_dir "
                   f"{fx.name!r}, so training_args.bin records output_dir={fx.name!r})",
        "checkpoints": {c: {"reference": f"reference/{c}", "global_step": int(c.split("-")[1]),
                            "reference_files": reference_files[c]} for c in checkpoints},
        "losses": [h["loss"] for h in history],
        "log_history": history,
        "ds_config_final": report["ds_config_final"],
        "engine": report["engine"],
        "cross_checks": cross,
        "seconds": dict(report["seconds"], launch=seconds),
    }
    return fixture, meta


def run_fsdp(fx: HfFixture, work: Path, timeout_s: int) -> tuple[Path, dict]:
    world = int(fx.recipe["world_size"])
    fixture = work / fx.name
    fixture.mkdir()
    spec = spec_for(fx, work)
    spec["output_dir"] = f"{fx.name}/checkpoint-{fx.recipe['stop_at']}"
    spec["hf_files_dir"] = str(fixture / "hf_files")
    (work / "spec.json").write_text(json.dumps(spec, indent=1))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc_per_node", str(world), str(FSDP_SCRIPT), "--spec", "spec.json"]
    seconds = launch(cmd, work, work / "launch.log", timeout_s)
    report = json.loads((work / "report.json").read_text())
    ckpt = fixture / f"checkpoint-{fx.recipe['stop_at']}"
    for sub in ("pytorch_model_fsdp_0", "optimizer_0"):
        want = {".metadata"} | {f"__{r}_0.distcp" for r in range(world)}
        have = {p.name for p in (ckpt / sub).iterdir()}
        if have != want:
            raise RuntimeError(f"{sub}: expected {sorted(want)}, found {sorted(have)}")
    shutil.move(str(work / "reference"), str(fixture / "reference"))
    (fixture / "reference" / "losses.json").write_text(json.dumps(
        [{"step": i + 1, "loss": loss, "grad_norm": g, "learning_rate": lr}
         for i, (loss, g, lr) in enumerate(zip(report["losses"], report["grad_norms"], report["learning_rates"]))],
        indent=1) + "\n")
    meta = {
        "command": f"torchrun --standalone --nproc_per_node {world} scripts/_fixture_hf_fsdp.py --spec SPEC.json",
        "checkpoints": {ckpt.name: {"reference": "reference", "global_step": int(fx.recipe["stop_at"]),
                                    "reference_files": {  # FSDP2 in fp32: the module weights are the masters
                                        "model": "reference/model.safetensors", "fp32": "reference/model.safetensors",
                                        "exp_avg": "reference/exp_avg.safetensors",
                                        "exp_avg_sq": "reference/exp_avg_sq.safetensors",
                                        "logits": "reference/logits.safetensors"}}},
        "hf_files": "hf_files/: config.json, generation_config.json and the tokenizer (not part of the checkpoint)",
        "losses": report["losses"],
        "report": {k: v for k, v in report.items() if k != "seconds"},
        "seconds": dict(report["seconds"], launch=seconds),
    }
    return fixture, meta


def run_pretrained(fx: HfFixture, work: Path, timeout_s: int) -> tuple[Path, dict]:
    (work / "spec.json").write_text(json.dumps(spec_for(fx, work), indent=1))
    cmd = [sys.executable, str(PRETRAINED_SCRIPT), "--spec", "spec.json"]
    seconds = launch(cmd, work, work / "launch.log", timeout_s)
    report = json.loads((work / "report.json").read_text())
    fixture = work / fx.name
    if not report["from_pretrained"]["weights_equal"] or not report["from_pretrained"]["logits_equal"]:
        raise RuntimeError(f"from_pretrained does not give back the saved model: {report['from_pretrained']}")
    shutil.move(str(work / "reference"), str(fixture / "reference"))
    meta = {
        "command": "python scripts/_fixture_hf_pretrained.py --spec SPEC.json",
        "reference_files": {"model": "reference/model.safetensors", "logits": "reference/logits.safetensors"},
        "report": {k: v for k, v in report.items() if k != "seconds"},
        "seconds": {"total": report["seconds"], "launch": seconds},
    }
    return fixture, meta


def make_one(fx: HfFixture, out_dir: Path, ports: PortAllocator, timeout_s: int, keep_tmp: bool) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"reshard-hf-{fx.name}-"))
    t0 = time.time()
    port = None
    try:
        if fx.kind == "trainer":
            port = ports.take()
            log(f"{fx.name}: Trainer + DeepSpeed, {fx.recipe['world_size']} ranks on port {port}, work dir {work}")
            fixture, meta = run_trainer(fx, work, port, timeout_s)
        elif fx.kind == "fsdp":
            log(f"{fx.name}: FSDP2 + Accelerate save, torchrun {fx.recipe['world_size']} ranks, work dir {work}")
            fixture, meta = run_fsdp(fx, work, timeout_s)
        else:
            log(f"{fx.name}: save_pretrained, work dir {work}")
            fixture, meta = run_pretrained(fx, work, timeout_s)
        files = file_table(fixture)
        doc = {
            "name": fx.name,
            "kind": fx.recipe["kind"],
            "recipe": fx.recipe,
            "recipe_code": "scripts/_fixture_hf_recipe.py (model: build_model after set_seed(seed); data: "
                           "dataset_ids / FixedDataset; probe batch: probe_ids; tokenizer: build_tokenizer)",
            **meta,
            "versions": versions(),
            "notes": fx.notes,
            "files": files,
        }
        doc["seconds"]["generation"] = round(time.time() - t0, 1)
        determinism = compare_with_previous(out_dir / fx.name, files)
        (fixture / "fixture.json").write_text(json.dumps(json_safe(doc), indent=1) + "\n")
        dest = swap_into_place(fixture, out_dir, fx.name)
        seconds = time.time() - t0
        total = sum(f["bytes"] for f in files.values())
        log(f"{fx.name}: OK in {seconds:.1f}s, {total / 1e6:.2f} MB; losses {meta.get('losses')}")
        if determinism.get("previous", 0) is not None:
            log(f"{fx.name}: against the previous fixture: {determinism['identical']} files identical, "
                f"changed {determinism['changed']}, added {determinism['added']}, removed {determinism['removed']}")
        return {"name": fx.name, "ok": True, "seconds": seconds, "bytes": total, "dest": str(dest),
                "determinism": determinism}
    except Exception as exc:
        log(f"{fx.name}: FAILED after {time.time() - t0:.1f}s: {exc}")
        keep_tmp = True
        return {"name": fx.name, "ok": False, "seconds": time.time() - t0, "error": str(exc)}
    finally:
        if port is not None:
            cleanup_shm(port)
        if keep_tmp:
            log(f"{fx.name}: kept work dir {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", default=[], metavar="NAME",
                    help="generate only this fixture (repeatable; also a comma-separated list)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"fixture root (default {DEFAULT_OUT})")
    ap.add_argument("--base-port", type=int, default=29810, help="first master port to try (one per launch)")
    ap.add_argument("--timeout", type=int, default=LAUNCH_TIMEOUT_S, help="seconds allowed per launch")
    ap.add_argument("--keep-tmp", action="store_true", help="keep the temporary work folders")
    ap.add_argument("--list", action="store_true", help="list the fixtures and exit")
    args = ap.parse_args(argv)

    if args.list:
        for fx in FIXTURES:
            r = fx.recipe
            stage = r.get("ds_config", {}).get("zero_optimization", {}).get("stage", "-")
            print(f"{fx.name:28s} {r['kind']:18s} {r['model_type']:6s} world={r.get('world_size', 1)} zero={stage} "
                  f"bf16={r.get('training_args', {}).get('bf16', r.get('dtype') == 'bfloat16')}")
        return 0
    names = [n for item in args.only for n in item.split(",") if n]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        ap.error(f"unknown fixture(s) {unknown}; known: {sorted(BY_NAME)}")
    todo = [BY_NAME[n] for n in names] if names else list(FIXTURES)
    ports = PortAllocator(args.base_port)
    results = [make_one(fx, args.out, ports, args.timeout, args.keep_tmp) for fx in todo]
    print()
    log("summary:")
    for r in results:
        status = "ok    " if r["ok"] else "FAILED"
        extra = f"  {r['bytes'] / 1e6:.2f} MB" if r["ok"] else f"  ({r['error'].splitlines()[0]})"
        log(f"  {status} {r['name']:28s} {r['seconds']:6.1f}s{extra}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
