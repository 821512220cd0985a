"""A DeepSpeed ZeRO-1/2 checkpoint as ``reshard reshard`` reads it: its parameter groups per
model-parallel rank, checked against DeepSpeed 0.19.8's flat-buffer rule (``deepspeed_writer``)
before anything is written, and each parameter's model-parallel map (a TP map, or for a
``deepspeed.pipe`` checkpoint a stage map: its TP map on its stage's model-parallel ranks
``stage * tp + t``, nothing on the other stages').
"""

from __future__ import annotations

from collections import OrderedDict

from ...errors import CheckpointError
from ...ir.param_map import ParamMap
from ...ir.piece import prod
from ...layouts.topology import Topology
from . import writer as dsw
from .checkpoint import DeepSpeedCheckpoint

__all__ = ["Zero12Source"]


class Zero12Source:
    """What the source checkpoint says about its ZeRO-1/2 groups, checked against DeepSpeed's
    layout rule."""

    def __init__(self, ck: DeepSpeedCheckpoint) -> None:
        self.ck = ck
        # A pipeline checkpoint has TP model-parallel ranks per stage; each parameter's TP map
        # sits on its stage's ranks, which the "stage map" below states. Everything else treats
        # model-parallel ranks alike, whether they are TP ranks, stages or both.
        self.pipe = bool(ck.layer_files) or ck.pp > 1
        self.mp = ck.mp
        self.topology = Topology(1, ck.dp, self.mp)  # global rank = dp_rank * mp + mp_rank
        ms0 = ck.model_state(0)
        for key in ("num_experts", "ds_autoep_layers"):
            if ms0.get(key):
                raise CheckpointError(f"{ck.model_files[0]}: mixture-of-experts checkpoints are not supported")
        groups = []
        for t in range(self.mp):
            g = ck.model_state(t).get("param_shapes")
            g = g if isinstance(g, list) else [g]
            groups.append([OrderedDict((n, tuple(s)) for n, s in grp.items()) for grp in g])
        if len({len(g) for g in groups}) != 1:
            raise CheckpointError(f"{ck.tag_dir}: model-parallel ranks record different numbers of parameter groups")
        self.groups = groups  # [tp][group] -> {name: shard shape}
        self.n_groups = len(groups[0])
        self.group_of: dict[str, int] = {}
        self.order: list[list[str]] = []
        for g in range(self.n_groups):
            names = list(dict.fromkeys(n for t in range(self.mp) for n in groups[t][g]))
            for n in names:
                if n in self.group_of:
                    raise CheckpointError(f"{ck.tag_dir}: {n!r} is in parameter groups {self.group_of[n]} and {g}")
                self.group_of[n] = g
            self.order.append(names)
        self.names = [n for grp in self.order for n in grp]
        cfg = ms0.get("ds_config") or {}
        zo = cfg.get("zero_optimization") or {}
        if zo.get("round_robin_gradients"):
            raise CheckpointError(f"{ck.tag_dir}: ZeRO round_robin_gradients reorders the flat buffer by DP size; "
                                  "not supported")
        if zo.get("elastic_checkpoint"):
            raise CheckpointError(f"{ck.tag_dir}: elastic ZeRO checkpoints are not supported")
        if self.pipe:  # layer files against param_shapes, before anything reads a weight
            ck.check_layer_files()
        first = next((w for n in self.names if (w := ck.module_tensor(n, 0)) is not None), None)
        if first is None:
            raise CheckpointError(f"{ck.model_files[0]}: the module state holds none of the optimized parameters")
        self.dtype = first.dtype
        self.param_alignment_enabled = bool(zo.get("parameter_alignment", False))
        self.param_align = dsw.param_alignment(self.dtype, self.param_alignment_enabled)
        self.bf16 = any(p.name.startswith("bf16_") for p in ck.optim_files.values())
        self._check_groups()
        self._check_rest(ms0)
        self.maps = {n: self.stage_map(n) if self.pipe else ck.tp_map(n).map for n in self.names}

    def stage_map(self, name: str) -> ParamMap:
        """``name``'s TP map on its stage's model-parallel ranks ``stage * tp + t``."""
        ck = self.ck
        base = ck.stage_of(name) * ck.tp
        return ck.tp_map(name).map.with_ranks({t: base + t for t in range(ck.tp)})

    def _check_groups(self) -> None:
        ck = self.ck
        for t in range(self.mp):
            osds = [ck.osd(t, d) for d in range(ck.dp)]
            for d, osd in enumerate(osds):
                base = osd.get("base_optimizer_state")
                if not isinstance(base, dict) or "state" not in base:
                    raise CheckpointError(f"{ck.optim_files[(t, d)]}: base_optimizer_state is not a torch optimizer "
                                          "state_dict (elastic checkpoint?); not supported")
                if len(osd["param_slice_mappings"]) != self.n_groups:
                    raise CheckpointError(f"{ck.optim_files[(t, d)]}: {len(osd['param_slice_mappings'])} groups, "
                                          f"the model states record {self.n_groups}")
            for g in range(self.n_groups):
                names, shapes = list(self.groups[t][g]), list(self.groups[t][g].values())
                group = dsw.flat_group(names, shapes, ck.dp, param_align=self.param_align)
                dsw.check_source_group(group, osds, g, f"{ck.tag_dir} (tp rank {t})")
                for d in range(ck.dp):
                    lean = ck.osd(t, d)["single_partition_of_fp32_groups"][g].numel()
                    want = group.partition - group.tail_padding(d)
                    if lean != want:
                        raise CheckpointError(f"{ck.optim_files[(t, d)]}: group {g} fp32 partition has {lean} elements, "
                                              f"the layout implies {want}: truncated or not a DeepSpeed 0.19.8 file")

    def _check_rest(self, ms0: dict) -> None:
        ck = self.ck
        for t in range(self.mp):
            frozen = ck.model_state(t).get("frozen_param_shapes") or {}
            real = [n for n, s in frozen.items() if prod(tuple(s))]
            if real:
                raise CheckpointError(f"{ck.model_files[t]}: frozen (non-optimized) parameters such as {real[0]!r} "
                                      "are not supported")
        self.shared = dict(ms0.get("shared_params") or {})
        buffers = set(ms0.get("buffer_names") or [])
        if self.pipe and any(ck.model_state(t).get(k) for t in range(self.mp) for k in ("buffer_names", "shared_params")):
            raise CheckpointError(f"{ck.tag_dir}: pipeline checkpoints with buffers or tied weights are not supported")
        for t in range(self.mp):
            module = ck.model_state(t).get("module") or {}
            unknown = [k for k in module if k not in self.group_of and k not in buffers and k not in self.shared]
            if unknown:
                raise CheckpointError(f"{ck.model_files[t]}: module entries {unknown[:3]} are neither optimized "
                                      "parameters, buffers nor tied aliases (frozen parameters?): not supported")
        ck.check_steps()

    def start(self, t: int, d: int, name: str) -> int:
        g = self.group_of[name]
        return int(self.ck.osd(t, d)["param_slice_mappings"][g][name].start)

    def composite(self, name: str) -> ParamMap:
        """``name``'s model-parallel map composed with its ZeRO split, over global ranks
        ``dp_rank * mp + mp_rank``."""
        return self.ck.composite_map(name, self.maps[name], stages=True)
