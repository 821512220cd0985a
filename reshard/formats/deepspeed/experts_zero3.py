"""A DeepSpeed AutoEP checkpoint saved under ZeRO-3 (TP = PP = 1), as the writer reads it
(issue #12; the files: docs/deepspeed-checkpoints.md §11.1): what its files say beyond the
layout (``DeepSpeedCheckpoint.layout``) -- its optimizer parameter groups, made of the sub-groups
``param_shapes`` records, which of them hold experts, and each parameter's ``ds_id``. Under ZeRO-3
every trainable parameter is partitioned on its own: a dense one over all ``W`` DP ranks, a fused
expert parameter of EP rank ``e`` over ``e``'s expert-data-parallel group; the target at another
EP x W is ``target.autoep_zero3_target``."""

from __future__ import annotations

from ...errors import CheckpointError
from . import experts as dse
from . import zero3 as z3
from .checkpoint import DeepSpeedCheckpoint

__all__ = ["autoep", "ds_ids", "optim_groups"]


def autoep(ck: DeepSpeedCheckpoint) -> dse.AutoEP:
    """The source's AutoEP experts (refused where it has none)."""
    if ck.experts is None:
        raise CheckpointError(f"{ck.tag_dir}: not an AutoEP checkpoint")
    return ck.experts


def optim_groups(ck: DeepSpeedCheckpoint) -> tuple[list[list[str]], set[int], int]:
    """The optimizer parameter groups (names in order) from the recorded sub-groups and
    ``param_groups``, which of them hold experts, and ``sub_group_size``; checked: no group mixes
    expert and dense sub-groups, and the recorded sub-groups are DeepSpeed's cut (a dense group's
    over all DP ranks, an expert group's over its EDP group: the rule the target's layout cuts
    with)."""
    ax, shapes = autoep(ck), ck.groups(0)
    path = ck.optim_files[(0, 0)]
    lists = z3.sub_group_lists(ck, 0, len(shapes))
    for g, lst in enumerate(lists):
        if len({k in ax.groups for k in lst}) != 1:
            raise CheckpointError(f"{path}: optimizer group {g} mixes expert and dense sub-groups")
    expert_groups = {g for g, lst in enumerate(lists) if lst[0] in ax.groups}
    size = z3.sub_group_size(ck.model_state(0).get("ds_config"), str(ck.model_files[0]))
    parts = [ax.edp if g in expert_groups else ck.dp for g in range(len(lists))]
    z3.check_cut(z3.sub_groups([[(n, shapes[k][n]) for k in lst for n in shapes[k]] for lst in lists], parts, size),
                 shapes, size, ck.model_files[0])
    return [[n for k in lst for n in shapes[k]] for lst in lists], expert_groups, size


def ds_ids(ck: DeepSpeedCheckpoint, names: list[str]) -> tuple[dict[str, int], bool]:
    """Each parameter's ``ds_id`` in the order :func:`experts.module_ds_ids` derives, checked
    against the ``"<first>_<last>"`` ids of the source's flat groups."""
    ids, exact = dse.module_ds_ids(list(ck.model_state(0).get("module") or {}), autoep(ck), names)
    flats = ck.osd(0, 0)["fp32_flat_groups"]
    for k, sg in enumerate(ck.groups(0)):
        got = str(getattr(flats[k], "ds_id", ""))
        if got != f"{ids[next(iter(sg))]}_{ids[list(sg)[-1]]}":
            exact = False
    return ids, exact
