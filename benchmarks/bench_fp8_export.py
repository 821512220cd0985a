"""FP8 block-scale HF folder -> bf16 HF folder (issue 33, "Speed and memory"), three ways in one run:

(1) ``reshard convert SRC OUT --format hf --dtype bf16`` (the CLI, a subprocess);
(2) transformers' own path: ``AutoModelForCausalLM.from_pretrained(SRC,
    quantization_config=FineGrainedFP8Config(dequantize=True), dtype=torch.bfloat16)`` then
    ``save_pretrained(OUT2)`` and an fsync of each file it wrote (reshard's commit fsyncs too), a subprocess;
(3) the copy floor: reading every byte of SRC once, then writing OUT's byte count and fsyncing it
    (a subprocess of its own, no work on the bytes).

Each: wall time from start to exit, and peak RSS of its process tree (psutil: the sum of every
process's RSS, sampled every 20 ms) beside the largest single process's own peak (``VmHWM``).
Then OUT and OUT2 are compared tensor by tensor (safetensors, one tensor at a time): the same
names, dtypes, shapes and bytes.

SRC is a Qwen2-shaped model with random weights (seeded), its decoder linears encoded by
``reshard.ir.codec.fp8_block_encode`` (128 x 128 blocks, float32 ``weight_scale_inv``; bit for bit
transformers' ``Fp8Quantize``, ``bench_quantize``), embeddings, norms, biases and ``lm_head`` bf16,
written one tensor at a time (``write_fp8_folder``: no more than one tensor in memory) as sharded
safetensors with an index into a temporary folder, deleted after.

    python -m benchmarks.bench_fp8_export [--sizes 250m,1b]    (make bench: $FP8_EXPORT_SIZES, default 1b)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN_S = 1800  # one command's limit
BLOCK = (128, 128)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK)}
# Qwen2 shapes (head_dim 64, untied, vocabulary 32000): "1b" is TinyLlama-1.1B's, "250m" a quarter of it
SIZES = {
    "1b": {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
           "num_key_value_heads": 4, "vocab_size": 32000},
    "250m": {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 16, "num_attention_heads": 16,
             "num_key_value_heads": 4, "vocab_size": 32000},
    "100m": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 12,
             "num_key_value_heads": 4, "vocab_size": 32000},
    "tiny": {"hidden_size": 256, "intermediate_size": 384, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 512},
}
DTYPES = {"bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3", "float32": "F32"}
MIB = 2**20


def _entries(config: object) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, safetensors dtype, shape) of every tensor the folder holds, in name order: the model's
    state dict (built on the meta device: no memory), each decoder linear's weight as an E4M3
    payload followed by its float32 ``weight_scale_inv``."""
    import torch
    from transformers import Qwen2ForCausalLM

    from reshard.ir.codec import scale_grid

    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    out = []
    for name, t in model.state_dict().items():
        shape = tuple(t.shape)
        if quantized_linear(name):
            out += [(name, "F8_E4M3", shape), (name + "_scale_inv", "F32", scale_grid(shape, BLOCK))]
        else:
            out.append((name, "BF16", shape))
    return sorted(out)


def quantized_linear(name: str, linears: tuple[str, ...] = LINEARS) -> bool:
    """A decoder layer's linear weight (the ones an FP8 release stores quantized)."""
    return name.startswith("model.layers.") and name.endswith(".weight") and name.split(".")[-2] in linears


def nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    n = {"BF16": 2, "F8_E4M3": 1, "F32": 4}[dtype]
    for d in shape:
        n *= d
    return n


def _tensors(entries: list[tuple[str, str, tuple[int, ...]]], seed: int) -> Iterator[tuple[str, bytes]]:
    """Each entry's bytes in order: random bf16 weights (std 0.02; norms 1), a linear's encoded by
    ``fp8_block_encode`` (its scales, the next entry, kept until then)."""
    import torch

    from reshard.ir.codec import fp8_block_encode

    scales: dict[str, torch.Tensor] = {}
    for i, (name, dtype, shape) in enumerate(entries):
        if name in scales:
            t = scales.pop(name)
        elif name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            g = torch.Generator().manual_seed(seed * 100_003 + i)
            t = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
            if dtype == "F8_E4M3":
                t, scales[name + "_scale_inv"] = fp8_block_encode(t, BLOCK, "float32")
        assert DTYPES[str(t.dtype).removeprefix("torch.")] == dtype and tuple(t.shape) == shape, name
        yield name, t.contiguous().view(torch.uint8).numpy().tobytes()


def write_fp8_folder(folder: Path, size: str | dict, max_shard: int = 512 * MIB, seed: int = 0) -> dict:
    """An FP8 block-scale HF folder (``config.json`` with ``quantization_config`` ``QUANT``; shards
    of at most ``max_shard`` bytes, name order, ``model.safetensors.index.json``), written one
    tensor at a time: each file's header first (every shape is known), then its tensors' bytes.
    Returns ``{"parameters", "bytes", "files"}``."""
    import struct

    from transformers import Qwen2Config

    shape = SIZES[size] if isinstance(size, str) else size
    config = Qwen2Config(**shape, head_dim=shape["hidden_size"] // shape["num_attention_heads"],
                         max_position_embeddings=128, tie_word_embeddings=False, dtype="bfloat16")
    entries = _entries(config)
    shards: list[list[tuple[str, str, tuple[int, ...]]]] = [[]]
    used = 0
    for e in entries:
        if shards[-1] and used + nbytes(e[1], e[2]) > max_shard:
            shards.append([])
            used = 0
        shards[-1].append(e)
        used += nbytes(e[1], e[2])
    folder.mkdir(parents=True, exist_ok=True)
    stream = _tensors(entries, seed)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        header: dict = {"__metadata__": {"format": "pt"}}
        at = 0
        for name, dtype, shp in shard:
            header[name] = {"dtype": dtype, "shape": list(shp), "data_offsets": [at, at + nbytes(dtype, shp)]}
            at += nbytes(dtype, shp)
            weight_map[name] = fname
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors aligns the data to 8 bytes
        with open(folder / fname, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for name, _, _ in shard:
                got, data = next(stream)
                assert got == name, (got, name)
                f.write(data)
        total += at
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    doc = config.to_dict()
    doc["quantization_config"] = dict(QUANT)
    (folder / "config.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    params = sum(nbytes("F8_E4M3", s) for n, d, s in entries if not n.endswith("_scale_inv"))
    return {"parameters": params, "bytes": total, "files": len(shards)}


def _hwm(pid: int) -> int:
    """A process's own peak RSS so far (``VmHWM``, bytes; 0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return 0


def measured(args: list, log: Path) -> tuple[float, int, int]:
    """``python ARGS``: wall time (s), the peak RSS of its process tree (bytes; psutil, the sum over
    the tree sampled every 20 ms) and the largest single process's own peak (``VmHWM``, last read
    within 20 ms of its exit: it catches spikes between samples). Not ``wait4``'s ``ru_maxrss``:
    Linux carries the forking parent's RSS into it (this process's, with its generated tensors' arena)."""
    import psutil

    from benchmarks.common import tree_rss

    os.sync()  # the previous command's writeback is not this one's
    with open(log, "w") as out:
        t0 = time.perf_counter()
        p = psutil.Popen([sys.executable, *map(str, args)], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore"),
                         start_new_session=True)
        peak, hwm = 0, {}
        while p.poll() is None:
            total, procs = tree_rss(p)
            for q in procs:
                hwm[q.pid] = max(hwm.get(q.pid, 0), _hwm(q.pid))
            peak = max(peak, total)
            if time.perf_counter() - t0 > RUN_S:
                os.killpg(p.pid, 9)
                raise SystemExit(f"{args[:3]} ran past {RUN_S} s; its output: {log}")
            time.sleep(0.02)
        wall = time.perf_counter() - t0
    if p.returncode:
        raise RuntimeError(f"{' '.join(map(str, args))} exited {p.returncode}:\n{log.read_text()[-3000:]}")
    return wall, peak, max(hwm.values(), default=0)


def transformers_export(src: str, out: str) -> None:
    """transformers' own way to a bf16 folder: the dequantizing load, then ``save_pretrained``."""
    import torch
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=FineGrainedFP8Config(dequantize=True),
                                                 dtype=torch.bfloat16)
    t1 = time.perf_counter()
    model.save_pretrained(out)
    for p in Path(out).iterdir():
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    t2 = time.perf_counter()
    Path(out, "timing.json.txt").write_text(json.dumps({"load_s": t1 - t0, "save_s": t2 - t1}))


def copy_floor(src: str, out_bytes: str, scratch: str) -> None:
    """Every byte of SRC read once, then OUT's byte count written and fsynced: no work on them."""
    for p in sorted(Path(src).iterdir()):
        with open(p, "rb") as f:
            while f.read(1 << 24):
                pass
    block, left = b"\0" * (1 << 24), int(out_bytes)
    with open(scratch, "wb") as f:
        while left > 0:
            f.write(block[:min(left, len(block))])
            left -= len(block)
        f.flush()
        os.fsync(f.fileno())
    os.unlink(scratch)


def _files(folder: Path) -> dict[str, Path]:
    from safetensors import safe_open

    where = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, "pt") as g:
            where.update(dict.fromkeys(g.keys(), f))
    return where


def same_tensors(a: Path, b: Path) -> tuple[int, list[str]]:
    """How many tensors ``a`` and ``b`` hold alike (name, dtype, shape, bytes), and what differs;
    one tensor of each in memory at a time."""
    import torch
    from safetensors import safe_open

    fa, fb = _files(a), _files(b)
    bad = [f"only in {a.name}: {n}" for n in sorted(fa.keys() - fb.keys())]
    bad += [f"only in {b.name}: {n}" for n in sorted(fb.keys() - fa.keys())]
    same = 0
    for n in sorted(fa.keys() & fb.keys()):
        with safe_open(fa[n], "pt") as g, safe_open(fb[n], "pt") as h:
            x, y = g.get_tensor(n), h.get_tensor(n)
        if x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
            same += 1
        else:
            bad.append(f"{n}: {x.dtype} {tuple(x.shape)} vs {y.dtype} {tuple(y.shape)}")
    return same, bad


def folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def one_size(size: str, work: Path) -> list[str]:
    from benchmarks.common import row

    src, out, out2 = work / "fp8", work / "reshard", work / "transformers"
    t = time.perf_counter()
    made = write_fp8_folder(src, size)
    gen_s = time.perf_counter() - t
    lines = [f"  FP8 Qwen2 '{size}' ({made['parameters'] / 1e6:.0f}M parameters, {SIZES[size]}): {made['files']} "
             f"shards, {made['bytes'] / MIB:.0f} MiB (generated in {gen_s:.0f} s, one tensor at a time)"]
    ours_s, ours_rss, ours_max = measured(["-m", "reshard", "convert", src, out, "--format", "hf", "--dtype", "bf16"],
                                          work / "reshard.log")
    try:
        peer_s, peer_rss, peer_max = measured([Path(__file__), "--transformers-export", src, out2],
                                              work / "transformers.log")
        inner = json.loads((out2 / "timing.json.txt").read_text())
    except RuntimeError as e:
        peer_s = None
        lines.append(f"  transformers' dequantizing load + save_pretrained failed: {str(e).splitlines()[-1]}")
    floor_s, floor_rss, _ = measured([Path(__file__), "--copy-floor", src, folder_size(out), work / "scratch"],
                                     work / "floor.log")
    lines.append(row(f"fp8->bf16 {size}: reshard convert --dtype bf16 vs copy floor", ours_s, floor_s,
                     note=f"(floor reads {made['bytes'] / MIB:.0f} MiB, writes {folder_size(out) / MIB:.0f} MiB + fsync)"))
    if peer_s is not None:
        lines.append(row(f"fp8->bf16 {size}: reshard convert vs transformers load+save", ours_s, peer_s,
                         note=f"(load {inner['load_s']:.1f} s, save_pretrained + fsync {inner['save_s']:.1f} s)"))
    lines.append(row(f"fp8->bf16 {size}: reshard peak RSS (tree, 20 ms samples)", ours_rss / MIB,
                     None if peer_s is None else peer_rss / MIB, unit="MiB",
                     note=f"(largest process VmHWM: reshard {ours_max / MIB:.0f} MiB"
                          + ("" if peer_s is None else f", transformers {peer_max / MIB:.0f} MiB")
                          + f"; copy floor {floor_rss / MIB:.0f} MiB; goal <= 512 MiB: "
                          + ("met)" if max(ours_rss, ours_max) <= 512 * MIB else "NOT met)")))
    if peer_s is not None:
        same, bad = same_tensors(out, out2)
        if bad:
            raise SystemExit(f"reshard's and transformers' bf16 folders differ ({len(bad)}): {bad[:5]}")
        qc = "quantization_config" in json.loads((out / "config.json").read_text())
        lines.append(f"  outputs agree: all {same} tensors of reshard's folder equal transformers' bit for bit "
                     f"(names, dtypes, shapes, bytes); reshard's config.json quantization_config: {qc}")
    return lines


def main(sizes: list[str] | None = None) -> list[str]:
    try:
        import psutil  # noqa: F401
        from transformers import FineGrainedFP8Config  # noqa: F401
    except ImportError as e:
        return [f"  (skipped: {e}; this benchmark needs transformers and psutil)"]
    sizes = sizes or os.environ.get("FP8_EXPORT_SIZES", "1b").split(",")
    out = []
    for size in sizes:
        with tempfile.TemporaryDirectory(prefix="fp8_export_") as tmp:
            out += one_size(size, Path(tmp))
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default=None, help=f"comma-separated, of {sorted(SIZES)} (default $FP8_EXPORT_SIZES or 1b)")
    ap.add_argument("--transformers-export", nargs=2, metavar=("SRC", "OUT"))
    ap.add_argument("--copy-floor", nargs=3, metavar=("SRC", "OUT_BYTES", "SCRATCH"))
    a = ap.parse_args()
    if a.transformers_export:
        transformers_export(*a.transformers_export)
    elif a.copy_floor:
        copy_floor(*a.copy_floor)
    else:
        from benchmarks.common import machine

        print(f"machine: {machine()}", flush=True)
        for line in main(a.sizes.split(",") if a.sizes else None):
            print(line, flush=True)
