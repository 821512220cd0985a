"""DeepSpeed ZeRO-3 files at a TP x DP topology (TP=1, or AutoTP at any degree), laid out as
DeepSpeed 0.19.8 saves them, from any source.

Per (TP, DP) rank, every parameter's TP shard is flattened, padded to ``ceil(numel / dp) * dp``
and cut into DP partitions (``zero3(shape, dp, shard="fragment")``); a sub-group's partitions lie
end to end in one flat tensor per state (``zero3.sub_groups``). Each partition is a slot of the
parameter's composite map (its target TP map composed with those splits, over global ranks
``dp_rank * tp + tp_rank``). The model-state files hold placeholders: the fp32 master is what a
ZeRO-3 engine loads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...errors import ReshardError
from ...ir.param_map import ParamMap
from ...ir.piece import prod
from ...layouts import compose_zero, zero3
from ...layouts.topology import Topology
from ...storage.torch_zip import save
from ..contract import MOMENTS, Buffer
from . import zero3 as z3
from . import zero12 as dsw
from .buffers import Declared, partition, partition_buffers
from .templates import Templates, ds_id_notes

__all__ = ["Zero3Target"]


class Zero3Target:
    stage = 3

    def __init__(self, tpl: Templates, maps: dict[str, ParamMap], *, tp: int, dp: int, uc_info: dict | None,
                 where: str) -> None:
        self.tpl, self.maps, self.tp, self.dp, self.uc_info = tpl, maps, tp, dp, uc_info
        self.topology = Topology(1, dp, tp)
        self.shard = {(t, n): tuple(maps[n].shard(t).shape) for t in range(tp) for n in tpl.names}
        empty = next(((t, n) for (t, n), s in self.shard.items() if not prod(s)), None)
        if empty is not None:
            raise ReshardError(f"parameter {empty[1]!r} has no elements on TP rank {empty[0]} at TP={tp}: an uneven "
                               "split is not written with ZeRO-3")
        size = z3.sub_group_size(tpl.cfg, where)
        self.subs = [z3.sub_groups([[(n, self.shard[(t, n)]) for n in g] for g in tpl.group_names], dp, size)
                     for t in range(tp)]
        self.states = ("fp32",) + (MOMENTS if tpl.has_moments or not tpl.native else ())
        self.ds_config = dsw.target_ds_config(tpl.cfg, tp=tp, dp=dp, zero_stage=3)
        self._composites: dict[str, ParamMap] = {}
        self.sub_group_size = size
        self.declared = Declared(self._declare)

    def composite(self, name: str) -> ParamMap:
        m = self._composites.get(name)
        if m is None:
            def zero(t: int) -> ParamMap:
                return zero3(self.shard[(t, name)], self.dp, shard="fragment")

            m = zero(0) if self.tp == 1 else compose_zero(self.maps[name], {t: zero(t) for t in self.maps[name].ranks},
                                                          self.topology)
            self._composites[name] = m
        return m

    def buffers(self) -> list[Buffer]:
        return self.declared.buffers()

    def _declare(self) -> list[Buffer]:
        """Each (TP, DP) rank's optimizer partition of each of its sub-groups."""
        out = []
        for t in range(self.tp):
            for d in range(self.dp):
                rank = self.topology.rank(0, d, t)
                for k, sg in enumerate(self.subs[t]):
                    frags = [(off, n) for n, off in zip(sg.names, sg.offsets) if rank in self.composite(n).shards]
                    out += partition_buffers(self._optim_key(t, d, k), sg.numel, frags, self.composite, rank,
                                             self.states)
        return out

    def _optim_key(self, t: int, d: int, k: int) -> str:
        return f"{z3.optim_file(d, bf16=self.tpl.bf16, t=t)}:{k}"

    def tp_index(self, rank: int) -> int:
        return rank % self.tp

    def optim(self, engine: Any, t: int, d: int) -> dict:
        fp32, moments = [], []
        declared = self.declared.by_key()
        for k, sg in enumerate(self.subs[t]):
            flat, views = partition(engine, declared, self._optim_key(t, d, k), sg.numel, self.states)
            fp32.append(flat)
            moments.append(views)
        return z3.optim_states(self.tpl.optim_z3(), subs=self.subs[t], dp=self.dp, fp32=fp32,
                               moments=moments if len(self.states) > 1 else None, ds_ids=self.tpl.ds_ids,
                               ds_config=self.ds_config)

    def model(self, staging: Any, t: int, d: int) -> None:
        obj = z3.model_states(self.tpl.model_z3(), subs=self.subs[t], d=d, dp=self.dp, ds_config=self.ds_config,
                              t=t, tp=self.tp, uc_info=self.uc_info)
        with staging.open(z3.model_file(d, t)) as f:
            save(obj, f)

    def jobs(self, engine: Any, staging: Any, archive: Callable[..., Any], model_size: int) -> list:
        ranks = [(t, d) for t in range(self.tp) for d in range(self.dp)]
        jobs = [archive(z3.optim_file(d, bf16=self.tpl.bf16, t=t), sum(sg.numel for sg in self.subs[t]) * 4 *
                        len(self.states), lambda t=t, d=d: self.optim(engine, t, d)) for t, d in ranks]
        return jobs + [(model_size, lambda t=t, d=d: self.model(staging, t, d)) for t, d in ranks]

    def notes(self) -> list[str]:
        notes = [f"{len(self.subs[0])} sub-group(s) per rank (sub_group_size {self.sub_group_size})"]
        return notes + ds_id_notes(self.tpl.ds_ids_exact, "do not number its parameters consecutively")

