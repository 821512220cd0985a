"""The processes of ``tests/execute/test_sync_megatron_files.py``: one gloo job (``workdir/job.json``)
of 2 trainer ranks, each reading a Megatron-Core ``torch_dist`` checkpoint under HF names through
``reader_sources`` (what ``ShardSource.checkpoint`` wraps, vLLM aside: storage rank ``k`` on trainer
rank ``k``), and 2 vLLM-style TP engine
ranks (``inference_targets(LLAMA_VLLM)``, plain bf16 tensors), the sync over the world.

For each fixture, one lazy push and one eager push (``lazy=False``); each trainer rank logs every
DCP chunk its reader reads (the file the checkpoint's ``.metadata`` names for it) from the moment
its sources are built until the pushes end, and every engine rank saves what it received.
"""

from __future__ import annotations

import json
import traceback
from datetime import timedelta
from pathlib import Path

import torch

PG_TIMEOUT_S = 60


def _targets(maps, job: dict) -> dict:
    from reshard.layouts.arch import LLAMA_VLLM, inference_targets

    shapes = {n: tuple(m.valid_shape) for n, m in maps.items()}
    return inference_targets(LLAMA_VLLM, shapes, tp=len(job["engine"]), num_heads=job["heads"],
                             num_kv_heads=job["kv_heads"], ranks=job["engine"])


def _logged(reader, files: list[str]) -> None:
    """Log the file of every chunk ``reader``'s checkpoint reads from now on (this process's reader)."""
    ck = reader.src.ck
    read = ck.chunk

    def chunk(key: str, i: int) -> torch.Tensor:
        files.append(ck.entry(key).chunks[i].file)
        return read(key, i)

    ck.chunk = chunk


def run(rank: int, workdir: Path, job: dict) -> dict:
    import reshard
    from reshard import WeightSync
    from reshard.execute.sources import reader_sources
    from reshard.layouts.inference import engine_shapes

    trainers = job["trainer"]
    recs: dict = {}
    for fixture, path in job["sources"].items():
        for lazy in (True, False):
            reader = reshard.open(path, names="hf")
            files: list[str] = []
            _logged(reader, files)
            maps, mine = reader_sources(reader, rank, ranks=trainers, lazy=lazy)
            shards = mine if rank in trainers else {}
            tg = _targets(maps, job)
            sync = WeightSync(maps, tg, torch.bfloat16)
            into = None
            if rank in job["engine"]:
                into = {n: torch.full(s, 9.0, dtype=torch.bfloat16) for n, s in engine_shapes(tg, rank).items()}
            sync.push(shards, into=into)
            how = "lazy" if lazy else "eager"
            if into is not None:
                torch.save(into, workdir / f"engine-{fixture}-{how}-{rank}.pt")
            recs[f"{fixture}-{how}"] = {"files": sorted(set(files)), "reads": len(files),
                                        "held": sorted(shards)}
    return recs


def worker(rank: int, workdir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = Path(workdir)
    job = json.loads((out / "job.json").read_text())
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
