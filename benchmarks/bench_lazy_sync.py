"""Peak memory of a weight sync pushed from an FP8 checkpoint folder: the eager source (every shard
read when the source is made, a quantized weight decoded whole to float32: ``reader_sources(...,
lazy=False)``, what ``reshard`` did before) against the lazy one (``reader_sources``' default: each
shard read when the push packs it, a band at a time).

The checkpoint is ``--weights`` DeepSeek-V3 MLP-width FP8 weights (18432 x 7168 E4M3, float32
``weight_scale_inv`` per 128 x 128 block: 126 MiB stored, 504 MiB decoded to float32 each) and a
norm, written into a temporary folder. One gloo job of 2 processes: trainer rank 0 reads the folder
(``reshard.open``) and pushes it with :class:`reshard.WeightSync` (bf16 on the wire,
``max_inflight_bytes`` 64 MiB) into engine rank 1, which holds every weight whole in bf16 (the
engine's own memory, not measured). Reported: the trainer process's own peak (``VmHWM``), its
resident set once imports are done, and the push's seconds; the engine's tensors are compared by
CRC-32 between the two runs (bit for bit the same push).

    python -m benchmarks.bench_lazy_sync [--weights N] [--repo PATH]   (PATH: the checkout whose
        reshard runs the eager source, e.g. main before this change; default this one)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPE, BLOCK = (18432, 7168), (128, 128)
LIMIT = 64 << 20


def names(weights: int) -> list[str]:
    kinds = ("gate_proj", "up_proj", "down_proj")
    return [f"model.layers.{i // 3}.mlp.{kinds[i % 3]}.weight" for i in range(weights)]


def write_source(folder: Path, weights: int) -> None:
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    grid = (-(-SHAPE[0] // BLOCK[0]), -(-SHAPE[1] // BLOCK[1]))
    for k, name in enumerate(names(weights)):  # a file each: the writer holds one weight at a time
        payload = torch.randint(0, 256, SHAPE, generator=g, dtype=torch.uint8)
        payload[(payload & 0x7F) == 0x7F] = 0  # E4M3's NaN bytes
        scales = torch.rand(grid, generator=g) * 1e-3 + 1e-6
        save_file({name: payload.view(torch.float8_e4m3fn), name + "_scale_inv": scales},
                  str(folder / f"model-{k:05d}.safetensors"))
        del payload
    save_file({"model.norm.weight": torch.ones(SHAPE[1], dtype=torch.bfloat16)}, str(folder / "model-norm.safetensors"))
    files = {n: f"model-{k:05d}.safetensors" for k, n in enumerate(names(weights))}
    files.update({n + "_scale_inv": f for n, f in list(files.items())})
    files["model.norm.weight"] = "model-norm.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": files}))
    quant = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK), "activation_scheme": "dynamic"}
    (folder / "config.json").write_text(json.dumps({"quantization_config": quant}))


def _hwm() -> int:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM")) // 1024


def _rss() -> int:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS")) // 1024


def child(rank: int, src: str, how: str, store: str, out: str) -> None:
    """One rank of the job (run as a script: its ``reshard`` is the one on ``PYTHONPATH``)."""
    import inspect
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import reshard
    from reshard import WeightSync
    from reshard.execute.sources import reader_sources
    from reshard.layouts.tp import replicated

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=1800))
    reader = reshard.open(src)
    base = _rss()
    shapes = {n: reader.shape(n) for n in reader.names}
    maps = {n: replicated(s, [0]) for n, s in shapes.items()}
    targets = {n: replicated(s, [1]) for n, s in shapes.items()}
    local, into = {}, None
    t0 = time.perf_counter()
    if rank == 0:
        lazy = {"lazy": how == "lazy"} if "lazy" in inspect.signature(reader_sources).parameters else {}
        if how == "lazy" and not lazy:
            raise SystemExit("this reshard has no lazy source")
        _, local = reader_sources(reader, 0, **lazy)
    else:
        into = {n: torch.empty(s, dtype=torch.bfloat16) for n, s in shapes.items()}
    sync = WeightSync(maps, targets, torch.bfloat16, max_inflight_bytes=LIMIT)
    sync.push(local, into=into)
    seconds = time.perf_counter() - t0
    result = {"rank": rank, "peak_mib": _hwm(), "base_mib": base, "seconds": seconds, "stats": sync.stats}
    if into is not None:
        result["crc"] = {n: zlib.crc32(t.view(torch.int16).numpy().tobytes()) for n, t in into.items()}
    Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def run(repo: Path, src: Path, how: str, work: Path) -> dict:
    store, outs = work / f"store-{how}", [work / f"out-{how}-{r}.json" for r in (0, 1)]
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", str(r), str(src), how,
                               str(store), str(outs[r])], env=env, cwd=tempfile.gettempdir()) for r in (0, 1)]
    codes = [p.wait(timeout=3600) for p in procs]
    if any(codes):
        raise RuntimeError(f"{how}: ranks exited {codes}")
    return {r: json.loads(outs[r].read_text()) for r in (0, 1)}


def main(argv: list[str] | None = None) -> list[str]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_lazy_sync")
    p.add_argument("--weights", type=int, default=3, help="how many 18432 x 7168 FP8 weights (default 3)")
    p.add_argument("--repo", type=Path, default=ROOT, help="the checkout whose reshard runs the eager source")
    p.add_argument("--kept-dcp", action="store_true",
                   help="push from the folder's kept FP8 DCP (reshard reshard --to dcp --files 1 --quantize keep: "
                        "one storage rank, as the one trainer rank here)")
    args = p.parse_args(argv)
    lines = []
    with tempfile.TemporaryDirectory(prefix="reshard-lazysync-") as tmp:
        work = Path(tmp)
        src = work / "fp8"
        write_source(src, args.weights)
        what = "HF folder"
        if args.kept_dcp:
            kept = work / "kept"
            subprocess.run([sys.executable, "-m", "reshard", "reshard", str(src), str(kept), "--to", "dcp", "--files",
                            "1", "--quantize", "keep"], env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True,
                           capture_output=True, cwd=tempfile.gettempdir())
            shutil.rmtree(src)
            src = next(p.parent for p in kept.rglob(".metadata"))
            what = "kept DCP, 1 file"
        eager = run(args.repo, src, "eager", work)
        lazy = run(ROOT, src, "lazy", work)
        if eager[1]["crc"] != lazy[1]["crc"]:
            raise RuntimeError("the lazy push's engine tensors differ from the eager push's")
        lines.append(f"{args.weights} FP8 {SHAPE[0]}x{SHAPE[1]} weights, {what} ({args.weights * 126} MiB stored, "
                     f"{args.weights * 504} MiB decoded) -> a bf16 engine rank, max_inflight_bytes {LIMIT >> 20} MiB; "
                     f"{len(lazy[1]['crc'])} engine tensors equal bit for bit")
        for how, res in (("eager (reshard at " + str(args.repo) + ")", eager), ("lazy", lazy)):
            t = res[0]
            lines.append(f"  trainer, {how:45s} peak {t['peak_mib']:>6} MiB (after imports + open {t['base_mib']} MiB), "
                         f"push {t['seconds']:.1f} s, {t['stats'].get('rounds')} rounds")
    return lines


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6])
    else:
        for line in main():
            print(line, flush=True)
