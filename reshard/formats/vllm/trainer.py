"""The trainer side of vLLM's weight-transfer backend "reshard" (imports vLLM; ``plugin.py``
registers it with ``WeightTransferTrainerFactory``).

Every trainer rank calls :meth:`ReshardTrainerWeightTransferEngine.trainer_init` and
:meth:`~ReshardTrainerWeightTransferEngine.send_weights`; rank 0 (the sender) also drives the
engine through the client (vLLM's four-method protocol: :class:`LLMClient` for an offline ``LLM``
in this process, vLLM's own ``HTTPVLLMWeightSyncClient`` for a server's RL routes).

* ``trainer_init``: the sender starts ``init_weight_transfer_engine`` on a side thread (the
  workers block in it until the group is complete), every trainer rank joins the transfer group,
  rank 0 sends the setup, learns the targets from the workers' marker states and sends them
  (``wire.py``); each rank plans its own sends once.
* ``send_weights``: the sender calls ``start_weight_update`` and starts ``update_weights`` on a
  side thread; every rank packs, for each worker, exactly the elements of its local shards that
  worker's engine tensors hold, cast to the wire dtype, and sends it one message; every rank of
  the group then reports success or failure; the sender waits for ``update_weights`` and calls
  ``finish_weight_update``. No trainer rank gathers a tensor: the source is the ranks' local
  shards (:meth:`ShardSource.fsdp2`: FSDP2's DTensor local shards; :meth:`ShardSource.megatron`: a
  live Megatron-Core model's TP x PP parameters; views the optimizer updates in place). A dead or
  hung rank anywhere raises :class:`~reshard.errors.TransferError` on every trainer rank within the group's timeout; the sender first waits up to that timeout for the
  engine's answer and closes the update with ``finish_weight_update`` (the engine keeps its
  previous weights), or leaves an engine that does not answer as it is.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
)

from ...errors import MapError, ReshardError, TransferError, with_cause
from ...execute.group import TransferGroup
from ...execute.lazy import LazyShards
from ...execute.sources import fsdp2_sources, reader_sources
from ...ir.param_map import ParamMap
from ...layouts.inference import Placed
from ...layouts.learned import learn_placed
from ...plan.planner import plan_for_rank
from ..contract import Reader
from . import cache, wire

__all__ = ["LLMClient", "ReshardTrainerInitInfo", "ReshardTrainerWeightTransferEngine", "ShardSource",
           "learned_targets"]


@dataclass
class ReshardTrainerInitInfo(TrainerInitInfo):
    """The transfer group: trainer rank 0 hosts its store at ``host:port`` (a free port);
    ``trainer_ranks`` trainer ranks then the engine's workers, ``world_size`` in all.
    ``dtype``: the engine's, what crosses the wire (sources are cast on the sender)."""

    backend: ClassVar[str] = "reshard"
    host: str
    port: int
    trainer_ranks: int
    world_size: int
    timeout_s: float = 120.0
    dtype: str = "bfloat16"
    name: str = "reshard"


class ShardSource(WeightSource):
    """A trainer's weights as maps and this rank's local shards (never a gathered tensor):
    ``maps`` by HF parameter name over trainer ranks ``0..T-1``, ``shards`` this rank's views."""

    def __init__(self, maps: Mapping[str, ParamMap], shards: Mapping[str, torch.Tensor]) -> None:
        self.maps = dict(maps)
        self.shards = shards if isinstance(shards, LazyShards) else dict(shards)  # a lazy one is read when packed

    @classmethod
    def fsdp2(cls, model: torch.nn.Module) -> ShardSource:
        """A model under FSDP2's ``fully_shard``: its DTensors' maps and local shards."""
        return cls(*fsdp2_sources(model))

    @classmethod
    def checkpoint(cls, reader: Reader, rank: int, *, ranks: list[int] | None = None,
                   states: tuple[str, ...] = ("fp32", "weight"), lazy: bool = True) -> ShardSource:
        """A checkpoint folder's reader (``reshard.open(path, names="hf")``: any format reshard
        reads, under the engine's HF names): storage rank ``k``'s fragments on trainer rank
        ``ranks[k]`` (default ``k``), never gathered; this rank's are ``rank``'s
        (``execute.sources.reader_sources``: the fp32 masters where the checkpoint has them).
        ``lazy`` (default): each fragment is read when an update packs it, a band at a time (a
        quantized weight decoded band by band), and checked again before each update sends."""
        return cls(*reader_sources(reader, rank, ranks=ranks, states=states, lazy=lazy))

    @classmethod
    def megatron(cls, model: torch.nn.Module, *, vocab_size: int | None = None,
                 rank_of: Callable[[int, int], int] | None = None) -> ShardSource:
        """A live Megatron-Core ``GPTModel`` (local spec; TP x PP, any wrapper with ``.module``) on
        this rank: its parameters under HF names, each rank's shards views of its own module
        parameters (``formats.megatron.live``); data-parallel ranks other than 0 hold nothing.
        ``vocab_size``: the HF model's rows of the padded embedding (default: all of them);
        ``rank_of(tp, pp)``: the trainer rank at that position (default: Megatron's rank order)."""
        from megatron.core import parallel_state as ps

        from ..megatron.live import megatron_sources

        gpt = model
        while hasattr(gpt, "module"):
            gpt = gpt.module
        padded = int(gpt.vocab_size)
        return cls(*megatron_sources(
            dict(model.named_parameters()), gpt.config, vocab_size=padded if vocab_size is None else vocab_size,
            padded_vocab=padded, tied=bool(gpt.share_embeddings_and_output_weights),
            tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
            dp_rank=ps.get_data_parallel_rank(), dp=ps.get_data_parallel_world_size(), rank_of=rank_of))

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(m.valid_shape) for n, m in self.maps.items()}

    def metadata(self) -> list[ParamMeta]:
        sh = self.shards  # a lazy source's dtypes without reading it
        dtypes = {n: sh.dtype(n) if isinstance(sh, LazyShards) else sh[n].dtype for n in sh}
        return [ParamMeta(n, dtypes.get(n, torch.float32), s) for n, s in self.shapes.items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise TransferError("ShardSource never materializes a whole tensor: the reshard backend sends shards")


class LLMClient:
    """vLLM's client protocol over an offline ``LLM`` (or anything with its RL methods) in this process."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)


def learned_targets(llm: Any, shapes: Mapping[str, tuple[int, ...]], *, ranks: list[int] | None = None,
                    use_cache: bool = True) -> dict[str, Placed]:
    """The maps of a running engine: every parameter of ``shapes`` (full HF shapes) as vLLM's own
    loaders place it on each worker, learned from markers (``layouts.learned``), for
    :class:`reshard.WeightSync` or the planner. ``llm``: an offline ``LLM`` (started with
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``: its ``collective_rpc`` then takes a function);
    worker ``w`` becomes rank ``ranks[w]`` (default ``w``). The workers' cached maps are used
    where every worker has them (``cache.py``), and what is learned is cached on them;
    ``use_cache=False`` learns afresh and keeps nothing."""
    from .engine import worker_maps_reply, worker_put_maps

    args = {n: list(s) for n, s in shapes.items()}
    replies = llm.collective_rpc(worker_maps_reply, args=(args, use_cache))
    if use_cache and all(r[:1] == b"C" for r in replies):
        learned = _agreed(dict(enumerate(replies)))
    else:
        if any(r[:1] == b"C" for r in replies):  # some workers lack them: every worker's markers
            replies = llm.collective_rpc(worker_maps_reply, args=(args, False))
        states = {w: wire.decode_marker_reply(r, w) for w, r in enumerate(replies)}
        learned = learn_placed(shapes, states)
        if use_cache:
            engines = {w: (sorted(st), sum(int((t > 0).sum()) for t in st.values())) for w, st in states.items()}
            llm.collective_rpc(worker_put_maps, args=(args, wire.encode_targets(learned), engines))
    if ranks is None:
        return learned
    if len(ranks) != len(replies):
        raise MapError(f"learned_targets: {len(ranks)} ranks for {len(replies)} vLLM workers")
    return {n: p.with_ranks(dict(enumerate(ranks))) for n, p in learned.items()}


class ReshardTrainerWeightTransferEngine(TrainerWeightTransferEngine[ReshardTrainerInitInfo]):
    init_info_cls = ReshardTrainerInitInfo

    def __init__(self, *, client: Any, source: ShardSource, info: ReshardTrainerInitInfo) -> None:
        super().__init__(client=client, source=source, is_sender=info.is_sender)
        self.info, self.me, self.shard_source = info, info.rank, source
        self.version = 0
        self.stats: dict[str, Any] = {}
        self.group: TransferGroup | None = None

    @classmethod
    def trainer_init(cls, init_info: ReshardTrainerInitInfo, *, client: Any, source: WeightSource | None = None
                     ) -> ReshardTrainerWeightTransferEngine:
        if not isinstance(source, ShardSource):
            raise TransferError("the reshard backend takes a ShardSource (maps and local shards), e.g. "
                                f"ShardSource.fsdp2(model); got {type(source).__name__}")
        info = init_info
        bad = sorted({r for m in source.maps.values() for r in m.ranks} - set(range(info.trainer_ranks)))
        if bad or not 0 <= info.rank < info.trainer_ranks:
            raise TransferError(f"trainer rank {info.rank}: source maps name ranks {bad[:4]} outside the "
                                f"{info.trainer_ranks} trainer ranks")
        eng = cls(client=client, source=source, info=info)
        t0 = time.perf_counter()
        rpc = _Rpc(client.init_weight_transfer_engine if eng.is_sender else None,
                   {"host": info.host, "port": info.port, "trainer_ranks": info.trainer_ranks,
                    "world_size": info.world_size, "timeout_s": info.timeout_s, "name": info.name})
        try:
            eng._rendezvous()
        except ReshardError as e:
            raise rpc.why(e) from e
        rpc.result()
        eng.stats = {"init_s": time.perf_counter() - t0}
        return eng

    def _rendezvous(self) -> None:
        info, src = self.info, self.shard_source
        T, W = info.trainer_ranks, info.world_size - info.trainer_ranks
        self.group = g = TransferGroup(info.host, info.port, self.me, info.world_size, timeout_s=info.timeout_s,
                                       name=info.name)
        setup = wire.Setup(src.shapes, src.maps, info.dtype)
        if self.me == 0:
            g.broadcast_bytes(setup.encode(), 0, "send the setup")
            cached = not g.failures(False, "agree on the cached maps")  # the workers say whether they lack them
            replies = {w: g.recv_bytes(T + w, f"receive worker {w}'s " + ("cached maps" if cached else "marker state"))
                       for w in range(W)}
            try:
                learned = _agreed(replies) if cached else learn_placed(
                    setup.shapes, {w: wire.decode_marker_reply(data, w) for w, data in replies.items()})
                msg = wire.encode_targets({n: p.with_ranks({w: T + w for w in range(W)}) for n, p in learned.items()})
            except ReshardError as e:
                msg = wire.encode_targets(None, str(e))
            got = g.broadcast_bytes(msg, 0, "send the targets")
        else:
            setup = wire.Setup.decode(g.broadcast_bytes(None, 0, "receive the setup"))
            g.failures(False, "agree on the cached maps")
            got = g.broadcast_bytes(None, 0, "receive the targets")
        self.targets = wire.decode_targets(got)
        self.dtype = wire.wire_dtype(setup.dtype)
        plan = plan_for_rank(setup.sources, {n: t.map for n, t in self.targets.items()}, self.me)
        self.sends, recvs = wire.link_program(plan, self.me)
        if recvs:
            raise MapError(f"trainer rank {self.me}: the plan has it receive from ranks {sorted(recvs)}")
        missing = sorted({n for link in self.sends.values() for n, _ in link.segments} - set(src.shards))
        if missing:
            raise MapError(f"trainer rank {self.me}: the plan sends from shards it does not hold: {missing[:4]}")
        self.outbox = {q: torch.empty(link.numel, dtype=self.dtype) for q, link in self.sends.items()}
        esize = self.dtype.itemsize
        # what the common path (whole tensors to every rank) sends each worker per update
        self.common_bytes_per_worker = sum(_numel(s) for s in src.shapes.values()) * esize

    def send_weights(self) -> None:
        g = self.group
        if g is None:
            raise TransferError("send_weights before trainer_init")
        src = self.shard_source
        version = self.version + 1
        t0 = time.perf_counter()
        if self.is_sender:
            self.client.start_weight_update()
        rpc = _Rpc(self.client.update_weights if self.is_sender else None, {"version": version})
        failed: str | None = None
        try:
            works = []
            if isinstance(src.shards, LazyShards):  # read after reshard.open checked it: what a read would refuse
                bad_reads = src.shards.problems(sorted({n for link in self.sends.values() for n, _ in link.segments}))
                if bad_reads:
                    raise TransferError(f"the checkpoint source cannot be read: {'; '.join(bad_reads)}")
            with torch.no_grad():
                for q, link in self.sends.items():
                    wire.pack(link, src.shards, self.outbox[q])
                    works.append(g.send(self.outbox[q], q, f"send to worker rank {q}"))
            g.wait(works, "send the update")
        except (ReshardError, RuntimeError) as e:
            failed = str(e)
        try:
            bad = g.failures(failed is not None, "agree on the update") if g.broken is None else [self.me]
        except TransferError as e:
            failed, bad = failed or str(e), [self.me]
        if bad:
            if self.is_sender:
                rpc.close(self.client, self.info.timeout_s)
            raise rpc.why(TransferError(f"reshard weight transfer: trainer rank {self.me}: update {version} failed "
                                        f"on rank(s) {bad} of the group (ranks {self.info.trainer_ranks}.. are "
                                        f"workers)" + (f": {failed}" if failed else "")))
        rpc.result()
        self.version = version
        if self.is_sender:
            self.client.finish_weight_update()
        self.stats.update(updates=version, send_s=time.perf_counter() - t0,
                          sent_bytes={q: t.numel() * t.element_size() for q, t in self.outbox.items()})

    def send_full_tensors(self, pairs) -> None:
        """The common path, for comparison only: ``pairs`` yields ``(name, whole tensor)`` in the
        source's order on every trainer rank (vLLM's ``ModuleSource``: FSDP2's ``full_tensor()``, a
        gather on every rank); rank 0 sends each whole tensor to every worker, whose model's
        ``load_weights`` takes it. A failure here may leave the engine half loaded."""
        g = self.group
        if g is None:
            raise TransferError("send_full_tensors before trainer_init")
        version = self.version + 1
        t0 = time.perf_counter()
        if self.is_sender:
            self.client.start_weight_update()
        rpc = _Rpc(self.client.update_weights if self.is_sender else None, {"version": version, "full": True})
        failed: str | None = None
        sent = 0
        try:
            with torch.no_grad():
                for _, t in pairs:
                    if self.is_sender:
                        wire_t = t.detach().to(self.dtype).contiguous()
                        g.wait([g.send(wire_t, q, "send a whole tensor") for q in range(self.info.trainer_ranks,
                                                                                      self.info.world_size)],
                               "send the update")
                        sent += wire_t.numel() * wire_t.element_size() * (self.info.world_size - self.info.trainer_ranks)
        except (ReshardError, RuntimeError) as e:
            failed = str(e)
        bad = g.failures(failed is not None, "agree on the update")
        if bad:
            raise TransferError(f"common path: update {version} failed on rank(s) {bad}: {failed}")
        rpc.result()
        self.version = version
        if self.is_sender:
            self.client.finish_weight_update()
        self.stats.update(updates=version, full_send_s=time.perf_counter() - t0, full_sent_bytes=sent)

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


def _agreed(replies: Mapping[int, bytes]) -> dict[str, Placed]:
    """The workers' cached maps, which must be one and the same (each worker keeps its own copy)."""
    maps = {w: wire.decode_cached_reply(data, w) for w, data in replies.items()}
    first = min(maps)
    for w, m in maps.items():
        if wire.encode_targets(m) != wire.encode_targets(maps[first]):
            raise MapError(f"vLLM workers {first} and {w} hold different cached maps for the same model; clear the "
                           f"reshard cache ({cache.cache_root()})")
    return maps[first]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class _Rpc:
    """A client call on a side thread (or nothing, off the sender), whose failure explains ours."""

    def __init__(self, fn, arg) -> None:
        self.future: Future | None = None
        if fn is not None:
            self._exe = ThreadPoolExecutor(max_workers=1)
            self.future = self._exe.submit(fn, arg)
            self._exe.shutdown(wait=False)  # never joined on failure: the RPC may not return

    def result(self) -> None:
        if self.future is not None:
            self.future.result()

    def close(self, client: Any, timeout_s: float) -> None:
        """After a failed update: once the engine has answered ``update_weights`` (within
        ``timeout_s``), end the update with ``finish_weight_update`` so the engine takes the next one;
        an engine that does not answer (a dead worker) is left as it is."""
        try:
            if self.future is not None:
                self.future.result(timeout=timeout_s)
            client.finish_weight_update()
        except Exception:  # noqa: BLE001 -- the update's own failure is what the caller raises
            pass

    def why(self, e: ReshardError) -> ReshardError:
        """``e``, naming the engine's error when the RPC already failed; of ``e``'s own class (a
        ``MapError`` stays one whether or not the engine's failed RPC came back first)."""
        f = self.future
        if f is not None and f.done() and f.exception() is not None:
            return with_cause(e, f"the engine reported: {f.exception()!r}")
        return e
