"""The chunks of a ``torch_dist`` target at TP x PP x DP (x EP), and their maps over rank labels
(a label per chunk, as the reader lowers a source):

* model keys (and plain Adam's / ``fully_reshardable``'s states, chunked alike): one chunk per
  (layer[, expert], TP part) -- two per TP rank for SwiGLU's fc1 -- in the file of the rank that
  holds it at DP rank 0 (an expert's: its EP rank's first DP rank);
* ``dp_reshardable`` buckets: per model-parallel rank (and, with experts, per expert rank) a DDP
  buffer per model chunk, cut into buckets and laid out as Megatron does (``buckets.py``: one
  bucket unless the args ask for several), each cut into one chunk per parameter
  range and gap of each DP rank's shard, in that DP rank's file; a key's map is its local map
  composed with the ranges (``lowering.composite``); gap chunks have no slots (zeros).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ...ir.param_map import ParamMap
from .buckets import bucket_layouts, dense_buffer_params, is_copy, shared_embedding
from .lowering import chunk_map, composite, local_map
from .model import EMBED, OUTPUT, Arch, KeySpec, LocalParam

__all__ = ["BucketChunk", "Bucket", "ModelChunk", "TargetLayout"]


@dataclass(frozen=True, slots=True)
class ModelChunk:
    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    rank: int  # the file (global rank) it is written to
    label: int  # its shard in the key's map


@dataclass(frozen=True, slots=True)
class BucketChunk:
    start: int
    end: int
    rank: int
    param: LocalParam | None  # None: a gap
    label: int  # its shard in the parameter's bucket map (-1 for a gap or the embedding copy)
    at: int  # where it starts in the local parameter
    copy: bool = False  # the last stage's embedding copy: written as the first stage's range at ``at``


@dataclass(slots=True)
class Bucket:
    """Bucket ``idx`` of one DDP buffer of one model-parallel (or expert) rank; ``gbuf`` its model
    chunk (virtual stage)."""

    prefix: str
    m: int
    numel: int
    unpadded: int
    chunks: list[BucketChunk] = field(default_factory=list)
    gbuf: int = 0
    idx: int = 0


class TargetLayout:
    """Every chunk of the target and each key's maps (``weight`` chunks, ``bucket`` ranges)."""

    def __init__(self, arch: Arch, *, buckets: bool, vocab_rows: int,
                 bucket_size: Callable[[int, int], int | None] | None = None) -> None:
        self.arch, self.vocab_rows = arch, vocab_rows
        self._bucket_size = bucket_size or (lambda pp, vp: None)  # (stage, model chunk) -> Megatron's bucket size
        self._local: dict = {}
        self.model: dict[str, list[ModelChunk]] = {s.key: self._model_chunks(s) for s in arch.keys()}
        self.maps = {s.key: self._chunk_map(s) for s in arch.keys()}
        self.buckets: list[Bucket] = self._buckets() if buckets else []
        self.bucket_maps: dict[str, ParamMap] = self._bucket_maps() if buckets else {}

    def _model_chunks(self, s: KeySpec) -> list[ModelChunk]:
        a, out = self.arch, []
        for lp in a.locals_of(s):
            if s.split == "rep" and lp.tp:
                continue
            pp = a.stage_of(s, lp.index)
            rank = a.expert_rank(lp.tp, lp.index[-1] // (a.experts // a.ep), 0, pp) if s.expert else a.rank(lp.tp, pp)
            for offsets, sizes in lp.parts:
                out.append(ModelChunk(s.key, offsets, sizes, rank, len(out)))
        return out

    def _chunk_map(self, s: KeySpec) -> ParamMap:
        m = chunk_map(self.arch.full_shape(s), [(c.offsets, c.sizes) for c in self.model[s.key]], s.key)
        if s.key in (EMBED, OUTPUT) and self.vocab_rows != m.logical_shape[0]:
            m = ParamMap(m.logical_shape, m.shards, (self.vocab_rows, *m.logical_shape[1:]))
        return m

    def _groups(self) -> list[tuple[str, int, int, int, list[LocalParam], int, list[int]]]:
        """(prefix, m, stage, model chunk, parameters in registration order, DP group size, rank of
        each DP shard): a buffer per model chunk."""
        a = self.arch
        dense = "chained_0." if a.expert_apart else ""
        out = [(dense, t + a.tp * pp, pp, vp, dense_buffer_params(a, pp, t, vp), a.dp,
                [a.rank(t, pp, d) for d in range(a.dp)])
               for pp in range(a.pp) for t in range(a.tp) for vp in range(a.vpp)]
        if a.expert_apart:
            out += [("chained_1.", t + a.etp * (ep + a.ep * pp), pp, vp, a.stage_params(pp, t, expert_rank=ep, vp=vp),
                     a.edp, [a.expert_rank(t, ep, k, pp) for k in range(a.edp)])
                    for pp in range(a.pp) for ep in range(a.ep) for t in range(a.etp) for vp in range(a.vpp)]
        return out

    def _buckets(self) -> list[Bucket]:
        out: list[Bucket] = []
        counters: dict[str, int] = {}
        for prefix, m, pp, vp, params, dp, ranks in self._groups():
            copy = (lambda lp, pp=pp: is_copy(self.arch, pp, lp)) if prefix != "chained_1." else (lambda lp: False)
            for idx, bl in enumerate(bucket_layouts(params, dp, self._bucket_size(pp, vp), shared_embedding(self.arch))):
                out.append(self._bucket(Bucket(prefix, m, bl.numel, bl.unpadded, gbuf=vp, idx=idx), bl.params,
                                        dp, ranks, counters, copy))
        return out

    @staticmethod
    def _bucket(b: Bucket, layout: tuple[tuple[LocalParam, int, int], ...], dp: int, ranks: list[int],
                counters: dict[str, int], copy: Callable[[LocalParam], bool] = lambda lp: False) -> Bucket:
        """``b`` cut into its parameters' ranges and gaps within each DP rank's shard."""
        shard = b.numel // dp
        cuts = sorted({0, b.unpadded} | {x for _, s, e in layout for x in (s, e)} |
                      {k * shard for k in range(1, dp) if k * shard < b.unpadded})
        for lo, hi in zip(cuts, cuts[1:]):
            owner = next(((lp, s) for lp, s, e in layout if s <= lo and hi <= e), None)
            if owner is None:
                b.chunks.append(BucketChunk(lo, hi, ranks[lo // shard], None, -1, 0))
                continue
            lp, s = owner
            if copy(lp):  # no label of its own: the embedding's map tiles the first stage's ranges
                b.chunks.append(BucketChunk(lo, hi, ranks[lo // shard], lp, -1, lo - s, copy=True))
                continue
            n = counters.get(lp.spec.key, 0)
            counters[lp.spec.key] = n + 1
            b.chunks.append(BucketChunk(lo, hi, ranks[lo // shard], lp, n, lo - s))
        return b

    def _bucket_maps(self) -> dict[str, ParamMap]:
        frags: dict[str, dict[int, list[tuple[int, int, int]]]] = {}
        for b in self.buckets:
            for c in b.chunks:
                if c.param is not None and not c.copy:
                    frags.setdefault(c.param.spec.key, {}).setdefault(c.param.label, []).append(
                        (c.label, c.at, c.at + c.end - c.start))
        out = {}
        for s in self.arch.keys():
            if s.buffer:  # no optimizer state
                continue
            outer, _ = local_map(self.arch, s, self._local)
            m = composite(outer, frags.get(s.key, {}), f"target buckets of {s.key!r}")
            if s.key in (EMBED, OUTPUT) and self.vocab_rows != m.logical_shape[0]:
                m = ParamMap(m.logical_shape, m.shards, (self.vocab_rows, *m.logical_shape[1:]))
            out[s.key] = m
        return out
