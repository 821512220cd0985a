"""A DeepSpeed AutoEP checkpoint saved under ZeRO-3 (TP = PP = 1), as the writer reads it
(issue #12; the files: docs/deepspeed-checkpoints.md §11.1): its optimizer parameter groups, made of
the sub-groups ``param_shapes`` records, which of them hold experts, and each parameter's ``ds_id``.
Under ZeRO-3 every trainable parameter is partitioned on its own: a dense one over all ``W`` DP
ranks, a fused expert parameter of EP rank ``e`` over ``e``'s expert-data-parallel group; the target
at another EP x W is ``target.autoep_zero3_target``."""

from __future__ import annotations

from ...errors import CheckpointError
from . import experts as dse
from . import zero3 as z3
from .checkpoint import DeepSpeedCheckpoint

__all__ = ["AutoEPZero3Partitions"]


def _ds_ids(ck: DeepSpeedCheckpoint, ax: dse.AutoEP, names: list[str]) -> tuple[dict[str, int], bool]:
    """Each parameter's ``ds_id`` in the order :func:`experts.autoep_ds_ids` derives, checked
    against the ``"<first>_<last>"`` ids of the source's flat groups."""
    ids, exact = dse.autoep_ds_ids(list(ck.model_state(0).get("module") or {}), ax, names)
    flats = ck.osd(0, 0)["fp32_flat_groups"]
    for k, sg in enumerate(ck.groups(0)):
        got = str(getattr(flats[k], "ds_id", ""))
        if got != f"{ids[next(iter(sg))]}_{ids[list(sg)[-1]]}":
            exact = False
    return ids, exact


class AutoEPZero3Partitions:
    """A ZeRO-3 AutoEP source's groups, sub-groups and parameter ids, checked."""

    tp = 1

    def __init__(self, ck: DeepSpeedCheckpoint) -> None:
        self.ck, self.ax = ck, ck.experts
        self.template = ck.model_state(0)
        self.cfg = self.template.get("ds_config")
        shapes = ck.groups(0)
        self.group_names = self._groups(shapes)
        # the recorded sub-groups are DeepSpeed's cut: a dense group's over all DP ranks, an expert
        # group's over its EDP group (the rule the target's layout cuts with)
        self.sub_group_size = z3.sub_group_size(self.cfg, str(ck.model_files[0]))
        parts = [self.ax.edp if g in self.expert_groups else ck.dp for g in range(len(self.group_names))]
        z3.check_cut(z3.sub_groups([[(n, shapes[k][n]) for k in lst for n in shapes[k]] for lst in self._lists],
                                   parts, self.sub_group_size), shapes, self.sub_group_size, ck.model_files[0])
        self.names = [n for g in self.group_names for n in g]
        self.shapes = {n: s for sg in shapes for n, s in sg.items()}
        self.bf16 = ck.bf16
        self.states = z3.STATES
        self.ds_ids, self.ds_ids_exact = _ds_ids(ck, self.ax, self.names)
        self.ep_of = {d: e for e in range(self.ax.ep) for d in self.ax.members(e)}

    def _groups(self, subs: list[dict]) -> list[list[str]]:
        """Optimizer parameter groups (names in order) from the sub-groups and param_groups."""
        path = self.ck.optim_files[(0, 0)]
        self._lists = lists = z3.sub_group_lists(self.ck, 0, len(subs))
        groups = [[n for k in lst for n in subs[k]] for lst in lists]
        for g, lst in enumerate(lists):
            kinds = {k in self.ax.groups for k in lst}
            if len(kinds) != 1:
                raise CheckpointError(f"{path}: optimizer group {g} mixes expert and dense sub-groups")
        self.expert_groups = {g for g, lst in enumerate(lists) if lst[0] in self.ax.groups}
        return groups
