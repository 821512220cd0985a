"""Every source entry accounted for, on every route (docs/spec.md §11), before any output folder
exists. Each parameter the reader lowers and each entry it holds beside them
(:meth:`Reader.unlowered`) is one of:

* **written**: a parameter a slot of the writer's buffers takes (``Writer.buffers``) or that it
  copies as the source stores it (``Writer.copied``), or a held entry the
  writer carries as it is (:meth:`Writer.carries`);
* **not carried**: a run's state the target has no place for (``_extra_state``, RNG, a
  scheduler), listed in the report and the manifest (``not_carried``) with its reason;
* **dropped**: model weights the target has no place for, which the user named with ``--drop``
  (``drop=``), listed in the report and the manifest (``dropped``);
* else **refused** (``UnplacedError``), naming the file and the entry: never lost silently.

``--drop`` applies to any entry: a parameter it names is left out before the writer is made
(:func:`prepare`), so a target that has no place for it (an HF architecture mapping without the
tensor) is laid out without it; and where it names an entry the writer would copy with the
source's own files, the writer is made from a source whose own files no target copies.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ReshardError, UnplacedError
from ..execute.bands import Banded
from ..formats.contract import HELD, MOMENTS, ExpertLayer, Held, Reader, ReaderView, Stored, Target, Writer
from ..ir.param_map import ParamMap

__all__ = ["Accounted", "Without", "account", "patterns", "prepare"]

SHOWN = 5  # entries a refusal or a report line names before "and N more"


@dataclass(frozen=True, slots=True)
class Accounted:
    """What a job does not write, and why: ``not_carried`` (a state the target has no place for)
    and ``dropped`` (weights the user dropped); ``unused``: ``--drop`` patterns that matched nothing."""

    not_carried: tuple[Held, ...] = ()
    dropped: tuple[Held, ...] = ()
    unused: tuple[str, ...] = ()
    moments: tuple[str, ...] = ()  # parameters whose Adam moments a weights-only target does not take
    target: str = ""

    def meta(self) -> dict[str, list[dict[str, str]]]:
        """The manifest's keys: present only where non-empty (a route with nothing to report is
        written as before)."""
        out = {}
        if self.not_carried:
            out["not_carried"] = [h.to_dict() for h in self.not_carried]
        if self.dropped:
            out["dropped"] = [h.to_dict() for h in self.dropped]
        return out

    def notes(self) -> list[str]:
        """The report's lines: one per reason."""
        out = [f"not carried ({reason}): {_listing(keys)}" for reason, keys in _by_reason(self.not_carried)]
        out += [f"dropped by --drop ({reason}): {_listing(keys)}" for reason, keys in _by_reason(self.dropped)]
        out += [f"--drop {p!r} matched no entry of the source" for p in self.unused]
        if self.moments:  # the target's own choice of what it holds: said once, not listed in the manifest
            out.append(f"not carried (the {self.target} target holds weights only): the Adam moments of "
                       f"{len(self.moments)} parameters")
        return out


def patterns(drop: Iterable[str]) -> list[re.Pattern[str]]:
    """The ``--drop`` regexes, compiled (a bad one refused naming it)."""
    if isinstance(drop, str):  # a lone pattern, not its characters
        drop = (drop,)
    out = []
    for p in drop:
        try:
            out.append(re.compile(p))
        except (re.error, TypeError) as e:
            raise ReshardError(f"drop (--drop): {p!r} is not a regular expression ({e})") from None
    return out


def account(reader: Reader, writer: Writer, targets: Sequence[Target], drop: Iterable[str] = ()) -> Accounted:
    """Account for every entry of ``reader``'s source on the route to ``writer`` (module doc);
    raises ``UnplacedError`` for model weights with no place in the target that ``drop`` does not
    name."""
    pats = patterns(drop)
    written = {t.name for t in targets} | set(writer.copied())
    where = str(reader.sources[-1])
    unwritten = [Held(n, where, "weights", writer.unplaced(n) or f"a parameter the {writer.format} target does not fill")
                 for n in reader.names if n not in written]
    held = []
    for h in [*unwritten, *reader.unlowered()]:
        if h.what not in HELD:
            raise ReshardError(f"internal: {h.file}: held entry {h.key!r} is {h.what!r}, not one of {HELD}")
        if not writer.carries(h):
            held.append(h)
        elif any(p.search(h.key) for p in pats):
            raise ReshardError(f"{h.file}: --drop names {h.key!r}, which the {writer.format} target copies as the "
                               "source holds it: it cannot be left out on this route")
    used: set[str] = set()
    not_carried, dropped, refused = [], [], []
    for h in held:
        hit = next((p for p in pats if p.search(h.key)), None)
        if hit is not None and h.key in written:  # never "dropped" and written
            raise ReshardError(f"internal: {h.file}: --drop names {h.key!r}, which the {writer.format} target writes")
        if hit is not None:
            used.add(hit.pattern)
            dropped.append(h)
        elif h.what == "state":
            not_carried.append(h)
        else:
            refused.append(h)
    if refused:
        shown = "; ".join(f"{h.file}: {h.key} ({h.reason})" for h in refused[:SHOWN])
        more = f"; and {len(refused) - SHOWN} more" if len(refused) > SHOWN else ""
        raise UnplacedError(f"{len(refused)} source tensor(s) of model weights have no place in the {writer.format} "
                            f"target: {shown}{more}. Refused rather than lost: leave them out with --drop REGEX "
                            "(drop=), recorded in the report and the manifest", entries=tuple(h.key for h in refused))
    wanted: dict[str, set[str]] = {}
    for t in targets:
        wanted.setdefault(t.name, set()).update(t.want)
    moments = tuple(n for n in reader.names if n in wanted and not wanted[n] & set(MOMENTS)
                    and set(reader.states(n)) & set(MOMENTS))
    return Accounted(tuple(not_carried), tuple(dropped), tuple(p.pattern for p in pats if p.pattern not in used),
                     moments, writer.format)


def _by_reason(held: Sequence[Held]) -> list[tuple[str, list[str]]]:
    out: dict[str, list[str]] = {}
    for h in held:
        out.setdefault(h.reason, []).append(h.key)
    return list(out.items())


def _listing(keys: list[str]) -> str:
    more = f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else ""
    return ", ".join(keys[:SHOWN]) + more


def prepare(reader: Reader, drop: Iterable[str], make: Callable[[Reader], Writer]) -> tuple[Reader, Writer]:
    """The source and the writer ``make`` makes of it, with what ``drop`` names left out: a
    parameter it names is taken from the source before the writer is made (:class:`Without`),
    and where the writer would copy an entry it names as it is (the source's own files), the
    writer is made again from a source whose own files no target copies."""
    pats = patterns(drop)
    if not pats:
        return reader, make(reader)
    gone = [n for n in reader.names if any(p.search(n) for p in pats)]
    if gone:
        view = Without(reader, gone)
        return view, make(view)
    writer = make(reader)
    copied = [h for h in reader.unlowered() if any(p.search(h.key) for p in pats) and writer.carries(h)]
    if not copied:
        return reader, writer
    view = Without(reader, ())
    try:
        return view, make(view)
    except ReshardError:  # a target written from the source's own files only (Megatron's)
        h = copied[0]
        raise ReshardError(f"{h.file}: --drop names {h.key!r}, which the {writer.format} target copies as the source "
                           "holds it: it cannot be left out on this route") from None


class Without(ReaderView):
    """A source without some of its parameters (``--drop``): each listed as held weights, which
    the accounting records as dropped, and no own files a target would copy (``native``: none).
    Every other question goes to the source."""

    def __init__(self, inner: Reader, gone: Sequence[str]) -> None:
        super().__init__(inner)
        self.gone = frozenset(gone)
        self.names = [n for n in inner.names if n not in self.gone]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.inner.shape(name)

    def states(self, name: str) -> tuple[str, ...]:
        return self.inner.states(name)

    def dtype(self, name: str, state: str) -> torch.dtype:
        return self.inner.dtype(name, state)

    def map(self, name: str, state: str) -> ParamMap:
        return self.inner.map(name, state)

    def fragment(self, name: str, state: str, rank: int) -> torch.Tensor:
        return self.inner.fragment(name, state, rank)

    def banded(self, name: str, state: str, rank: int) -> Banded | None:
        return self.inner.banded(name, state, rank)

    def check_fragment(self, name: str, state: str, rank: int) -> None:
        self.inner.check_fragment(name, state, rank)

    def stored(self, name: str) -> Stored | None:
        return self.inner.stored(name)

    def tp_index(self, name: str, state: str, rank: int) -> int | None:
        return self.inner.tp_index(name, state, rank)

    def step(self, name: str) -> Any:
        return self.inner.step(name)

    def param_groups(self) -> list[dict[str, Any]]:
        return [dict(g, params=[n for n in g.get("params", []) if n not in self.gone])
                for g in self.inner.param_groups()]

    def extras(self, name: str) -> dict[str, Any]:
        return self.inner.extras(name)

    def model_order(self) -> list[str] | None:
        order = self.inner.model_order()
        return None if order is None else [n for n in order if n not in self.gone]

    def tied(self) -> dict[str, str]:
        return {a: w for a, w in self.inner.tied().items() if w not in self.gone and a not in self.gone}

    def buffers(self) -> tuple[str, ...]:
        return tuple(n for n in self.inner.buffers() if n not in self.gone)

    def frozen(self) -> tuple[str, ...]:
        return tuple(n for n in self.inner.frozen() if n not in self.gone)

    def expert_layers(self) -> tuple[ExpertLayer, ...]:
        return self.inner.expert_layers()

    def saver(self, name: str, state: str, rank: int) -> int | None:
        return self.inner.saver(name, state, rank)

    def unlowered(self) -> list[Held]:
        where = str(self.inner.sources[-1])
        return [*self.inner.unlowered(), *(Held(n, where, "weights", "a parameter --drop names")
                                           for n in self.inner.names if n in self.gone)]
