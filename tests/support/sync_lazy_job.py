"""The processes of ``tests/execute/test_sync_lazy.py``: one gloo job (``workdir/job.json``) of 2
trainer ranks reading a quantized checkpoint (``reader_sources``: storage rank ``k`` on trainer rank
``k``) and 2 vLLM-style TP engine ranks (``inference_targets(LLAMA_VLLM)``, plain tensors), the
sync over the world.

For each source (``job["sources"]``: an FP8 HF folder, its kept FP8 DCP at 2 files) and each
target (bf16; FP8 with ``Fp8Block``; FP8 of ``o_proj`` alone in 16 x 64 blocks, whose one block
column the engine's TP boundary cuts), one push from the eager source (``lazy=False``: every shard
read, a quantized one decoded whole) and one from the lazy one (bands of ``RESHARD_BAND_BYTES``,
set small, and ``max_inflight_bytes`` small: many rounds); every engine rank saves both results.

Then **damaged**: trainer rank 0 writes a NaN into a scale of the HF folder's ``down_proj`` in place
(the readers are open: the lazy source reads it at push time), the engine's tensors are set to 9,
and a lazy push must raise the same ``QuantizedError`` naming the scale tensor on every rank with
the engine's tensors untouched (nothing sent), then an eager push shows what the eager path does with
a scale damaged after ``reshard.open``.
"""

from __future__ import annotations

import json
import os
import traceback
from datetime import timedelta
from pathlib import Path

import torch

PG_TIMEOUT_S = 60
DAMAGED = "model.layers.1.mlp.down_proj.weight_scale_inv"


def _raises(fn) -> dict:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the type is the result
        return {"raised": type(e).__name__, "message": str(e)}
    return {"raised": None}


def _targets(maps, job: dict) -> dict:
    from reshard.layouts.arch import LLAMA_VLLM, inference_targets

    shapes = {n: tuple(m.valid_shape) for n, m in maps.items()}
    return inference_targets(LLAMA_VLLM, shapes, tp=len(job["engine"]), num_heads=job["heads"],
                             num_kv_heads=job["kv_heads"], ranks=job["engine"])


def _engine(sync, tg, rank: int, job: dict) -> dict[str, torch.Tensor] | None:
    from reshard.layouts.inference import engine_shapes

    if rank not in job["engine"]:
        return None
    out = {n: torch.full(s, 9.0, dtype=torch.bfloat16) for n, s in engine_shapes(tg, rank).items()}
    for q in sync._quant.values():  # FP8 payloads and their scales where the sync quantizes
        for t, dtype in ((q.payload, torch.float8_e4m3fn), (q.scale, torch.float32)):
            if rank in t.shapes:
                out[t.into] = torch.zeros(t.shapes[rank], dtype=torch.float32).to(dtype)
    return out


def run(rank: int, workdir: Path, job: dict) -> dict:
    import reshard
    from reshard import Fp8Block, WeightSync
    from reshard.execute.sources import reader_sources

    trainers = job["trainer"]
    recs: dict = {}
    for src_name, path in job["sources"].items():
        reader = reshard.open(path)
        maps, eager = reader_sources(reader, rank, ranks=trainers, lazy=False)
        _, lazy = reader_sources(reader, rank, ranks=trainers)
        if rank not in trainers:
            eager, lazy = {}, {}
        tg = _targets(maps, job)
        for target in ("bf16", "fp8", "fp8cut"):
            quant = {"bf16": None, "fp8": Fp8Block(tuple(job["block"])),
                     # o_proj's 64 input columns in one 64-wide block, which TP 2 cuts: each rank its cover
                     "fp8cut": Fp8Block((16, 64), weights=lambda n, s: n.endswith("o_proj.weight"))}[target]
            stats = {}
            for how, local in (("eager", eager), ("lazy", lazy)):
                sync = WeightSync(maps, tg, torch.bfloat16, max_inflight_bytes=job["inflight"], quantize=quant)
                into = _engine(sync, tg, rank, job)
                sync.push(local, into=into)
                stats[how] = dict(sync.stats)
                if into is not None:
                    torch.save(into, workdir / f"engine-{src_name}-{target}-{how}-{rank}.pt")
            recs[f"{src_name}-{target}"] = {"stats": stats, "quantized": sorted(sync._quant)}

    # a scale damaged after the readers were opened: the lazy source reads it at push time
    import torch.distributed as dist

    path = job["sources"]["hf"]
    reader = reshard.open(path)
    maps, lazy = reader_sources(reader, rank, ranks=trainers)
    if rank not in trainers:
        lazy = {}
    tg = _targets(maps, job)
    sync = WeightSync(maps, tg, torch.bfloat16, max_inflight_bytes=job["inflight"])
    into = _engine(sync, tg, rank, job)
    sync.push(lazy, into=into)  # a good push first: the program compiled from the lazy source
    dist.barrier()
    if rank == trainers[0]:
        _damage(Path(path) / "model.safetensors", DAMAGED)
    dist.barrier()
    if into is not None:
        for t in into.values():
            t.fill_(9.0)
    got = _raises(lambda: sync.push(lazy, into=into))
    got["untouched"] = all(bool((t == 9.0).all()) for t in (into or {}).values())
    # the eager path, its shards read after the damage: what it does with it
    _, eager_after = reader_sources(reader, rank, ranks=trainers, lazy=False)
    if rank not in trainers:
        eager_after = {}
    got["eager"] = _raises(lambda: sync.push(eager_after, into=into))
    got["eager_nan"] = any(bool(t.isnan().any()) for t in (into or {}).values())
    recs["damaged"] = got
    return recs


def _damage(file: Path, name: str) -> None:
    """Entry ``name``'s first element set to NaN, written in place (the same file: open mappings see it)."""
    raw = file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    start = 8 + n + header[name]["data_offsets"][0]
    assert header[name]["dtype"] == "F32"
    with open(file, "r+b") as f:
        f.seek(start)
        f.write(torch.tensor([float("nan")], dtype=torch.float32).numpy().tobytes())


def worker(rank: int, workdir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = Path(workdir)
    job = json.loads((out / "job.json").read_text())
    os.environ["RESHARD_BAND_BYTES"] = str(job["band_bytes"])
    world = len(job["trainer"]) + len(job["engine"])
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world,
                            timeout=timedelta(seconds=PG_TIMEOUT_S))
    with open(out / f"rank{rank}.jsonl", "w") as log:
        try:
            for name, rec in run(rank, out, job).items():
                log.write(json.dumps({"phase": name, **rec}) + "\n")
        except Exception:  # noqa: BLE001 - reported to the parent, which fails the test
            log.write(json.dumps({"phase": "crashed", "trace": traceback.format_exc()}) + "\n")
        log.flush()
    dist.destroy_process_group()
