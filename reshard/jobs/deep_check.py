"""The deep check (``--verify deep``, ``reshard verify SRC``): module weights against the masters
they were cast from, where a checkpoint holds both.

A ZeRO-1/2 checkpoint keeps every parameter twice: the training-dtype module weights of each
model-parallel rank (``mp_rank_MM_model_states.pt``, or a pipeline's layer files) and the fp32
masters, cut into the DP ranks' flat partitions. After each optimizer step DeepSpeed copies the
updated masters into the module weights (``copy_``: a cast, round to nearest even), so at a save
the two agree bit for bit. Files record no DP rank of their own, so two same-sized optimizer
files swapped, or a stale one from another step, read as a valid checkpoint; only the data can
tell. Here every parameter's masters are planned into its module layout (the same planner and
window fill as the engine's, each TP rank's copy from its own TP rank's masters), cast to the
training dtype and compared with the module weights, window by window (bounded memory).

It reads the module weights and the masters once more: about the bytes of both (a quarter and a
half of an fp32 ZeRO checkpoint's; more of a bf16 one's share). Sources without both states
(ZeRO-3, universal, DCP, safetensors) have nothing to compare: the check says so."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from functools import partial

import torch

from ..errors import CheckpointError, ReshardError, in_context
from ..execute.bands import Banded, window
from ..execute.local import WindowFill
from ..formats.contract import Reader
from ..formats.deepspeed.reader import DeepSpeedNative
from ..plan.planner import DefaultCost, Planner
from ..storage import verified

__all__ = ["DeepCheck", "deep_check"]

_WINDOW = 4 << 20  # elements compared at a time


@dataclass(frozen=True, slots=True)
class DeepCheck:
    """What the deep check compared: parameters and elements, and how long it took."""

    params: int
    elements: int
    seconds: float

    def __str__(self) -> str:
        if not self.params:
            return "deep check: the source holds no module weights beside fp32 masters (nothing to compare)"
        return (f"deep check: {self.params} parameters' module weights match their fp32 masters cast to the training "
                f"dtype ({self.elements:,} elements, {self.seconds:.2f} s)")


def deep_check(reader: Reader) -> DeepCheck:
    """Compare every parameter's module weights with its masters cast to their dtype; raise a
    :class:`CheckpointError` naming the parameter, the rank and the files at the first difference."""
    t0 = time.perf_counter()
    planner = Planner()
    params = elements = 0
    for name in reader.names:
        states = reader.states(name)
        if "weight" not in states or "fp32" not in states:
            continue
        elements += _compare(reader, planner, name)
        params += 1
    verified.finish()  # the bytes compared are checked before anything is said of them
    return DeepCheck(params, elements, time.perf_counter() - t0)


def _compare(reader: Reader, planner: Planner, name: str) -> int:
    module_map, master_map = reader.map(name, "weight"), reader.map(name, "fp32")
    tp = partial(reader.tp_index, name)
    cost = DefaultCost(prefer=lambda holder, dst: tp("fp32", holder) == tp("weight", dst), local=False)
    try:
        plan = planner.plan(master_map, module_map, cost=cost)
    except ReshardError as e:
        raise in_context(e, f"parameter {name!r}: its masters and module weights do not describe one tensor") from None
    by_rank = defaultdict(list)
    for seg in plan.segments:
        by_rank[seg.dst_rank].append(seg)
    dtype, done = reader.dtype(name, "weight"), 0
    for rank in module_map.ranks:
        module: torch.Tensor | Banded | None = reader.banded(name, "weight", rank)  # a decoded weight, in bands
        if module is None:
            module = reader.fragment(name, "weight", rank)
            verified.touch(module, f"{name} (weight, rank {rank})")
        fill = WindowFill([(0, s, partial(_master, reader, name, s.src_rank)) for s in by_rank.get(rank, [])])
        n = module.numel if isinstance(module, Banded) else module.numel()
        for start in range(0, n, _WINDOW):
            count = min(_WINDOW, n - start)
            cast = torch.empty(count, dtype=dtype)
            fill(cast, start)
            got = window(module, start, count)
            if not torch.equal(cast.view(_bits(dtype)), got.reshape(-1).view(_bits(dtype))):
                raise _differ(reader, name, rank, start, cast, got)
        done += n
    return done


def _master(reader: Reader, name: str, rank: int) -> torch.Tensor:
    t = reader.fragment(name, "fp32", rank)
    verified.touch(t, f"{name} (fp32, rank {rank})")
    return t


def _bits(dtype: torch.dtype) -> torch.dtype:
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]


def _differ(reader: Reader, name: str, rank: int, start: int, cast: torch.Tensor, got: torch.Tensor) -> CheckpointError:
    diff = (cast.float() - got.float()).abs()
    where = int(torch.nonzero(diff != 0 if diff.any() else cast.view(_bits(cast.dtype)) != got.view(_bits(cast.dtype)))
                [0, 0])
    files = _files(reader, name, rank)
    return CheckpointError(
        f"{files}: parameter {name!r} (model-parallel rank {rank}): its module weights differ from its fp32 masters cast "
        f"to {cast.dtype} (first at element {start + where}, by up to {float(diff.max()):g}): the optimizer files are "
        "swapped, stale or from another run than the model states")


def _files(reader: Reader, name: str, rank: int) -> str:
    """The files that hold ``name``'s module weights on ``rank`` and its masters, in words."""
    own = reader.native("deepspeed")
    if not isinstance(own, DeepSpeedNative):
        return str(reader.sources[-1])
    ck = own.ck
    model = ck.model_files.get(rank, ck.tag_dir)
    optim = sorted({p.name for (m, _), p in ck.optim_files.items() if m == rank})
    return f"{model} against {', '.join(optim)}"
