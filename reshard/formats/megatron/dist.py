"""A ``torch_dist`` iteration folder (docs/megatron-checkpoints.md §2): PyTorch DCP underneath, so
``formats.dcp.checkpoint`` reads its chunk index and maps chunks from the files; this module adds
what Megatron puts around it -- the save plans its ``.metadata`` carries (inert stand-ins), its
objects (``torch.save([value])`` records, restricted-unpickled), ``common_state`` and its ``args``,
and the optimizer layouts: plain Adam and ``fully_reshardable`` states chunked as the model, and
``dp_reshardable`` buckets (flat groups over each DP group, :func:`lowering.composite`).
"""

from __future__ import annotations

import re
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from ...errors import CheckpointError
from ...storage import verified
from ..dcp import checkpoint as dcp
from . import safe
from .buckets import (
    FULLY_RESHARDABLE_SHIFTED,
    bucket_layouts,
    bucket_size,
    copy_name,
    dense_buffer_params,
    embedding_copy,
    is_copy,
    several_buckets,
    shared_embedding,
)
from .grouped import TE_GROUPED, te_grouped
from .lowering import Lowered, chunk_map, composite, local_map
from .model import EMBED, Arch, KeySpec, LocalParam

__all__ = ["TorchDistBackend"]

_PLANNER = "torch.distributed.checkpoint.planner"


class _Inert:
    """A save-plan record Megatron keeps in ``.metadata`` (``all_local_plans``): kept as data."""

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state


class _MegatronMetadataUnpickler(dcp._MetadataUnpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == _PLANNER and name in ("SavePlan", "WriteItem", "TensorWriteData", "WriteItemType"):
            return _Inert
        return super().find_class(module, name)


def _open(iter_dir: Path) -> dcp.DcpCheckpoint:
    """``DcpCheckpoint.open`` with Megatron's save plans admitted in ``.metadata``."""
    f = iter_dir / dcp.METADATA
    md = dcp.read_metadata(iter_dir, _MegatronMetadataUnpickler)
    storage = dcp._storage_index(iter_dir, md)
    files = sorted({rel for rel, _, _ in storage.values()})
    sizes = dcp._file_sizes(iter_dir, files)
    for rel in files:  # said before any entry is read: which rank's file, and one key it holds
        if sizes.get(rel) is None:
            holds = next(fqn for (fqn, _), (r, _, _) in storage.items() if r == rel)
            m = dcp._RANK.search(rel)
            who = f"global rank {m.group(1)}'s file" if m else "a file .metadata names"
            raise CheckpointError(f"{iter_dir / rel}: file is missing ({who}; it holds {holds!r})")
    tensors, objects = {}, {}
    for key, entry in md.state_dict_metadata.items():
        if type(entry).__name__ == "BytesStorageMetadata":
            loc = storage.get((key, None))
            if loc is None:
                raise CheckpointError(f"{f}: entry {key!r} has no storage record")
            dcp._check_extent(iter_dir, key, loc, sizes)
            objects[key] = loc
            continue
        tensors[key] = dcp._tensor_entry(iter_dir, key, entry, storage, sizes, files)
    return dcp.DcpCheckpoint(iter_dir, tensors, objects, {})


_BUCKET = re.compile(r"^(chained_\d+\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)"
                     r"\.bucket_idx_(\d+)\.(param|exp_avg|exp_avg_sq)$")
_STATE_KINDS = {"fp32": ("param", "fp32_param"), "exp_avg": ("exp_avg",), "exp_avg_sq": ("exp_avg_sq",)}


class TorchDistBackend:
    """The keys, states and objects of one ``torch_dist`` iteration folder."""

    def __init__(self, iter_dir: Path) -> None:
        self.dir = iter_dir
        self.ck = _open(iter_dir)
        self.common = self._common()
        self.args = self.common.get("args")
        self.arch = Arch.from_args(self.args, f"{self._where('common_state/shard_0_1')}: common_state")
        self._local: dict = {}
        self._lowered: dict[tuple[str, str], Lowered] = {}

    # -- objects ---------------------------------------------------------------------------------
    def _where(self, key: str) -> str:
        """The file an object lies in (the folder when unknown)."""
        loc = self.ck.objects.get(key)
        return str(self.dir / loc[0]) if loc else str(self.dir)

    def raw(self, key: str) -> bytes:
        """An object's record, as it lies in its file."""
        rel, off, length = self.ck.objects[key]
        return bytes(self.ck._mapped(rel)[off:off + length])

    def obj(self, key: str) -> Any:
        """An object entry's value (records are ``torch.save([value])``)."""
        if key not in self.ck.objects:
            raise CheckpointError(f"{self.dir / dcp.METADATA}: no object {key!r}")
        where = f"{self._where(key)}: object {key!r}"
        value = safe.load_bytes(self.raw(key), where)
        if not isinstance(value, list) or len(value) != 1:
            raise CheckpointError(f"{where}: holds a {type(value).__name__}, not Megatron's one-element list")
        return value[0]

    def _common(self) -> dict:
        key = "common_state/shard_0_1"
        common = self.obj(key)
        where = f"{self._where(key)}: common_state"
        if not isinstance(common, dict) or not hasattr(common.get("args"), "num_layers"):
            raise CheckpointError(f"{where}: not Megatron's common state (no args Namespace)")
        return common

    def objects(self, prefix: str) -> list[str]:
        return [k for k in self.ck.objects if k.split("/", 1)[0] == prefix]

    def check_objects(self) -> None:
        """Every object parses under the allow-list (rng states, the optimizer's, extra states)."""
        for key in self.ck.objects:
            self.obj(key)

    # -- optimizer layout ------------------------------------------------------------------------
    @cached_property
    def sharding(self) -> str:
        """``adam`` (plain), ``dp_reshardable`` or ``fully_reshardable``."""
        if not getattr(self.args, "use_distributed_optimizer", False):
            return "adam"
        meta = self.common.get("content_metadata") or {}
        kind = meta.get("distrib_optim_sharding_type") or (self.common.get("optimizer") or {}).get(
            "param_state_sharding_type", "dp_reshardable")
        if kind not in ("dp_reshardable", "fully_reshardable"):
            raise CheckpointError(f"{self._where('common_state/shard_0_1')}: distributed optimizer sharding "
                                  f"{kind!r} is not read by reshard")
        where = f"{self._where('common_state/shard_0_1')}: common_state"
        if kind == "dp_reshardable" and te_grouped(self.args):
            raise CheckpointError(f"{where}: args.moe_grouped_gemm = True (transformer_impl "
                                  f"{getattr(self.args, 'transformer_impl', None)!r}): the dp_reshardable buckets of "
                                  f"{TE_GROUPED} (every expert's fc1, then fc2) are not read by reshard")
        if kind == "fully_reshardable" and several_buckets(self.args, self.arch, where):
            raise CheckpointError(f"{where}: args.overlap_grad_reduce with ddp_bucket_size / ddp_num_buckets: "
                                  f"{FULLY_RESHARDABLE_SHIFTED} is not read by reshard")
        return kind

    def model_key(self, spec: KeySpec) -> str:
        e = self.ck.tensors.get(spec.key)
        want = self.arch.full_shape(spec)
        if e is None:
            raise CheckpointError(f"{self.dir / dcp.METADATA}: no tensor {spec.key!r}, which args imply")
        if tuple(e.shape) != want:
            raise CheckpointError(f"{self.dir / dcp.METADATA}: tensor {spec.key!r} is {list(e.shape)}, args imply "
                                  f"{list(want)} (stacked layers/experts x the layer's shape)")
        return spec.key

    def states(self, spec: KeySpec) -> tuple[str, ...]:
        out = ["weight"]
        if self.sharding == "dp_reshardable":
            kinds = {k for _, k in self.buckets.get(spec.key, {})}
            out += [s for s in ("fp32", "exp_avg", "exp_avg_sq") if s in kinds]
        else:
            out += [s for s, names in _STATE_KINDS.items() if self._state_key(spec, names) is not None]
        return tuple(out)

    def _state_key(self, spec: KeySpec, names: tuple[str, ...]) -> str | None:
        for n in names:
            for prefix in ("", "chained_0.", "chained_1."):
                k = f"{prefix}optimizer.state.{n}.{spec.key}"
                if k in self.ck.tensors:
                    return k
        return None

    def lowered(self, spec: KeySpec, state: str) -> Lowered:
        got = self._lowered.get((spec.key, state))
        if got is None:
            got = self._lowered[(spec.key, state)] = self._lower(spec, state)
        return got

    def _lower(self, spec: KeySpec, state: str) -> Lowered:
        if state == "weight" or self.sharding != "dp_reshardable":
            key = self.model_key(spec) if state == "weight" else self._state_key(spec, _STATE_KINDS[state])
            if key is None:
                raise CheckpointError(f"{self.dir}: no {state} of {spec.key!r}")
            e = self.ck.entry(key)
            if tuple(e.shape) != self.arch.full_shape(spec):
                raise CheckpointError(f"{self.dir / dcp.METADATA}: {key!r} is {list(e.shape)}, its parameter "
                                      f"{list(self.arch.full_shape(spec))}")
            m = chunk_map(tuple(e.shape), [(c.offsets, c.sizes) for c in e.chunks], f"{self.dir / dcp.METADATA}: {key!r}")
            return Lowered(m, lambda i, key=key: self._chunk(key, i), lambda i: None,
                           lambda i, key=key: self.chunk_rank(key, i))
        return self._bucket_lowered(spec, state)

    def chunk_rank(self, key: str, i: int) -> int:
        """The storage rank that wrote chunk ``i`` of ``key`` (the R of ``__R_N.distcp``)."""
        return self.ck.entry(key).chunks[i].rank

    def _chunk(self, key: str, i: int) -> torch.Tensor:
        return self.ck.chunk(key, i).reshape(-1)

    # -- dp_reshardable buckets ------------------------------------------------------------------
    @cached_property
    def buckets(self) -> dict[str, dict[tuple[int, str], tuple[LocalParam, str, int, int, int, int]]]:
        """``{key: {(fragment label, state): (local param, bucket key, chunk, start in chunk, n, start in
        the local parameter)}}``
        for every parameter range of every bucket chunk (gaps skipped)."""
        out: dict[str, dict] = {}
        self.copies: dict[tuple[int, str], list[tuple[str, int, int, int, int]]] = {}
        counters: dict[tuple[str, str], int] = {}
        groups: dict[tuple, dict[str, str]] = {}
        for key in self.ck.tensors:
            m = _BUCKET.match(key)
            if m:
                groups.setdefault(m.groups()[:5], {})[m.group(6)] = key
        buffers: dict[tuple, dict[int, dict[str, str]]] = {}
        for (prefix, mp, gbuf, dtype, bucket), keys in groups.items():
            buffers.setdefault((prefix, int(mp), int(gbuf), dtype), {})[int(bucket)] = keys
        for (prefix, mp, gbuf, _dtype), by_bucket in sorted(buffers.items()):
            where = f"{self.dir / dcp.METADATA}: {next(iter(by_bucket[min(by_bucket)].values()))!r}"
            # one DDP buffer per model chunk (virtual stages: gbuf_idx = the chunk)
            if gbuf >= self.arch.vpp:
                raise CheckpointError(f"{where}: several DDP buffers per model chunk (several dtypes): not read by "
                                      "reshard")
            params, dp, pp = self._group_params(prefix or "", mp, where, gbuf)
            layouts = bucket_layouts(params, dp, bucket_size(self.args, self.arch, pp, gbuf, where),
                                     shared_embedding(self.arch))
            dense = prefix in (None, "", "chained_0.")
            if sorted(by_bucket) != list(range(len(layouts))):
                raise CheckpointError(f"{where}: its buffer holds buckets {sorted(by_bucket)}, the args (overlap_grad_"
                                      f"reduce, ddp_bucket_size, ddp_num_buckets) imply {len(layouts)}")
            for bucket, keys in sorted(by_bucket.items()):
                where = f"{self.dir / dcp.METADATA}: {next(iter(keys.values()))!r}"
                # Megatron's distributed Adam saves a bucket's fp32 params and both moments together: one
                # missing is a damaged .metadata, not a source without masters (which would be cast silently)
                lost = [k for k in ("param", "exp_avg", "exp_avg_sq") if k not in keys]
                if lost:
                    raise CheckpointError(f"{where}: its bucket has no {', '.join(lost)} entry, which Megatron's "
                                          "distributed optimizer saves beside the others: damaged or not Megatron's")
                layout, unpadded = layouts[bucket].params, layouts[bucket].unpadded
                for kind, key in keys.items():
                    e = self.ck.entry(key)
                    if e.shape != (unpadded,):
                        raise CheckpointError(f"{self.dir / dcp.METADATA}: {key!r} holds {list(e.shape)} elements, "
                                              f"the bucket layout args imply {unpadded}")
                    # a chunk lost or moved would leave part of every state it holds unread
                    chunk_map((unpadded,), [(c.offsets, c.sizes) for c in e.chunks],
                              f"{self.dir / dcp.METADATA}: {key!r}")
                    state = "fp32" if kind == "param" else kind
                    for ci, c in enumerate(e.chunks):
                        a, b = c.offsets[0], c.offsets[0] + c.sizes[0]
                        for lp, s, t in layout:
                            lo, hi = max(a, s), min(b, t)
                            if lo < hi and dense and is_copy(self.arch, pp, lp):  # checked, not read (check_copy)
                                self.copies.setdefault((lp.tp, state), []).append((key, ci, lo - a, hi - lo, lo - s))
                            elif lo < hi:
                                n = counters.get((lp.spec.key, state), 0)
                                counters[(lp.spec.key, state)] = n + 1
                                out.setdefault(lp.spec.key, {})[(n, state)] = (lp, key, ci, lo - a, hi - lo, lo - s)
        return out

    def check_copy(self) -> None:
        """The last stage's embedding copy (MTP or tied embeddings over several stages) in its own
        buckets: its fp32 master and both moments equal the first stage's, bit for bit, range for
        range. ``torch_dist`` stores the copy's weights once (the first stage's, replica 0), but
        each stage's distributed optimizer saves its own buckets; reshard reads the first stage's."""
        a = self.arch
        if self.sharding != "dp_reshardable" or not embedding_copy(a, a.pp - 1):
            return
        ours = self.buckets.get(EMBED, {})
        for lp in a.locals_of(a.spec(EMBED)):
            for state in ("fp32", "exp_avg", "exp_avg_sq"):
                mine = sorted((at, n, key, ci, start) for key, ci, start, n, at in self.copies.get((lp.tp, state), []))
                first = sorted((at, n, key, ci, start) for (_, s), (p, key, ci, start, n, at) in ours.items()
                               if s == state and p.tp == lp.tp)
                what = f"{copy_name(a)} ({state}, TP rank {lp.tp})"
                if sum(x[1] for x in mine) != lp.numel:
                    raise CheckpointError(f"{self.dir / dcp.METADATA}: the last stage's buckets hold "
                                          f"{sum(x[1] for x in mine)} elements of the embedding copy {what}, its "
                                          f"parameter {lp.numel}")
                self._equal_ranges(mine, first, what)

    def _equal_ranges(self, mine: list, first: list, what: str) -> None:
        """The copy's ranges (``(at, n, key, chunk, start)``) hold what the first stage's do."""
        def pieces(ranges: list) -> list[tuple[int, int, torch.Tensor, str]]:
            out = []
            for at, n, key, ci, start in ranges:
                t = self.ck.chunk(key, ci).reshape(-1)
                verified.ensure(t, f"{key} chunk {ci}")  # read outside the engine's fills: checked now
                out.append((at, at + n, t.narrow(0, start, n), key))
            return out

        mp, fp = pieces(mine), pieces(first)
        for lo, hi, t, key in mp:
            for flo, fhi, f, fkey in fp:
                a, b = max(lo, flo), min(hi, fhi)
                if a < b and not torch.equal(t.narrow(0, a - lo, b - a), f.narrow(0, a - flo, b - a)):
                    raise CheckpointError(f"{self.dir / dcp.METADATA}: {key!r}: the last stage's embedding copy "
                                          f"{what} differs from the first stage's ({fkey!r}) at elements "
                                          f"[{a}, {b}) of the local parameter")

    def _group_params(self, prefix: str, m: int, where: str, vp: int = 0) -> tuple[list[LocalParam], int, int]:
        a = self.arch
        if prefix in ("", "chained_0."):
            t, pp = m % a.tp, m // a.tp
            if pp >= a.pp:
                raise CheckpointError(f"{where}: dp_group_idx {m} is outside TP x PP = {a.tp} x {a.pp}")
            return dense_buffer_params(a, pp, t, vp), a.dp, pp
        if prefix == "chained_1." and a.expert_apart:
            t, ep, pp = m % a.etp, (m // a.etp) % a.ep, m // (a.etp * a.ep)
            if pp >= a.pp:
                raise CheckpointError(f"{where}: expert dp_group_idx {m} is outside ETP x EP x PP")
            return a.stage_params(pp, t, expert_rank=ep, vp=vp), a.edp, pp
        raise CheckpointError(f"{where}: optimizer prefix {prefix!r} is not Megatron's dense/expert pair")

    def _bucket_lowered(self, spec: KeySpec, state: str) -> Lowered:
        entries = {n: v for (n, s), v in self.buckets.get(spec.key, {}).items() if s == state}
        outer, _ = local_map(self.arch, spec, self._local)
        frags: dict[int, list[tuple[int, int, int]]] = {}
        for n, (lp, _, _, _, count, at) in sorted(entries.items()):
            frags.setdefault(lp.label, []).append((n, at, at + count))
        m = composite(outer, frags, f"{self.dir}: {state} of {spec.key!r} in the dp_reshardable buckets")

        def fragment(n: int) -> torch.Tensor:
            _, key, ci, start, count, _ = entries[n]
            return self.ck.chunk(key, ci).reshape(-1).narrow(0, start, count)

        return Lowered(m, fragment, lambda n: entries[n][0].tp,
                       lambda n: self.chunk_rank(entries[n][1], entries[n][2]))  # the bucket chunk's writer

    # -- progress ----------------------------------------------------------------------------------
    def _optimizers(self) -> list[dict]:
        """The common state's optimizer entries: one, or the dense and expert ones of a chained
        optimizer (``{0: ..., 1: ...}``)."""
        opt = self.common.get("optimizer") or {}
        return [opt[k] for k in sorted(opt)] if opt and all(isinstance(k, int) for k in opt) else [opt]

    def step(self) -> Any:
        opt = self._optimizers()[0]
        if self.sharding == "adam":
            return (opt.get("state") or {}).get("common_step")
        if self.sharding == "fully_reshardable":
            groups = (opt.get("optimizer") or {}).get("param_groups") or []
        else:
            keys = [k for k in self.ck.objects if k.endswith(".optimizer/shard_0_1")]
            groups = (self.obj(keys[0]).get("param_groups") or []) if keys else []
        return groups[0].get("step") if groups else None

    def param_groups(self) -> list[dict[str, Any]]:
        """Every optimizer's groups (dense, then experts'), in order."""
        if self.sharding == "dp_reshardable":
            keys = [k for k in self.ck.objects if k.endswith(".optimizer/shard_0_1")]
            firsts = {}
            for k in sorted(keys):
                firsts.setdefault(k.split("optimizer.distributed")[0], k)  # one per chained optimizer
            return [dict(g) for k in sorted(firsts.values()) for g in (self.obj(k).get("param_groups") or [])]
        groups = []
        for opt in self._optimizers():
            found = opt.get("param_groups") if self.sharding == "adam" else (opt.get("optimizer") or {}).get("param_groups")
            groups += [dict(g) for g in found or []]
        return groups

    @property
    def files(self) -> list[Path]:
        return sorted({self.dir / c.file for e in self.ck.tensors.values() for c in e.chunks} |
                      {self.dir / rel for rel, _, _ in self.ck.objects.values()})

