"""The worker side of vLLM's weight-transfer backend "reshard" (registered by ``plugin.py``; this
module imports vLLM and is imported only inside vLLM's processes).

Init (:meth:`ReshardWeightTransferEngine.init_transfer_engine`): the worker joins the transfer
group at rank ``trainer_ranks + its vLLM world rank``, receives the setup (``wire.py``), builds a
float32 copy of its model class and loads a unique marker per element with the model's own
``load_weights`` (vLLM's loaders: fused ``qkv_proj`` / ``gate_up_proj``, replicated key/value
heads, padded vocabularies -- whatever the class does), sends what landed to trainer rank 0, and
gets back every parameter's placement; then it plans its receives and allocates one staging
tensor per engine tensor it holds (the engine dtype; padding stays zero). What was learned is
cached per (model class, config, parallel sizes, vLLM version, parameter shapes) in the process
and on disk (``cache.py``): when every worker holds an entry for its key (one agreement over the
group), they send their cached maps instead and no marker model is built.

Update: ``start_weight_update`` enters vLLM's layerwise-reload lifecycle
(``initialize_layerwise_reload``: the loadable parameters are restored, the kernels' copies kept);
``receive_weights`` receives exactly this worker's bytes into staging (one message per trainer
rank that holds any), then every rank of the group reports success or failure. Only when every
rank succeeded does it load: each engine tensor is handed to the reload lifecycle's loader whole
(a plain copy of its staging), so vLLM buffers it, materializes the layer and runs the layer's
post-processing again (on CPU: the linears' repacking); ``finish_weight_update`` runs
``finalize_layerwise_reload``. When any rank failed (a trainer or worker died, or the timeout
passed), nothing is loaded: the worker finalizes the reload at once, which puts the kernels'
own tensors back, so **the engine keeps serving the weights of the last update that succeeded**;
it logs the failure and returns (the trainer ranks raise :class:`~reshard.errors.TransferError`;
see ``receive_weights`` for why the worker does not), and the sender still closes the update
with ``finish_weight_update`` when the engine answers.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from ...errors import MapError, ReshardError, TransferError
from ...execute.group import TransferGroup
from ...layouts.learned import markers
from ...plan.planner import plan_for_rank
from . import cache, wire

__all__ = ["ReshardUpdateInfo", "ReshardWeightTransferEngine", "ReshardWorkerInitInfo", "maps_key", "marker_state",
           "worker_maps_reply", "worker_marker_state", "worker_put_maps"]

_log = logging.getLogger(__name__)


@dataclass
class ReshardWorkerInitInfo(WeightTransferInitInfo):
    """Where the transfer group is and how large: trainer rank 0 hosts its store at ``host:port``;
    ``trainer_ranks`` trainer ranks and ``world_size`` ranks in all."""

    host: str
    port: int
    trainer_ranks: int
    world_size: int
    timeout_s: float = 120.0
    name: str = "reshard"


@dataclass
class ReshardUpdateInfo(WeightTransferUpdateInfo):
    """The update's number (1, 2, ...): both sides count, so a lost round is noticed. ``full``: the
    common path instead, for comparison (``send_full_tensors``): trainer rank 0 sends every whole
    tensor to every worker, which hands each to the model's ``load_weights`` as it lands."""

    version: int
    full: bool = False


def _copy_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """What the reload lifecycle replays for an engine tensor received whole: a copy."""
    param.data.copy_(loaded_weight)


def marker_state(vllm_config, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """What this rank's model class places of a marker per element of the parameters ``shapes``
    (``layouts.learned.markers``), by engine tensor name, before post-processing: a float32 copy of
    the model built on this worker, loaded with its own ``load_weights``, then dropped."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    forward = vllm_config.compilation_config.static_forward_context
    before = set(forward)
    try:
        with set_current_vllm_config(vllm_config), set_default_torch_dtype(torch.float32), torch.device("cpu"):
            # its own prefix: its attention layers register apart from the live model's
            m = initialize_model(vllm_config=vllm_config, prefix="reshard_markers")
            m.load_weights(iter(markers(shapes).items()))
        state = ShardedStateLoader._filter_subtensors(m.state_dict())
        return {n: t.detach().to(torch.float32) for n, t in state.items() if t.dim() > 0}
    finally:
        for k in set(forward) - before:
            del forward[k]


def worker_marker_state(worker, shapes: dict[str, list[int]]) -> bytes:
    """:func:`marker_state` on a vLLM worker, for ``LLM.collective_rpc`` (``wire.encode_tensors``)."""
    return wire.encode_tensors(marker_state(worker.vllm_config, {n: tuple(s) for n, s in shapes.items()}))


def maps_key(vllm_config, shapes: dict[str, tuple[int, ...]]) -> cache.MapsKey:
    """The cache key of the maps vLLM's loaders give ``shapes`` on this engine (``cache.MapsKey``)."""
    import vllm
    from vllm.model_executor.model_loader.utils import get_model_architecture

    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    model_cls, _ = get_model_architecture(mc)
    tp, dp = pc.tensor_parallel_size, pc.data_parallel_size
    return cache.MapsKey(model_cls.__name__, cache.config_digest(mc.hf_config.to_dict()), str(mc.quantization),
                         tp, pc.pipeline_parallel_size, dp, tp * dp if pc.enable_expert_parallel else 1,
                         vllm.__version__, cache.shapes_digest(shapes))


def _vllm_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def worker_maps_reply(worker, shapes: dict[str, list[int]], use_cache: bool = True) -> bytes:
    """For ``LLM.collective_rpc`` (``trainer.learned_targets``): this worker's cached entry
    (``wire.encode_cached_reply``) where it has one and ``use_cache``, else its marker state."""
    full = {n: tuple(s) for n, s in shapes.items()}
    hit = cache.get(maps_key(worker.vllm_config, full), _vllm_rank(), full) if use_cache else None
    if hit is not None:
        return wire.encode_cached_reply(hit.maps)
    return wire.encode_marker_reply(marker_state(worker.vllm_config, full))


def worker_put_maps(worker, shapes: dict[str, list[int]], targets: bytes,
                    engines: dict[int, tuple[list[str], int]]) -> str:
    """For ``LLM.collective_rpc``: keep the maps ``targets`` (``wire.encode_targets``, workers
    ``0..W-1``) learned from the workers' marker states as this worker's cache entry, with its
    engine tensors and placed element count (``engines[w]``, read from its marker state); only
    where the maps fill every one of those tensors (what ``init_transfer_engine`` checks).
    Returns where it went (a path, ``"memory"``, or why not)."""
    full = {n: tuple(s) for n, s in shapes.items()}
    me = _vllm_rank()
    names, placed = engines[me]
    maps = wire.decode_targets(targets)
    if set(names) - {p.into for p in maps.values() if me in p.shapes}:
        return "not kept: engine tensors no parameter fills"
    path = cache.put(maps_key(worker.vllm_config, full), me, cache.CachedMaps(maps, tuple(names), placed))
    return str(path) if path is not None else "memory"


class ReshardWeightTransferEngine(WeightTransferEngine[ReshardWorkerInitInfo, ReshardUpdateInfo]):
    init_info_cls = ReshardWorkerInitInfo
    update_info_cls = ReshardUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: TransferGroup | None = None
        self.version = 0
        self.stats: dict[str, Any] = {}
        self._restore: list[tuple[torch.Tensor, Any]] = []
        self._reloading = False

    # -- init -------------------------------------------------------------------------------------

    def init_transfer_engine(self, init_info: ReshardWorkerInitInfo) -> None:
        vworld = dist.get_world_size() if dist.is_initialized() else 1
        vrank = dist.get_rank() if dist.is_initialized() else 0
        if init_info.trainer_ranks + vworld != init_info.world_size:
            raise TransferError(f"reshard weight transfer: {init_info.trainer_ranks} trainer ranks and {vworld} "
                                f"vLLM workers, but world_size={init_info.world_size}")
        self.me = init_info.trainer_ranks + vrank
        t0 = time.perf_counter()
        self.group = g = TransferGroup(init_info.host, init_info.port, self.me, init_info.world_size,
                                       timeout_s=init_info.timeout_s, name=init_info.name)
        setup = wire.Setup.decode(g.broadcast_bytes(None, 0, "receive the setup"))
        self.dtype = wire.wire_dtype(setup.dtype)
        self.full_shapes = setup.shapes
        key: cache.MapsKey | None = None
        hit: cache.CachedMaps | None = None
        try:  # before the agreement: a rank that raised here would leave the others waiting in it
            key = maps_key(self.vllm_config, setup.shapes)
            hit = cache.get(key, vrank, setup.shapes)
        except Exception as e:  # noqa: BLE001 -- without a key the maps are learned and not kept
            _log.warning("reshard weight transfer: no cache key for this engine: %s", e)
        # every worker must hold an entry, else all learn (rank 0 learns from all marker states)
        missing = g.failures(hit is None, "agree on the cached maps")
        if missing or hit is None:
            hit = None
            try:
                marked = marker_state(self.vllm_config, setup.shapes)
            except Exception as e:  # vLLM's loader refused a name or shape: rank 0 tells every rank
                g.send_bytes(wire.encode_marker_reply(None, f"{type(e).__name__}: {e}"), 0, "send the marker state")
                g.broadcast_bytes(None, 0, "receive the targets")
                raise MapError(f"reshard weight transfer: worker rank {self.me}: vLLM's loader could not load the "
                               f"trainer's parameters: {type(e).__name__}: {e}") from e
            g.send_bytes(wire.encode_marker_reply(marked), 0, "send the marker state")
            engine_tensors = tuple(sorted(marked))
        else:
            g.send_bytes(wire.encode_cached_reply(hit.maps), 0, "send the cached maps")
            engine_tensors = hit.engine_tensors
        self.targets = wire.decode_targets(g.broadcast_bytes(None, 0, "receive the targets"))
        plan = plan_for_rank(setup.sources, {n: t.map for n, t in self.targets.items()}, self.me)
        _, self.recvs = wire.link_program(plan, self.me)
        self.shapes = {t.into: tuple(t.shapes[self.me]) for t in self.targets.values() if self.me in t.shapes}
        unfilled = sorted(set(engine_tensors) - set(self.shapes))
        if unfilled:  # a layer loaded in part would be post-processed with uninitialized elements
            raise MapError(f"reshard weight transfer: worker rank {self.me}: engine tensors no trainer parameter "
                           f"fills: {unfilled[:5]}")
        if hit is None:
            placed = sum(int((t > 0).sum()) for n, t in marked.items() if n in self.shapes)
            relabel = {init_info.trainer_ranks + w: w for w in range(vworld)}
            if key is not None:
                cache.put(key, vrank, cache.CachedMaps({n: p.with_ranks(relabel) for n, p in self.targets.items()},
                                                       engine_tensors, placed))
        else:
            placed = hit.placed_elements
        # padding (a padded vocabulary's rows) is never sent: zero once, here
        self.staging = {n: torch.zeros(s, dtype=self.dtype) for n, s in self.shapes.items()}
        self.inbox = {q: torch.empty(link.numel, dtype=self.dtype) for q, link in self.recvs.items()}
        self.stats = {"rank": self.me, "init_s": time.perf_counter() - t0, "marked_elements": placed,
                      "maps_from": "learned" if hit is None else hit.source,
                      "maps_key": key.digest if key is not None else None,
                      "maps_digest": cache.maps_digest(self.targets), "engine_tensors": len(self.shapes), "updates": 0}

    # -- update -----------------------------------------------------------------------------------

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        self._reloading = True

    def receive_weights(self, update_info: ReshardUpdateInfo) -> None:
        g = self.group
        if g is None:
            raise TransferError("reshard weight transfer: receive before init_transfer_engine")
        t0 = time.perf_counter()
        failed = None
        try:
            if update_info.full:
                self._receive_full(g)
            else:
                works = [g.recv(self.inbox[q], q, f"receive from trainer rank {q}") for q in self.recvs]
                g.wait(works, "receive the update")
            if update_info.version != self.version + 1:  # received all the same, so no sender waits
                failed = f"update {update_info.version} arrived after update {self.version}"
            elif not update_info.full:
                for q, link in self.recvs.items():
                    wire.unpack(link, self.inbox[q], self.targets, self._flat, self.me)
        except (ReshardError, RuntimeError) as e:
            failed = str(e)
        try:
            bad = g.failures(failed is not None, "agree on the update") if g.broken is None else [self.me]
        except TransferError as e:
            failed, bad = failed or str(e), [self.me]
        if bad:
            # Not raised: vLLM 0.32's multiprocess executor stops reading replies at the first worker that
            # raises, and the next RPC then reads the other workers' stale replies. The trainer raises
            # TransferError for the update; here it is logged and counted.
            self._abandon()
            why = (f"reshard weight transfer: worker rank {self.me}: update {update_info.version} failed on rank(s) "
                   f"{bad} of the group; nothing loaded, the engine serves the weights of update {self.version}"
                   + (f" ({failed})" if failed else ""))
            _log.error(why)
            self.stats.update(failed_updates=self.stats.get("failed_updates", 0) + 1, last_error=why)
            return
        received = time.perf_counter()
        if not update_info.full:
            self._load()
        self.version += 1
        got = self._full_bytes if update_info.full else sum(t.numel() * t.element_size() for t in self.inbox.values())
        self.stats.update(updates=self.version, received_bytes=got, receive_s=received - t0,
                          load_s=time.perf_counter() - received)

    def _receive_full(self, g: TransferGroup) -> None:
        """The common path: every whole tensor from trainer rank 0, loaded as it lands."""
        self._full_bytes = 0
        for name, shape in self.full_shapes.items():
            t = torch.empty(shape, dtype=self.dtype)
            g.wait([g.recv(t, 0, f"receive {name}")], "receive the update")
            self.model.load_weights([(name, t)])
            self._full_bytes += t.numel() * t.element_size()

    @property
    def _flat(self) -> dict[str, torch.Tensor]:
        return {n: t.reshape(-1) for n, t in self.staging.items()}

    def _load(self) -> None:
        """Every staged engine tensor through the reload lifecycle's loaders, whole (module doc)."""
        from vllm.model_executor.model_loader.reload.layerwise import initialize_online_processing

        modules = dict(self.model.named_modules())
        by_layer: dict[str, list[str]] = {}
        for name in self.staging:
            layer, _, attr = name.rpartition(".")
            by_layer.setdefault(layer, []).append(attr)
        for layer_name, attrs in by_layer.items():
            layer = modules[layer_name]
            for attr in attrs:
                t = getattr(layer, attr)
                self._restore.append((t, getattr(t, "weight_loader", None)))
                t.weight_loader = _copy_loader
            initialize_online_processing(layer)  # wraps the copy loaders as it wraps vLLM's
            for attr in attrs:
                t = getattr(layer, attr)
                t.weight_loader(t, self.staging[f"{layer_name}.{attr}" if layer_name else attr])

    def _abandon(self) -> None:
        """Leave the reload without loading anything: the kernels' own tensors go back."""
        if self._reloading:
            self.finish_weight_update()

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        try:
            finalize_layerwise_reload(self.model, self.model_config)
        finally:
            self._reloading = False
            for t, loader in self._restore:
                if loader is None:
                    t.__dict__.pop("weight_loader", None)
                else:
                    setattr(t, "weight_loader", loader)  # noqa: B010 (a plain attribute vLLM reads)
            self._restore = []

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
