"""Write every route of the conformance suite (tests/formats/test_routes.py: every reader x every
writer, plus each DeepSpeed target kind, quantized, sharded and TP variants) through the CLI into
OUT/<route>/, and list the sha256 of every file written; or compare two such snapshots.

    python scripts/route_snapshot.py write OUT [WORD ...]    # OUT/<route>/... and OUT/sums.json
    python scripts/route_snapshot.py compare A B [--subset]  # every route and file of A byte-identical in B

``WORD``: only the routes whose name holds one of them; ``--subset``: compare B's routes only.

Used to show that a change of the engine or of a writer leaves every output byte-identical. The
manifest holds no time; it names source paths, each kept from ``tests/fixtures/`` on (so a checkout
of the code before a change, elsewhere, compares with one after it)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from pathlib import Path

from reshard.cli import main
from tests.formats.test_routes import ROUTES, SOURCES
from tests.support.dsconv import ds_to_universal_folder
from tests.support.paths import DCP, DEEPSPEED, HF, MEGATRON

FLAGS = {"hf_config": "--hf-config"}
# (route name, command, source, options): beyond the matrix, each writer's other kinds
EXTRA = [
    *[(f"ds-{name}-{'-'.join(f'{k}{v}' for k, v in opts.items())}", "reshard", DEEPSPEED / name,
       {"to": "deepspeed", **opts}) for name, opts in [
        ("llama_tp2_dp2", {"tp": 1, "dp": 3}), ("llama_zero3_dp2", {"tp": 1, "dp": 3}),
        ("llama_zero3_tp2_dp2", {"tp": 2, "dp": 3, "zero_stage": 1}), ("llama_zero3_dp2", {"tp": 1, "dp": 3, "zero_stage": 1}),
        ("llama_zero1_dp2", {"tp": 1, "dp": 3, "zero_stage": 3}), ("llama_zero3_tp2_dp2", {"tp": 2, "dp": 1, "zero_stage": 3}),
        ("mixtral_autoep_ep2", {"tp": 1, "dp": 1, "ep": 1}), ("mixtral_autoep_ep2", {"tp": 1, "dp": 4, "ep": 2}),
        ("mixtral_autoep_ep2_zero3", {"tp": 1, "dp": 4, "ep": 4}), ("mixtral_autoep_ep2_zero3", {"tp": 1, "dp": 1, "ep": 1}),
        ("moe_ep2", {"tp": 1, "dp": 1, "ep": 1}), ("moe_ep2", {"tp": 1, "dp": 4, "ep": 2}),
        ("pipe_pp2_dp2", {"tp": 1, "dp": 1, "pp": 2}), ("tp_pipe_tp2_pp2", {"tp": 1, "pp": 2, "dp": 3}),
        ("llama_zero1_dp2_bf16", {"tp": 1, "dp": 3, "zero_stage": 3})]],
    ("st-quantize-fp8", "convert", HF / "pretrained_llama_sharded", {"format": "safetensors", "quantize": "fp8"}),
    ("st-fp8-copy", "convert", HF / "fp8_qwen2", {"format": "safetensors", "quantize": "fp8"}),
    ("st-fp8-decode", "convert", HF / "fp8_qwen2", {"format": "safetensors"}),
    ("st-with-optimizer", "convert", DEEPSPEED / "llama_tp2_dp2", {"format": "safetensors", "with_optimizer": True}),
    ("st-max-file", "convert", DCP / "llama_fsdp2_ws2", {"format": "safetensors", "max_file_gb": 0.00002}),
    ("dcp-files2", "reshard", HF / "pretrained_llama_sharded", {"to": "dcp", "files": 2}),
    ("dcp-native-files2", "reshard", DCP / "llama_fsdp2_ws2", {"to": "dcp", "files": 3}),
    ("dcp-from-tp", "convert", DCP / "llama_fsdp_tp_2x2", {"format": "dcp"}),
    ("vllm-tp2", "convert", HF / "pretrained_llama_sharded", {"format": "vllm", "tp": 2}),
    ("hf-from-trainer-zero3", "convert", HF / "trainer_llama_zero3" / "checkpoint-3", {"format": "hf"}),
    ("hf-tied", "convert", HF / "pretrained_qwen2_tied", {"format": "hf"}),
    ("meg-tp1", "reshard", MEGATRON / "torch_dist_tp2_dp2_distopt", {"to": "megatron", "tp": 1}),
    ("meg-moe", "reshard", MEGATRON / "torch_dist_moe_ep2_distopt", {"to": "megatron", "ep": 1}),
    ("meg-legacy-pp1", "reshard", MEGATRON / "legacy_tp2_pp2", {"to": "megatron", "pp": 1}),
    ("meg-from-hf-tp2", "reshard", HF / "pretrained_llama_sharded", {"to": "megatron", "tp": 2}),
    ("meg-distopt-dp1", "reshard", MEGATRON / "torch_dist_tp2_dp2_distopt", {"to": "megatron", "dp": 1}),
    ("meg-fully-reshardable", "reshard", MEGATRON / "torch_dist_dp2_fully_reshardable", {"to": "megatron", "dp": 1}),
    ("meg-to-fully-reshardable", "reshard", MEGATRON / "torch_dist_tp2_dp2_distopt",
     {"to": "megatron", "optimizer": "fully_reshardable"}),
    ("meg-moe-shared", "reshard", MEGATRON / "torch_dist_moe_tp2_ep2_shared_distopt",
     {"to": "megatron", "tp": 1, "dp": 2}),  # its EP 2 needs 2 ranks at TP 1
    ("meg-vpp", "reshard", MEGATRON / "torch_dist_pp2_vpp2_distopt", {"to": "megatron", "pp": 1}),
    ("meg-legacy-distopt", "reshard", MEGATRON / "legacy_dp2_distopt", {"to": "megatron"}),
    ("meg-from-hf-adam", "reshard", HF / "pretrained_llama_sharded", {"to": "megatron", "optimizer": "adam"}),
    ("meg-from-hf-dist", "reshard", HF / "pretrained_llama_sharded", {"to": "megatron", "optimizer": "dp_reshardable"}),
    ("meg-to-st", "convert", MEGATRON / "torch_dist_moe_ep2", {"format": "safetensors", "names": "megatron"}),
    ("ds-trainer-dp1", "reshard", HF / "trainer_llama_zero2" / "checkpoint-3", {"to": "deepspeed", "dp": 1}),
    ("ds-trainer-z3", "reshard", HF / "trainer_llama_zero3" / "checkpoint-3", {"to": "deepspeed", "dp": 3}),
    ("ds-from-hf-tp2", "reshard", HF / "pretrained_llama_sharded", {"to": "deepspeed", "tp": 2, "dp": 1}),
    ("ds-from-hf-z3", "reshard", HF / "pretrained_llama_sharded", {"to": "deepspeed", "tp": 1, "dp": 2, "zero_stage": 3}),
    ("ds-from-dcp-z2", "reshard", DCP / "llama_fsdp2_ws2", {"to": "deepspeed", "tp": 1, "dp": 3, "zero_stage": 2}),
    ("ds-moe-z2", "reshard", DEEPSPEED / "moe_ep2_bf16_zero2", {"to": "deepspeed", "dp": 4, "ep": 2}),
    ("ds-autoep-edp-ep1", "reshard", DEEPSPEED / "mixtral_autoep_ep2_dp4", {"to": "deepspeed", "dp": 2, "ep": 1}),
]


def _argv(cmd: str, src: Path, out: Path, opts: dict) -> list[str]:
    argv = [cmd, str(src), str(out)]
    for k, v in opts.items():
        flag = FLAGS.get(k, "--" + k.replace("_", "-"))
        argv += [flag] if v is True else [flag, str(v)]
    return argv


def _routes(work: Path) -> list[tuple[str, str, Path, dict]]:
    out = []
    for s, t in ROUTES:
        kind, path, _, options = SOURCES[s]
        if kind == "universal":
            path = work / "universal-source"
            if not (path / "latest_universal").is_file():
                ds_to_universal_folder(SOURCES[s][1], path)
        opts = dict(options) if t in ("hf", "vllm") else {}
        if t == "deepspeed":
            out.append((f"{s}-to-{t}", "reshard", path, {"to": "deepspeed", "tp": 1, "dp": 2}))
        elif t == "megatron":
            out.append((f"{s}-to-{t}", "reshard", path, {"to": "megatron"}))
        else:
            out.append((f"{s}-to-{t}", "convert", path, {"format": t, **opts}))
    return out + EXTRA


def _sums(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(_bytes(p)).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _bytes(p: Path) -> bytes:
    """A file's bytes; a manifest without its time keys (which differ between any two runs)."""
    data = p.read_bytes()
    if p.name == "reshard-manifest.json":  # a fixture's path, whichever checkout ran it
        doc = json.loads(re.sub(rb'"[^"]*?/tests/fixtures/', b'"/tests/fixtures/', data))
        for k in ("created", "elapsed_s", "time", "started", "finished"):
            doc.pop(k, None)
        data = json.dumps(doc, sort_keys=True).encode()
    return data


def write(out: Path, words: list[str]) -> None:
    # DeepSpeed's universal of the universal route's source, made once (its path is in the manifests)
    work = Path(os.environ.get("ROUTE_SNAPSHOT_WORK", "/tmp/route-snapshot-work"))
    work.mkdir(parents=True, exist_ok=True)
    sums, failed = {}, {}
    for name, cmd, src, opts in _routes(work):
        if words and not any(w in name for w in words) and not (out / name).exists():
            continue  # not asked for, nor written before
        folder = out / name
        try:
            code = 0 if folder.exists() else main(_argv(cmd, src, folder, opts))  # a route written before: kept
        except SystemExit as e:  # a flag the CLI does not take
            code = e.code
        if code != 0:
            failed[name] = code
            continue
        sums[name] = _sums(folder)
        print(name, len(sums[name]), "files", flush=True)
    (out / "sums.json").write_text(json.dumps({"sums": sums, "failed": failed}, indent=1, sort_keys=True))
    print(len(sums), "routes,", sum(map(len, sums.values())), "files;", len(failed), "failed:", failed)


def compare(a: Path, b: Path, subset: bool = False) -> int:
    sa, sb = (json.loads((x / "sums.json").read_text()) for x in (a, b))
    if subset:
        sa["sums"] = {r: f for r, f in sa["sums"].items() if r in sb["sums"]}
        sa["failed"] = {r: c for r, c in sa["failed"].items() if r in sb["failed"]}
    bad = []
    for route, files in sa["sums"].items():
        other = sb["sums"].get(route)
        if other is None:
            bad.append(f"{route}: missing")
            continue
        bad += [f"{route}/{f}" for f in sorted(set(files) | set(other)) if files.get(f) != other.get(f)]
    if sa["failed"] != sb["failed"]:
        bad.append(f"failed differ: {sa['failed']} vs {sb['failed']}")
    n = sum(map(len, sa["sums"].values()))
    print(f"{len(sa['sums'])} routes, {n} files: {n - len(bad)} identical, {len(bad)} differ")
    for x in bad[:40]:
        print("  ", x)
    return 1 if bad else 0


if __name__ == "__main__":
    if sys.argv[1] == "write":
        write(Path(sys.argv[2]), sys.argv[3:])
    else:
        sys.exit(compare(Path(sys.argv[2]), Path(sys.argv[3]), "--subset" in sys.argv[4:]))
