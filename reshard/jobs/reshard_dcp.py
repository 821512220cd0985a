"""A DCP checkpoint laid out again for N loading ranks (``reshard reshard DCP_DIR OUT --files N``):
each file holds what one rank of an N-way FSDP mesh loads (dim-0 chunks, as ``fully_shard``
splits), each chunk streamed from the source chunks through a plan between the two maps, so a
load reads every byte once and nothing is ever whole in memory."""

from __future__ import annotations

import threading
from functools import partial
from pathlib import Path

from ..errors import ReshardError
from ..execute.local import WindowFill
from ..formats.dcp.reader import DcpCheckpoint
from ..formats.dcp.writer import DcpFile, Record, TensorSpec
from ..ir.piece import prod
from ..layouts._core import box_piece
from ..layouts._core import finish as finish_map
from ..plan.planner import plan_model
from ..storage.staging import Staging
from .cluster import Cluster, open_staging
from .convert_dcp import DcpTensors, finish_report, flat_shard, run_shares, write_metadata
from .reports import ConvertReport


def fsdp_chunks(shape: tuple[int, ...], n: int) -> list[tuple[int, int]]:
    """``(start, rows)`` of dim 0 on each of ``n`` ranks, as ``fully_shard`` splits (``torch.chunk``:
    ceil-sized chunks, the last ones shorter or empty); a 0-d tensor lives on rank 0."""
    if not shape:
        return [(0, 1)] + [(0, 0)] * (n - 1)
    step = -(-shape[0] // n)
    return [(min(r * step, shape[0]), max(0, min(shape[0], (r + 1) * step) - r * step)) for r in range(n)]


def target_chunks(shape: tuple[int, ...], n: int) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
    """``{rank: (offsets, sizes)}`` of the chunks a tensor is stored in for ``n`` loading ranks;
    a tensor without elements is one empty chunk on rank 0 (as ``dcp.save`` stores it)."""
    if not shape or not prod(shape):
        return {0: ((0,) * len(shape), shape)}
    return {r: ((start,) + (0,) * (len(shape) - 1), (rows, *shape[1:]))
            for r, (start, rows) in enumerate(fsdp_chunks(shape, n)) if rows}


def fsdp_map(shape: tuple[int, ...], n: int):
    """The map of a tensor laid out for ``n`` FSDP ranks (:func:`target_chunks`)."""
    shards = {}
    for r, (offsets, sizes) in target_chunks(shape, n).items():
        pieces = [box_piece(shape, offsets, sizes, sizes, (0,) * len(shape), (r,))] if prod(sizes) else []
        shards[r] = (sizes, pieces)
    return finish_map(shape, shards)


def reshard_dcp(ck: DcpCheckpoint, cluster: Cluster, staging: Staging, *, files: int, workers: int) -> None:
    """One file per loading rank ``r`` (``__r_0.distcp``) with rank ``r``'s chunk of every tensor,
    each chunk streamed from the source chunks through the plan; values go with rank 0."""
    keys = list(ck.tensors)
    source = {k: ck.param_map(k) for k in keys}
    target = {k: fsdp_map(ck.tensors[k].shape, files) for k in keys}
    plans = plan_model(source, target)
    records: list[Record] = []
    specs: dict[str, TensorSpec] = {}
    lock = threading.Lock()

    layout = {k: target_chunks(ck.tensors[k].shape, files) for k in keys}
    for k in keys:
        specs[k] = TensorSpec(ck.tensors[k].dtype, ck.tensors[k].shape, tuple(layout[k].values()))

    def one(r: int) -> None:
        rel = f"__{r}_0.distcp"
        with staging.open(rel) as out:
            f = DcpFile(out, rel)
            for k in keys:
                if r not in layout[k]:
                    continue
                e, p = ck.tensors[k], plans.params[k]
                offsets, sizes = layout[k][r]
                parts = [(0, s, partial(flat_shard, ck, k, s.src_rank)) for s in p.segments if s.dst_rank == r]
                f.tensor(k, offsets, e.dtype, sizes, WindowFill(parts))
            if r == 0:
                for key in ck.objects:
                    f.value(key, ck.object(key))
        with lock:
            records.extend(f.records)

    sizes = [sum(prod(p.target_shards.get(r, (0,))) for p in plans.params.values()) for r in range(files)]
    run_shares(cluster, staging, [(sizes[r] + 1, partial(one, r)) for r in range(files)], workers)
    write_metadata(cluster, staging, records, specs if cluster.rank == 0 else {}, list(ck.objects) if cluster.rank == 0 else [])


def reshard_dcp_files(ckpt_dir: str | Path, out_dir: str | Path, *, files: int, workers: int = 1,
                      overwrite: bool = False, checksum: str = "crc32", cluster: Cluster | None = None) -> ConvertReport:
    """``reshard reshard DCP_DIR OUT --files N``."""
    if files < 1:
        raise ReshardError(f"--files must be at least 1, got {files}")
    ck = DcpCheckpoint.open(ckpt_dir)
    cluster = cluster or Cluster.from_env()
    staging = open_staging(cluster, out_dir, ck.path.name, sources=(Path(ckpt_dir), ck.path), overwrite=overwrite,
                           checksum=checksum)
    reshard_dcp(ck, cluster, staging, files=files, workers=workers)
    return finish_report(cluster, staging, DcpTensors(ck), "dcp", None, {"files": files})
