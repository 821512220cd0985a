"""Every error reshard raises on bad input. All are ``ValueError`` subclasses, so a caller that
only knows "the input was wrong" can catch ``ValueError``; a caller that wants to react to one
kind catches the subclass. Messages name the file, parameter, rank, piece or JSON path at fault.
"""

from __future__ import annotations


class ReshardError(ValueError):
    """Base class of every error reshard raises for bad input."""


class MapFormatError(ReshardError):
    """A map or plan document (JSON / dict) is malformed. The message starts with the JSON path."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path or '<root>'}: {reason}")


class MapError(ReshardError):
    """A map is well formed but states something impossible: a view outside its tensor, a shard
    its pieces do not tile, an uncovered element, inexact locations, conflicting scales.

    ``path`` is the JSON path (docs/spec.md §5) of the field at fault when the check can name one
    (``ranks.0.pieces.1.source[0]``), else ``""``; ``reason`` the message without it."""

    def __init__(self, reason: str, *, path: str = "") -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}" if path else reason)


class ShardError(ReshardError):
    """Shards handed to ``rebuild``/``apply`` disagree with the map: missing rank, wrong size,
    mixed dtypes."""


class ReplicaMismatchError(ReshardError):
    """Ranks that the map says hold identical data for a block do not (property P2)."""

    def __init__(self, message: str, *, ranks: tuple[int, ...] = (), max_abs_diff: float = 0.0) -> None:
        self.ranks = ranks
        self.max_abs_diff = max_abs_diff
        super().__init__(message)


class NotAffineError(ReshardError):
    """``derive`` was given a partition function that computes rather than selects."""


class PlanError(ReshardError):
    """Two maps cannot be composed into a plan (disagreeing valid shapes, inexact scale, ...)."""


class CheckpointError(ReshardError):
    """A checkpoint on disk is missing, truncated, unsafe, or disagrees with its own metadata."""


class QuantizedError(CheckpointError):
    """A source holds quantized weights (an FP8 or MXFP4 payload and its scales) that reshard does not
    decode: refused by name rather than copied as if the payload were a weight. Also a weight that
    cannot be quantized as asked (``--quantize``: a NaN or infinite value), naming its block."""


class UnplacedError(CheckpointError):
    """A source holds model weights (a parameter, a buffer, a tensor its reader has no parameter for)
    that the target has no place for: refused naming the file and tensor, before any output folder
    exists, rather than lost; ``--drop REGEX`` (``drop=``) leaves such entries out, recorded in the
    report and the manifest (``dropped``). ``entries``: the keys refused."""

    def __init__(self, message: str, *, entries: tuple[str, ...] = ()) -> None:
        self.entries = entries
        super().__init__(message)


class OutputError(ReshardError):
    """The output could not be written (no space left, no permission, a file size limit), or must
    not be: it would be, lie inside or contain the source it is read from. Nothing was committed:
    the partial folder is removed and no finished-looking output is left."""


class TopologyError(ReshardError):
    """A topology (TP x DP x PP x EP sizes, or a rank or index within one) is impossible."""


class TransferError(ReshardError):
    """A live move could not finish: a peer died, or a collective failed or timed out, during a
    ``WeightSync.push``. Raised on every surviving rank (within the process group's timeout); the
    process group is not usable afterwards."""


class PlotUnavailable(ReshardError):
    """A picture was asked for (``--png``) but matplotlib is not installed."""


def in_context(error: ReshardError, where: str) -> ReshardError:
    """``error`` with ``where`` in front of its message: the same type and fields (``ranks``,
    ``path``, ...), so callers can still catch and inspect it. ``raise in_context(e, f"{file}") from None``."""
    return _reworded(error, f"{where}: {error}")


def with_cause(error: ReshardError, cause: str) -> ReshardError:
    """``error`` with ``cause`` after its message (``"...; the engine reported: ..."``), the same
    type and fields, as :func:`in_context`."""
    return _reworded(error, f"{error}; {cause}")


def _reworded(error: ReshardError, message: str) -> ReshardError:
    out = type(error).__new__(type(error))  # not copy.copy: it would call __init__ with the message alone
    out.__dict__.update(error.__dict__)
    out.args = (message,)
    return out
