"""The contract between the formats and the engine (docs/spec.md §9).

A **reader** opens a source checkpoint: it lowers its files to one map per parameter state and
says where each rank's shard of it lies (:meth:`Reader.fragment`), and it checks everything it
reads before the engine opens an output folder. A **writer** lays out a target checkpoint's
files: each file's tensors are **buffers**, flat runs of elements, and each buffer is a list of
**slots**, one target shard of one parameter state at an offset. A writer declares its buffers
once (:meth:`Writer.buffers`), when it is made; the engine (``reshard.jobs.engine``) derives from
that one declaration what it plans (:func:`targets_of`), plans every slot's target map against the
reader's map of the state it is made from and checks replicated copies, all before any output
folder exists, and then fills the declared buffers from the source fragments, window by window,
as the writer's jobs (:meth:`Writer.jobs`) ask for them. Neither a reader nor a writer plans; a new
format is one reader and one writer.

A parameter's **states** are its training-dtype weights (``weight``), its fp32 master (``fp32``)
and Adam's moments. A slot names the states it may be made from, in order of preference
(``want``): a bf16 module buffer takes ``weight`` and else casts ``fp32``; a universal file the
reverse; a moment only itself, and a writer that needs one the source lacks fills zeros, as a
fresh optimizer holds.

Every entry a source holds is accounted for (docs/spec.md §11, ``jobs.accounted``): a parameter
state the reader lowers, or an entry it lists as **held** (:meth:`Reader.unlowered`), which the
writer carries as it is (:meth:`Writer.carries`) or the job reports as **not carried** (a state
the target has no place for) or refuses unless the user **dropped** it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..execute.bands import Banded
from ..ir.param_map import ParamMap

__all__ = ["BEST", "HELD", "MODULE", "MOMENTS", "OPTIMIZER", "SCALE_POWER", "STATES", "Buffer", "ExpertLayer", "Held",
           "Reader", "Slot", "Stored",
           "Target", "Writer", "targets_of"]

STATES = ("weight", "fp32", "exp_avg", "exp_avg_sq")
MOMENTS = ("exp_avg", "exp_avg_sq")
OPTIMIZER = ("fp32", "exp_avg", "exp_avg_sq")
# how a piece's scale applies to each state: Adam's moments of a pre-divided bias undo it
SCALE_POWER = {"weight": 1, "fp32": 1, "exp_avg": -1, "exp_avg_sq": -2}
BEST = ("fp32", "weight")  # the most precise weights a source holds
MODULE = ("weight", "fp32")  # the training dtype's weights, else the masters cast to it
# what a held entry is: model weights (a parameter or buffer the model computes with: never lost
# unless the user drops it) or a run's state beside the model (extra_state, RNG, a scheduler)
HELD = ("weights", "state")


@dataclass(frozen=True, slots=True, eq=False)
class Slot:
    """Target rank ``rank``'s shard of ``map`` (parameter ``name``), made from the first state
    in ``want`` the source holds, at element ``offset`` of a buffer."""

    offset: int
    name: str
    want: tuple[str, ...]
    map: ParamMap
    rank: int


@dataclass(frozen=True, slots=True, eq=False)
class Buffer:
    """``numel`` elements of ``dtype`` in an output file, made of ``slots``; elements no slot
    covers (padding) are zero. ``key`` names it uniquely in the job (its file and place)."""

    key: str
    dtype: torch.dtype
    numel: int
    slots: tuple[Slot, ...]


@dataclass(frozen=True, slots=True)
class Target:
    """One (parameter, ``want``, map) the slots of a writer's buffers take: what the engine plans
    before any output folder exists. Never declared by a writer: derived from its buffers
    (:func:`targets_of`)."""

    name: str
    want: tuple[str, ...]
    map: ParamMap


def targets_of(buffers: Iterable[Buffer]) -> list[Target]:
    """The distinct (parameter, ``want``, map) the slots of ``buffers`` take, in the order they first
    appear (a map is the same target only as the same object, as the engine plans it)."""
    seen: dict[tuple[str, tuple[str, ...], int], Target] = {}
    for b in buffers:
        for s in b.slots:
            key = (s.name, s.want, id(s.map))
            if key not in seen:
                seen[key] = Target(s.name, s.want, s.map)
    return list(seen.values())


@dataclass(frozen=True, slots=True)
class Stored:
    """A parameter its source stores quantized (docs/spec.md §7.4): the payload and scale tensors as
    stored (not decoded), what a quantized target holding the same encoding copies byte for byte
    instead of decoding and re-encoding. FP8 block scales: payload ``X.weight`` (the parameter's
    name, its shape) and ``X.weight_scale_inv``; MXFP4 (``kind="mxfp4"``): ``X_blocks`` and
    ``X_scales``, whose shapes are not the parameter's. A tensor's name is the parameter's with
    its suffix."""

    payload_dtype: torch.dtype  # float8_e4m3fn or float8_e5m2; MXFP4: uint8
    block: tuple[int, int]  # rows, cols per scale (MXFP4: 1 x 32 values along the input dim)
    scale_fmt: str  # "float32" or "ue8m0" (ir.codec.SCALE_FORMATS), whatever dtype holds the scales
    payload: Callable[[], torch.Tensor]  # the payload tensor as stored (FP8: the weight's shape)
    scales: Callable[[], torch.Tensor]  # the scales as stored (their dtype: float32, E8M0 or its byte)
    kind: str = "fp8"  # "fp8" | "mxfp4"
    payload_suffix: str = ""  # the payload tensor's name: the parameter's with this suffix
    scales_suffix: str = "_scale_inv"  # the scales tensor's name: the parameter's with this suffix
    quantization_config: Any = None  # the source's quantization_config (what a kept copy is read back by)


@dataclass(frozen=True, slots=True, eq=False)
class ExpertLayer:
    """An MoE layer whose experts the source holds fused: each of ``params`` is ``[num_experts,
    ...]``, every expert whole, in expert order (docs/spec.md §7.1). What an expert-parallel target
    places at its own EP degree. ``record``: the layer's entry as the framework that saved the
    source records it (DeepSpeed AutoEP's ``ds_autoep_layers`` entry), which a target of that
    framework rewrites at its placement; ``{}`` where there is none. ``apart``: the source holds
    each expert's tensors apart instead (the Hugging Face Hub's per-expert layout): each of
    ``params`` is then a name with ``{expert}`` in it, one tensor per expert ``0 .. num_experts-1``."""

    layer: int  # the MoE layer's index among the model's MoE layers
    module_path: str  # the module holding the layer's experts and router
    num_experts: int
    params: tuple[str, ...]
    record: Any
    apart: bool = False


@dataclass(frozen=True, slots=True)
class Held:
    """An entry of the source the reader holds but does not lower to a parameter state: ``key``
    as the source names it, in ``file``; ``what`` one of :data:`HELD`; ``reason`` why it is not
    lowered, in words (the report's and the manifest's)."""

    key: str
    file: str
    what: str
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"key": self.key, "file": self.file, "what": self.what, "reason": self.reason}


class Reader(ABC):
    """A source checkpoint, lowered. ``names`` are parameters in the source's order.

    This class is the whole of what a writer, a job or ``present/`` may ask of a source: a need
    beyond it is a new method here (with a default every format can live with), never a probe of
    one format's attributes. A writer never changes the reader it is given."""

    format: str  # "deepspeed", "universal", "dcp", "safetensors", "megatron"
    tag: str  # the name its target's folder takes (a DeepSpeed tag, a DCP folder's name)
    sources: tuple[Path, ...]  # every path it reads, which no output may touch
    description: str  # in words, for reports
    topology: dict[str, int]  # {"tp": .., "dp": .., ...}; {} where the format has none
    names: Sequence[str]

    @abstractmethod
    def shape(self, name: str) -> tuple[int, ...]: ...  # F's valid shape
    @abstractmethod
    def states(self, name: str) -> tuple[str, ...]: ...  # the STATES it holds, in STATES order
    @abstractmethod
    def dtype(self, name: str, state: str) -> torch.dtype: ...
    @abstractmethod
    def map(self, name: str, state: str) -> ParamMap: ...  # one object for states laid out alike
    @abstractmethod
    def fragment(self, name: str, state: str, rank: int) -> torch.Tensor: ...  # rank's shard, flat
    @abstractmethod
    def tp_index(self, name: str, state: str, rank: int) -> int | None: ...  # the TP rank a rank's copy is
    @abstractmethod
    def step(self, name: str) -> Any: ...  # Adam's step, or None
    @abstractmethod
    def param_groups(self) -> list[dict[str, Any]]: ...  # hyper-parameters; "params": names
    @abstractmethod
    def extras(self, name: str) -> dict[str, Any]: ...  # keys a universal file keeps beside F

    # -- with defaults: what some sources know and others do not ---------------------------------
    def check(self) -> None:
        """Refuse the source (a ``ReshardError``) for anything wrong in what it read; run once,
        before any output folder exists. By default: nothing beyond what opening it checked."""
        return None

    def model_order(self) -> list[str] | None:
        """The model's parameter order (what a flat ZeRO buffer follows); ``None`` where the
        source cannot tell it. By default the source's own order."""
        return list(self.names)

    def tied(self) -> dict[str, str]:
        """Aliases the model holds beside their weight but the source does not: ``{alias: weight}``."""
        return {}

    def buffers(self) -> tuple[str, ...]:
        """The module buffers the source holds (tensors the model computes with but does not train:
        DeepSpeed's ``buffer_names``, a router's ``e_score_correction_bias``), in the source's order,
        where it can tell them from parameters. Those among :attr:`names` are lowered (a weight with
        no optimizer state, in no optimizer group: a target that writes a module places them there,
        outside its optimizer's groups); the others are held (:meth:`unlowered`). By default none."""
        return ()

    def frozen(self) -> tuple[str, ...]:
        """The frozen parameters among :attr:`names` (``requires_grad=False`` in the job that saved
        the source: DeepSpeed's ``frozen_param_shapes``, a ZeRO-1 module entry no optimizer group
        owns), in the source's order, where it can tell them from buffers: model weights with no
        optimizer state, which a target writes as weights (never as buffers, never with a master or
        moments). By default none."""
        return ()

    def hf_config(self) -> dict[str, Any] | None:
        """A transformers ``config.json`` for the model, where the source records its architecture."""
        return None

    def grad_clip(self) -> float | None:
        """The gradient-clipping norm the source's optimizer state records (DeepSpeed's ``clip_grad``,
        which its loader restores from the files), where it records one; else ``None``."""
        return None

    def expert_layers(self) -> tuple[ExpertLayer, ...]:
        """The MoE layers whose experts the source holds fused and records as such (an expert-parallel
        target's placement needs them), in layer order; by default none."""
        return ()

    def banded(self, name: str, state: str, rank: int) -> Banded | None:
        """Rank ``rank``'s fragment computed a band of rows at a time (docs/spec.md §1), where the source
        computes it rather than storing it (a quantized weight decoded on the way): what the engine
        fills from, and the deep check and ``reshard verify`` read (``execute.bands.window``), so that
        their memory follows a band, not the tensor's width. Every element equals
        :meth:`fragment`'s; the reader checks (``storage.verified``) what its bands read. By default
        ``None``: :meth:`fragment` is read."""
        return None

    def check_fragment(self, name: str, state: str, rank: int) -> None:
        """Refuse (a ``ReshardError`` naming the tensor) what a read of rank ``rank``'s fragment would
        find wrong, from what is cheap to read again (a quantized weight's scales, not its payload).
        A lazy source (``execute.lazy``) reads fragments long after :meth:`check` ran, so it asks this
        of every fragment it will read before a push moves anything. By default nothing."""
        return None

    def stored(self, name: str) -> Stored | None:
        """Parameter ``name`` as stored where the source holds it quantized (FP8 block scales, MXFP4),
        else ``None``. Its ``weight`` state is still the decoded value; this is the encoding beside it."""
        return None
    def unlowered(self) -> list[Held]:
        """Every entry the source holds beside the parameter states it lowers (buffers, a run's
        state, tensors it has no parameter for), each once; by default none. Computed after
        :meth:`check`, before any output folder exists."""
        return []

    def labels(self) -> str:
        """What the keys of its maps name, in words: ``"rank"`` (the saving process whose files hold
        the shard) by default; a format whose shards are named otherwise says so (Megatron: ``"rank
        label"``, one per run that lies contiguous in its files, docs/spec.md §7.3)."""
        return "rank"

    def world(self) -> int | None:
        """How many processes saved the source, where it records that; else ``None``."""
        return None

    def saver(self, name: str, state: str, rank: int) -> int | None:
        """Where the maps' keys are not saving ranks (:meth:`labels`): the storage rank whose files
        hold shard ``rank`` of ``name``'s ``state`` map, where the source tells; else ``None``. A
        weight sync reads each shard on the live rank of its storage rank (``reader_sources``)."""
        return None

    def native(self, fmt: str) -> object | None:
        """The format's own objects behind this source where it is in format ``fmt`` (its files, its
        templates: what a target of a related format copies as it is), else ``None``. The caller
        narrows the result with ``isinstance``: only code that knows format ``fmt`` asks for it."""
        return None


class ReaderView(Reader):
    """A source seen through another reader ``inner`` (renamed, narrowed, joined): its identity,
    checks and source-wide facts (config, clipping, labels, world) are ``inner``'s; no target
    copies the source's own files under the view's names (``native``: none). A view overrides
    what it changes and answers every per-name question itself."""

    def __init__(self, inner: Reader) -> None:
        self.inner = inner
        self.format, self.tag, self.sources = inner.format, inner.tag, inner.sources
        self.description, self.topology = inner.description, inner.topology

    def check(self) -> None:
        self.inner.check()

    def hf_config(self) -> dict[str, Any] | None:
        return self.inner.hf_config()

    def grad_clip(self) -> float | None:
        return self.inner.grad_clip()

    def labels(self) -> str:
        return self.inner.labels()

    def world(self) -> int | None:
        return self.inner.world()

    def native(self, fmt: str) -> object | None:
        return None


class Writer(ABC):
    """A target checkpoint's layout, computed (and refused where impossible) when it is made,
    before any output folder exists. A writer takes a :class:`Reader` and asks it only what the
    contract declares; it never changes it."""

    format: str
    tag: str | None  # the folder the target is committed as; None writes the output folder itself
    latest: str | None  # the pointer file a commit writes beside the tag folder
    keeps_replicas: bool  # each target rank keeps its own copy of a replicated block (same TP)
    extra_sources: tuple[Path, ...] = ()  # paths beside the source it reads (a --layout checkpoint)

    @abstractmethod
    def buffers(self) -> list[Buffer]:
        """Every buffer the target's files hold, each a list of slots: what the writer fills,
        declared once, when it is made. The engine plans what the slots take (:func:`targets_of`)
        and checks the replicas they read before any output folder exists; :meth:`jobs` then fills
        exactly these buffers (the same objects: the engine refuses any other), each of them."""

    @abstractmethod
    def jobs(self, engine: Any, staging: Any) -> list[Any]:
        """How and where the declared buffers are written: ``(bytes, job)`` or
        ``storage.staging.ArchiveJob``, each filling declared buffers (never building new ones)."""
    @abstractmethod
    def meta(self) -> dict[str, Any]: ...  # what the manifest records of the target
    @abstractmethod
    def notes(self) -> list[str]: ...  # the report's words on what the target holds

    def copied(self) -> list[str]:
        """Parameters the target writes as the source stores them (:meth:`Reader.stored`), payload
        and scales byte for byte, from no buffer: written, so accounted for, but neither planned
        nor filled. By default none."""
        return []

    def tp_index(self, rank: int) -> int:
        """The TP rank target rank ``rank`` is, where ``keeps_replicas`` (its copy of a replicated
        block is that TP rank's)."""
        return 0

    def finish(self, staging: Any, gather: Callable[[Any], list[Any]], rank: int) -> None:
        """Run on every process once each wrote its files (DCP's ``.metadata``); by default nothing."""
        return None

    def carries(self, held: Held) -> bool:
        """Whether the target writes held entry ``held`` as the source holds it (a DeepSpeed
        target of a DeepSpeed source copies its buffers and client state); by default not: the
        target has no place for it."""
        return False

    def unplaced(self, name: str) -> str | None:
        """Why the target has no place for source parameter ``name`` where it can say more than
        that it does not fill it (the report's and a refusal's reason); by default nothing."""
        return None

    def view(self, reader: Reader) -> Reader:
        """The source as this target reads it, planned and filled by the engine: by default the
        reader itself; a target may narrow it without changing it (Megatron's padded vocabulary,
        cut to the target's rows)."""
        return reader
