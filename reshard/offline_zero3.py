"""Offline resharding of a DeepSpeed ZeRO-3 checkpoint (TP=1) to another DP size, file to file,
as DeepSpeed 0.19.8 itself would have saved it there (so ``engine.load_checkpoint`` loads it
natively at the new DP size).

ZeRO-3 partitions every parameter on its own, so each parameter is one plan: the source map
``zero3(shape, dp, shard="fragment")`` over the source DP ranks against the same at the target DP
(``reshard.layouts``), planned by ``reshard.planner.Planner``. Each segment is a strided copy from
a memory-mapped source partition (``formats.deepspeed.DeepSpeedCheckpoint.flat_state``) into the
target partition being built; nothing is scaled (TP=1). Every output file is built on its own:
peak memory is one target rank's partitions, and each source byte a file needs is read once for
it. Output is staged and committed atomically (``formats.output.Staging``); ``OUT/latest`` is
written last. The source is checked by ``formats.deepspeed_zero3.Zero3Source`` before anything is
written; the files' dictionaries come from that module.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from . import __version__
from .cluster import Cluster, commit, open_staging, run_share
from .errors import CheckpointError, ReshardError, in_context
from .formats import deepspeed_writer as dsw
from .formats import deepspeed_zero3 as z3
from .formats.deepspeed import DeepSpeedCheckpoint
from .formats.output import Staging
from .formats.pickling import save
from .ir.apply import strided_copy
from .ir.param_map import ParamMap
from .layouts import zero3
from .memory import release
from .planner import Planner
from .reports import ReshardReport
from .workers import run_with_progress


class _Writer:
    def __init__(self, src: z3.Zero3Source, dp: int, staging: Staging) -> None:
        self.src, self.dp, self.staging = src, dp, staging
        self.subs = z3.sub_groups(src.groups, dp, src.sub_group_size)
        self.ds_config = dsw.target_ds_config(src.cfg, tp=1, dp=dp, zero_stage=3)
        self.states = z3.STATES if src.has_moments else ("fp32",)
        self.targets: dict[str, ParamMap] = {}
        self.plans: dict[str, dict[int, list]] = {}
        self.segments = 0
        self.read = 0
        self._lock = threading.Lock()

    def plan_all(self) -> None:
        planner = Planner()  # one source holds each element: nothing to choose between
        for name in self.src.names:
            shape = self.src.shapes[name]
            try:
                target = zero3(shape, self.dp, shard="fragment")
                p = planner.plan(zero3(shape, self.src.dp, shard="fragment"), target)
            except ReshardError as e:
                raise in_context(e, f"parameter {name!r}") from None
            self.targets[name] = target
            by_dst: dict[int, list] = defaultdict(list)
            for s in p.segments:
                by_dst[s.dst_rank].append(s)
            self.plans[name] = by_dst
            self.segments += len(p.segments)

    def optim(self, d: int) -> None:
        """Target DP rank ``d``'s optimizer file: every sub-group's partitions, filled by the
        plans' segments from the source fragments."""
        src = self.src
        fp32, moments, read = [], [], 0
        for sg in self.subs:
            bufs = {s: torch.zeros(sg.numel) for s in self.states}  # each its own storage, as DeepSpeed's
            for name, off in zip(sg.names, sg.offsets):
                tmap = self.targets[name]
                if d not in tmap.shards:  # this rank holds only padding of it
                    continue
                n = tmap.shard(d).numel
                segs = self.plans[name].get(d, [])
                if sum(s.numel for s in segs) != n or any(s.factor != 1.0 for s in segs):
                    raise CheckpointError(f"internal: the plan for {name!r} does not fill dp rank {d}'s "
                                          f"{n} elements")
                for state in self.states:
                    dst = bufs[state].narrow(0, off, n)
                    for s in segs:
                        frag = src.fragment(s.src_rank, name, state)
                        strided_copy(dst, s.dst, frag, s.src, s.shape)
                        release(frag)  # mapped pages: drop them from our resident set
                        read += s.numel
            fp32.append(bufs["fp32"])
            moments.append({m: bufs[m] for m in z3.MOMENTS if m in bufs})
        with self._lock:
            self.read += read
        obj = z3.optim_states(src.ck.optim_state(0, 0), subs=self.subs, dp=self.dp, fp32=fp32,
                              moments=moments if src.has_moments else None, ds_ids=src.ds_ids,
                              ds_config=self.ds_config)
        with self.staging.open(z3.optim_file(d, bf16=src.bf16)) as f:
            save(obj, f)

    def model(self, d: int) -> None:
        obj = z3.model_states(self.src.template, subs=self.subs, d=d, dp=self.dp, ds_config=self.ds_config)
        with self.staging.open(z3.model_file(d)) as f:
            save(obj, f)


def reshard_zero3(ck: DeepSpeedCheckpoint, out_dir: str | Path, *, tp: int, dp: int, pp: int = 1,
                  zero_stage: int | None = None, workers: int = 1, layout: Any = None,
                  overwrite: bool = False, progress: Callable[[int, int], None] | bool | None = None,
                  checksum: str = "crc32", cluster: Cluster | None = None) -> ReshardReport:
    """Write the ZeRO-3 checkpoint ``ck`` into ``out_dir/<tag>`` at DP=``dp`` (TP=1, ZeRO-3),
    plus ``out_dir/latest``. Under
    a launcher (or with ``cluster``) every process writes a share of the files and the commit is
    collective, as for ZeRO-1/2 (``reshard.cluster``)."""
    if tp != 1 or pp != 1:
        raise ReshardError(f"{ck.tag_dir}: a ZeRO-3 checkpoint is resharded over DP only (TP=1, PP=1); "
                           f"got tp={tp}, pp={pp}")
    if zero_stage not in (None, 3):
        raise ReshardError(f"{ck.tag_dir}: a ZeRO-3 checkpoint is written at ZeRO stage 3 only, not "
                           f"{zero_stage!r}; convert to a universal checkpoint with `reshard convert` for "
                           "another stage")
    if layout is not None:
        raise ReshardError("layout= sets a target TP layout; a ZeRO-3 checkpoint keeps TP=1")
    if (Path(out_dir) / ck.tag_dir.name).resolve() == ck.tag_dir.resolve():
        raise ReshardError(f"{ck.tag_dir}: the output would replace the source it is read from; "
                           "choose another output folder")
    src = z3.Zero3Source(ck)
    cluster = cluster or Cluster.from_env()
    staging = open_staging(cluster, out_dir, ck.tag_dir.name, overwrite=overwrite, checksum=checksum)
    writer = _Writer(src, dp, staging)
    part = sum(sg.numel for sg in writer.subs) * 4 * len(writer.states)  # bytes of one optimizer file
    jobs: list[tuple[int, Callable[[], None]]] = [(part, lambda d=d: writer.optim(d)) for d in range(dp)]
    jobs += [(src.ck.model_files[0].stat().st_size, lambda d=d: writer.model(d)) for d in range(dp)]

    def run(mine: list[Callable[[], None]]) -> None:
        writer.plan_all()
        run_with_progress(mine, workers, progress, "file", "reshard reshard")

    run_share(cluster, staging, jobs, run)
    source = {"tp": 1, "dp": ck.dp, "pp": 1, "zero_stage": 3}
    target = {"tp": 1, "dp": dp, "pp": 1, "zero_stage": 3}
    meta = {"reshard_version": __version__, "format": "deepspeed", "source": str(ck.tag_dir),
            "source_topology": source, "target_topology": target, "target_tp_layout": "none (TP=1)"}
    final = commit(cluster, staging, meta, latest_name="latest")
    read = sum(cluster.gather(writer.read))
    files = [p for p in final.rglob("*") if p.is_file()]
    notes = [f"{len(writer.subs)} sub-group(s) per rank (sub_group_size {src.sub_group_size})"]
    if not src.ds_ids_exact:
        notes.append("the source's ds_id names do not number its parameters consecutively; the written ds_id "
                     "attributes are a best guess (DeepSpeed's loader does not read them)")
    return ReshardReport(out_dir=final, source=source, target=target, params=len(src.names), files=len(files),
                  bytes_written=sum(p.stat().st_size for p in files), segments=writer.segments,
                  elements_read=read, notes=notes)
