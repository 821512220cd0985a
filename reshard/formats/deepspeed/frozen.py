"""Frozen parameters (``requires_grad=False``) of a dense DeepSpeed checkpoint: module weights the
optimizer does not own, hence with no master and no moments.

DeepSpeed 0.19.8 records them by ZeRO stage (``engine._save_checkpoint``; ``save_frozen_param`` is
``zero_optimization_partition_gradients()``):

* ZeRO-1: only as module entries no ``param_shapes`` group lists (``frozen_param_shapes`` and
  ``frozen_param_fragments`` are ``None``);
* ZeRO-2: the module entry, and again ``frozen_param_shapes[name]`` (its shape) and
  ``frozen_param_fragments[name]`` (the whole tensor, the module entry's storage);
* ZeRO-3: a placeholder in the module, the shape in every DP rank's ``frozen_param_shapes`` and in
  each DP rank's ``frozen_param_fragments[name]`` its partition (``param.ds_tensor``): the
  parameter flattened, padded to ``ceil(numel / dp) * dp`` and split evenly, as ZeRO-3 partitions
  every parameter (``layouts.zero3``); ``zero_to_fp32`` concatenates them and drops the padding.

Read here at TP = PP = 1 for the dense kinds (a fixture shows each); frozen parameters of any other
kind are refused by name before any output (no DeepSpeed-written checkpoint shows where they go).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...errors import CheckpointError
from ...ir.param_map import ParamMap
from ...ir.piece import prod
from ...layouts import replicated
from ...layouts.zero import zero3 as zero3_map
from ...layouts.zero import zero3_partition_numel

__all__ = ["Frozen", "read"]


@dataclass(frozen=True, slots=True)
class Frozen:
    """The frozen parameters of a checkpoint: full shapes in module order, and whether each DP
    rank's model-state file holds a ZeRO-3 partition of them (``partitioned``) or the module holds
    them whole."""

    shapes: Mapping[str, tuple[int, ...]]
    dp: int
    partitioned: bool

    def map(self, name: str) -> ParamMap:
        """A frozen parameter's weight map: whole on model-parallel rank 0, or at ZeRO-3 DeepSpeed's
        partition of it over the DP ranks (each shard the rank's elements, its padding left out)."""
        shape = self.shapes[name]
        if self.partitioned:
            return zero3_map(shape, self.dp, shard="fragment")
        return replicated(shape, 1)


NONE = Frozen({}, 1, False)


def _recorded(state: Mapping[str, Any], path: Path) -> dict[str, tuple[int, ...]] | None:
    """``frozen_param_shapes`` as full shapes, zero-element ones left out (an uneven AutoTP split's
    empty shard, which DeepSpeed records there too); ``None`` where the file records none (ZeRO-1)."""
    shapes = state.get("frozen_param_shapes")
    if shapes is None:
        return None
    if not isinstance(shapes, Mapping):
        raise CheckpointError(f"{path}: frozen_param_shapes is a {type(shapes).__name__}, not a name -> shape dict")
    out = {}
    for n, s in shapes.items():
        try:
            shape = tuple(int(x) for x in s)
        except (TypeError, ValueError):
            raise CheckpointError(f"{path}: frozen_param_shapes[{n!r}] is {s!r}, not a shape") from None
        if prod(shape):
            out[str(n)] = shape
    return out


def _unowned(state: Mapping[str, Any], params: set[str]) -> list[str]:
    """Module entries of non-zero size that no optimizer group, ``buffer_names`` or
    ``shared_params`` accounts for: where ZeRO-1 keeps frozen parameters."""
    module = state.get("module") or {}
    known = params | set(state.get("buffer_names") or ()) | set(state.get("shared_params") or {})
    return [k for k, v in module.items()
            if k not in known and not (isinstance(v, torch.Tensor) and v.numel() == 0)]


def read(ck: Any, dense: bool) -> Frozen:
    """The frozen parameters ``ck`` records, checked against each file that records them (module
    entry, ``frozen_param_shapes``, ``frozen_param_fragments``); ``dense``: a ZeRO-1/2/3 checkpoint
    without experts. Refused by name where they cannot be read: another kind, TP > 1 or a pipeline."""
    if ck.zero_stage == 3:
        return _zero3(ck, dense)
    ms = ck.model_state(0)
    path = ck.model_files[0]
    recorded = _recorded(ms, path)
    # an expert kind's ZeRO-1 module entries no group owns are its router aliases (check_module_entries)
    found = _unowned(ms, set(ck.param_shapes[0])) if dense else []
    if not found and not recorded:
        return NONE
    _supported(ck, dense, (found or list(recorded or {}))[0], path)
    module = ms.get("module") or {}
    if recorded is not None:  # ZeRO-2: both records name the same parameters
        extra = [n for n in found if n not in recorded]
        if extra:
            raise CheckpointError(f"{path}: module entry {extra[0]!r} is in no optimizer group, no buffer_names and "
                                  "not in frozen_param_shapes: neither a parameter nor a buffer DeepSpeed records")
        gone = [n for n in recorded if not isinstance(module.get(n), torch.Tensor)]
        if gone:
            raise CheckpointError(f"{path}: frozen_param_shapes names {gone[0]!r}, which the module does not hold")
    shapes: dict[str, tuple[int, ...]] = OrderedDict()
    for n in (k for k in module if k in set(found) | set(recorded or {})):  # module order
        w = module[n]
        if not isinstance(w, torch.Tensor):
            raise CheckpointError(f"{path}: module entry {n!r} (a frozen parameter) is a {type(w).__name__}")
        if w.dtype != ck.module_dtype:  # what the reader offers as the weight state: the training dtype
            raise CheckpointError(f"{path}: frozen parameter {n!r} is {w.dtype}, the other weights "
                                  f"{ck.module_dtype}: mixed training dtypes are not supported")
        shapes[n] = tuple(w.shape)
        if recorded is not None:
            _check_zero2(path, ms, n, w, recorded[n])
    return Frozen(shapes, ck.dp, False)


def _check_zero2(path: Path, ms: Mapping[str, Any], n: str, w: torch.Tensor, shape: tuple[int, ...]) -> None:
    """ZeRO-2's three records of one frozen parameter agree: module entry, shape, whole fragment."""
    if tuple(w.shape) != shape:
        raise CheckpointError(f"{path}: frozen parameter {n!r} has shape {list(shape)} in frozen_param_shapes, "
                              f"its module entry {list(w.shape)}")
    frag = (ms.get("frozen_param_fragments") or {}).get(n)
    if not isinstance(frag, torch.Tensor):
        raise CheckpointError(f"{path}: frozen_param_fragments has no tensor for frozen parameter {n!r}")
    if frag.numel() != prod(shape) or frag.dtype != w.dtype:
        raise CheckpointError(f"{path}: frozen_param_fragments[{n!r}] is a {frag.dtype} tensor of {frag.numel()} "
                              f"elements; its shape {list(shape)} holds {prod(shape)} ({w.dtype})")
    same = frag.untyped_storage().data_ptr() == w.untyped_storage().data_ptr() and \
        frag.storage_offset() == w.storage_offset()
    if not same and not torch.equal(frag.reshape(shape), w):  # DeepSpeed saves one storage for both
        raise CheckpointError(f"{path}: frozen_param_fragments[{n!r}] differs from its module entry: which one "
                              "holds the weight cannot be told")


def _zero3(ck: Any, dense: bool) -> Frozen:
    """ZeRO-3: every DP rank's file records the same shapes and holds its partition of each."""
    files = [ck.z3_model_files[(0, d)] for d in range(ck.dp)] if ck.z3_model_files else [ck.model_files[0]]
    states = [ck.model_state(0) if d == 0 else ck.model_state_at(f) for d, f in enumerate(files)]
    recorded = _recorded(states[0], files[0])
    if not recorded:
        return NONE
    _supported(ck, dense, next(iter(recorded)), files[0])
    module = states[0].get("module") or {}
    for f, ms in zip(files, states):
        if _recorded(ms, f) != recorded:
            raise CheckpointError(f"{f}: frozen_param_shapes differ from DP rank 0's ({files[0].name})")
    for n, shape in recorded.items():
        if n not in module:
            raise CheckpointError(f"{files[0]}: frozen_param_shapes names {n!r}, which the module does not hold")
        part = zero3_partition_numel(prod(shape), ck.dp)
        for d, (f, ms) in enumerate(zip(files, states)):
            frag = (ms.get("frozen_param_fragments") or {}).get(n)
            if not isinstance(frag, torch.Tensor):
                raise CheckpointError(f"{f}: frozen_param_fragments has no tensor for frozen parameter {n!r}")
            if frag.dim() != 1 or frag.numel() != part or frag.dtype != ck.module_dtype:
                raise CheckpointError(f"{f}: frozen_param_fragments[{n!r}] (DP rank {d}) is a {frag.dtype} tensor "
                                      f"of shape {list(frag.shape)}; DeepSpeed's ZeRO-3 partition of {list(shape)} "
                                      f"over DP={ck.dp} is 1-D of {part} ({ck.module_dtype})")
    order = [n for n in module if n in recorded] + [n for n in recorded if n not in module]
    return Frozen(OrderedDict((n, recorded[n]) for n in order), ck.dp, True)


def _supported(ck: Any, dense: bool, name: str, path: Path) -> None:
    if not dense or ck.tp > 1 or ck.pipe:
        what = "a pipeline" if ck.pipe else f"TP={ck.tp}" if ck.tp > 1 else "an expert-parallel"
        raise CheckpointError(f"{path}: frozen parameter {name!r} in {what} checkpoint: not supported (frozen "
                              "parameters are read from dense ZeRO-1/2/3 checkpoints at TP = PP = 1)")


def fragment(ck: Any, frozen: Frozen, name: str, rank: int) -> torch.Tensor:
    """Rank ``rank``'s shard of a frozen parameter, flat: the module entry, or at ZeRO-3 DP rank
    ``rank``'s partition."""
    if frozen.partitioned:
        path = ck.z3_model_files[(0, rank)] if ck.z3_model_files else ck.model_files[0]
        state = ck.model_state(0) if rank == 0 else ck.model_state_at(path)
        n = frozen.map(name).shard(rank).numel
        return state["frozen_param_fragments"][name].detach().reshape(-1)[:n]
    return ck.model_state(0)["module"][name].detach().reshape(-1)
