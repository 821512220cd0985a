"""A legacy ``--ckpt-format torch`` Megatron-LM checkpoint (docs/megatron-checkpoints.md §3.5),
written from any source the ``torch_dist`` writer takes: ``OUT/<tag>/`` holds
``latest_checkpointed_iteration.txt`` and ``iter_NNNNNNN/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt``,
one file per (TP, PP[, EP]) rank that Megatron-Core 0.19.2's ``save_checkpoint`` saves from (DP
rank 0 or expert-DP rank 0), each ``torch.save`` of that rank's state dict: ``args`` (the target's
topology, ``ckpt_format = 'torch'``, ``args.rank`` the saving rank), ``checkpoint_version``,
``iteration``, ``model`` (``model0``, ``model1``, ... with virtual stages) -- the stage's module
tensors under their local names (layers and experts counted from 0), ``_extra_state`` ``None``
after each linear module as the local spec saves it -- and ``num_floating_point_operations_so_far``.

With ``--optimizer adam`` (the default from a plain-Adam source) also ``optimizer`` -- plain Adam's
``state_dict()`` over the file's parameters, a chained ``[dense, experts]`` list with experts apart --
and the source's ``opt_param_scheduler``; with ``none`` the args say ``no_save_optim``. RNG states
only where the source is legacy files of the same ranks (each file's copied, checked); else
``no_save_rng`` (Megatron loads with ``--no-load-rng``). ``distrib_optim.pt`` and plain Adam
under mixed precision are refused by name before any output exists.
Each module tensor (and each moment) is one buffer whose map is the key's local map (``lowering.local_map``),
streamed by ``storage.torch_zip`` (one tensor in memory at a time).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from ...errors import ReshardError
from ...ir.param_map import ParamMap
from ...storage import torch_zip, verified
from ..contract import Buffer, Held, Reader, Writer
from . import safe
from .files import TRACKER
from .legacy import MODEL_FILE, LegacyBackend, _rank_dir
from .lowering import local_map
from .model import EMBED, OUTPUT, LocalParam
from .reader import MegatronReader
from .writer import MegatronWriter

__all__ = ["MegatronLegacyWriter", "megatron_writer"]

# the local spec's modules that save an ``_extra_state`` (None): its linear layers
_LINEARS = frozenset({"linear_proj", "linear_qkv", "linear_fc1", "linear_fc2", "linear_q_proj", "linear_q_down_proj",
                      "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj", "output_layer", "eh_proj"})
_KEPT = ("checkpoint_version", "num_floating_point_operations_so_far")  # of the source's, as they are


def _has_optimizer(reader: Reader) -> bool:
    return any(len(reader.states(n)) > 1 for n in reader.names)


class MegatronLegacyWriter(MegatronWriter):
    """The torch_dist writer's target (args, topology, names, vocabulary rows), laid out as legacy files."""

    keeps_replicas = False  # each file's copy of a replicated block is filled from the one merged copy

    def __init__(self, reader: Reader, *, optimizer: str | None = None, **options: Any) -> None:
        kind = self._kind(reader, optimizer)
        super().__init__(reader, optimizer=kind, **options)
        a = self.arch
        if a.mtp:  # the reader refuses legacy MTP (names unverified): the writer writes nothing it cannot read back
            raise ReshardError(f"--ckpt-format torch with {a.mtp} multi-token prediction layers: legacy files of MTP "
                               "layers are not written by reshard")
        if kind == "adam":
            if self.dtype != torch.float32:  # Megatron's fp16/bf16 optimizer wraps Adam with fp32 copies of its own
                raise ReshardError(f"--optimizer adam with --ckpt-format torch for {self.dtype} weights: the mixed-"
                                   "precision optimizer's legacy state (fp32_from_fp16_params) is not written by "
                                   "reshard; --optimizer none, or --ckpt-format torch_dist")
            if not isinstance((self.template or {}).get("opt_param_scheduler"), dict):
                raise ReshardError("--optimizer adam with --ckpt-format torch: the source records no learning-rate "
                                   "scheduler state (opt_param_scheduler), which Megatron loads beside the optimizer; "
                                   "--optimizer none")
            for o, groups in enumerate(self.groups):
                decays = [g.get("wd_mult", 1.0) != 0 for g in groups]
                if sorted(decays) != sorted(set(decays)):
                    raise ReshardError(f"--ckpt-format torch: the {'expert' if o else 'dense'} optimizer has "
                                       f"{len(groups)} parameter groups, not one with weight decay and one without: "
                                       "their legacy indices are not written by reshard")
        self.args = copy.copy(self.args)
        self._savers = self._saving_ranks()
        for k, v in dict(ckpt_format="torch", no_save_optim=kind == "none", no_save_rng=not self._same_ranks(),
                         use_distributed_optimizer=False, dist_ckpt_optim_fully_reshardable=False).items():
            setattr(self.args, k, v)
        self._moments: dict[tuple[str, str], Buffer] = {}  # (weight buffer key, state) -> buffer
        self._lmaps: dict[str, ParamMap] = {}
        for spec in a.keys():
            m, _ = local_map(a, spec)
            if spec.key in (EMBED, OUTPUT) and self.vocab_rows != m.logical_shape[0]:
                m = ParamMap(m.logical_shape, m.shards, (self.vocab_rows, *m.logical_shape[1:]))
            self._lmaps[spec.key] = m
            for state in ("weight",) + (() if spec.buffer else self.states):
                self._plan_key(spec.key, state, m)
        self._files = {key: self._file_buffers(key, x) for key, (_, x) in self._savers.items()}
        self._notes.append("legacy torch files, " + ("weights and plain Adam's moments (no RNG: Megatron loads them "
                           "with --no-load-rng)" if kind == "adam" else "weights only (args: no_save_optim, "
                           "no_save_rng): Megatron loads them with --no-load-optim --no-load-rng"))

    @staticmethod
    def _kind(reader: Reader, optimizer: str | None) -> str:
        """``none`` or plain ``adam`` (the default where the source holds plain Adam's state)."""
        if optimizer not in (None, "none", "adam"):
            raise ReshardError(f"--optimizer {optimizer} with --ckpt-format torch: the distributed optimizer's legacy "
                               "files (distrib_optim.pt) are not written by reshard; --optimizer adam (plain Adam), "
                               "none, or --ckpt-format torch_dist")
        if optimizer is not None:
            return optimizer
        own = reader.native("megatron")
        if not isinstance(own, MegatronReader) or not _has_optimizer(reader):
            return "none"
        if own.src.sharding != "adam":
            raise ReshardError(f"--ckpt-format torch: the source's optimizer is {own.src.sharding}, whose "
                               "legacy files (distrib_optim.pt) are not written by reshard; pass --optimizer adam "
                               "(plain Adam: its moments) or --optimizer none (weights only), or --ckpt-format "
                               "torch_dist")
        return "adam"

    # -- which files ---------------------------------------------------------------------------------
    def _saving_ranks(self) -> dict[tuple[int, int, int], tuple[int, int]]:
        """``{(TP, PP, EP): (global rank, its expert TP rank)}``: the ranks Megatron's
        ``save_checkpoint`` saves from (DP rank 0 or expert-DP rank 0), one file each."""
        a, out = self.arch, {}
        where: dict[int, tuple[int, int, int]] = {}  # global rank -> (expert TP, EP, expert DP)
        for pp in range(a.pp):
            for k in range(a.edp):
                for e in range(a.ep):
                    for x in range(a.etp):
                        where[a.expert_rank(x, e, k, pp)] = (x, e, k)
        for pp in range(a.pp):
            for d in range(a.dp):
                for t in range(a.tp):
                    r = a.rank(t, pp, d)
                    x, e, k = where.get(r, (t, 0, 0)) if a.experts else (t, 0, 0)
                    if d and k:
                        continue
                    old = out.setdefault((t, pp, e), (r, x))
                    if a.experts and old[1] != x:  # two savers of one file holding other expert TP parts
                        raise ReshardError(f"--ckpt-format torch at TP {a.tp}, expert TP {a.etp}, EP {a.ep}: global "
                                           f"ranks {old[0]} and {r} would both save {_rank_dir(t, pp, e, a)} with "
                                           "other experts' parts: not written by reshard")
        return dict(sorted(out.items()))

    def _name(self, lp: LocalParam) -> str:
        """Its name in its stage's (model chunk's) module: layers and experts counted from 0."""
        a, name = self.arch, lp.spec.local
        if lp.spec.layered:
            name = name.replace("{layer}", str(a.place(lp.spec.layer_at(lp.index))[2]))
        if lp.spec.expert:
            name = name.replace("{expert}", str(lp.index[-1] % (a.experts // a.ep)))
        return name

    def _module(self, pp: int, t: int, x: int, ep: int, vp: int) -> list[LocalParam]:
        """Model chunk ``vp`` of stage ``pp`` as TP rank ``t`` (expert TP rank ``x``, EP rank
        ``ep``) registers it: parameters and buffers, experts one after another."""
        a, out, keys = self.arch, [], self.arch.keys()
        if pp == 0 and vp == 0:
            out.append(a.local(keys[0], (), t))
        per = a.experts // a.ep if a.experts else 0
        for i in a.chunk_layers(pp, vp):
            specs = a.layer_keys(i)
            experts = [s for s in specs if s.expert]
            for s in specs:
                if not s.expert:
                    out.append(a.local(s, s.at(i), t))
                elif s is experts[0]:
                    out += [a.local(z, z.at(i, j), x) for j in range(ep * per, (ep + 1) * per) for z in experts]
        if pp == a.pp - 1 and vp == a.vpp - 1:
            out += [a.local(s, (), t) for s in keys if not s.layered and s.key != EMBED]
        return out

    def _file_buffers(self, key: tuple[int, int, int], x: int) -> list[list[tuple[str, Buffer | None, LocalParam | None]]]:
        """Per model chunk, ``(local name, buffer, local param)`` in module order; ``_extra_state``
        entries have no buffer."""
        tp, pp, ep = key
        rel = f"{self.folder}/{_rank_dir(tp, pp, ep, self.arch)}/{MODEL_FILE}"
        chunks = []
        for vp in range(self.arch.vpp):
            lps = self._module(pp, tp, x, ep, vp)
            at = f"{rel}:" if self.arch.vpp == 1 else f"{rel}:model{vp}."
            out: list[tuple[str, Buffer | None, LocalParam | None]] = []
            for n, lp in enumerate(lps):
                name = self._name(lp)
                slots = self._slots[(lp.spec.key, "weight")].get(lp.label, [])
                out.append((name, Buffer(f"{at}{name}", self._dtype("weight", lp.spec.key), lp.numel, tuple(slots)), lp))
                for state in () if lp.spec.buffer else self.states:  # plain Adam's moments: fp32, shaped as the module's
                    st = self._slots[(lp.spec.key, state)].get(lp.label, [])
                    self._moments[(f"{at}{name}", state)] = Buffer(f"{at}{name}@{state}", self._dtype(state), lp.numel,
                                                                   tuple(st))
                module = name.rsplit(".", 1)[0]
                following = self._name(lps[n + 1]).rsplit(".", 1)[0] if n + 1 < len(lps) else None
                if module.rsplit(".", 1)[-1] in _LINEARS and following != module:
                    out.append((f"{module}._extra_state", None, None))
            chunks.append(out)
        return chunks

    # -- the writer's contract ---------------------------------------------------------------------
    def buffers(self) -> list[Buffer]:
        return [b for chunks in self._files.values() for entries in chunks for _, b, _ in entries if b is not None] + \
            list(self._moments.values())

    def meta(self) -> dict[str, Any]:
        a = self.arch
        return {"target": "Megatron-Core legacy torch checkpoint" + (" (weights only)" if self.kind == "none" else ""),
                "optimizer": self.kind,
                "target_topology": {"tp": a.tp, "pp": a.pp, "dp": a.dp,
                                    **({"ep": a.ep, "etp": a.etp} if a.experts else {})}}

    def carries(self, held: Held) -> bool:
        kept = _KEPT + (("iteration",) if self.iteration is not None else ()) + \
            (("opt_param_scheduler",) if self.kind == "adam" else ())
        if held.key.startswith("rng_state"):
            return self._same_ranks()
        return self.template is not None and held.key.rpartition("/")[2] in kept

    def jobs(self, engine: Any, staging: Any) -> list[tuple[int, Callable[[], None]]]:
        jobs = [(sum(b.numel * b.dtype.itemsize * (1 + len(self.states)) for ch in chunks for _, b, _ in ch
                     if b is not None) + 1,
                 partial(self._write, engine, staging, key)) for key, chunks in self._files.items()]
        jobs.append((1, partial(self._tracker, staging)))
        return jobs

    def _tracker(self, staging: Any) -> None:
        with staging.open(TRACKER) as out:
            out.write(("release" if self.iteration is None else str(self.iteration)).encode())

    def _state(self, engine: Any, key: tuple[int, int, int]) -> dict[str, Any]:
        """The file's state dict, in ``generate_state_dict``'s order; tensors are placeholders
        the engine fills while the file is written."""
        args = copy.copy(self.args)
        args.rank = self._savers[key][0]
        sd: dict[str, Any] = {"args": args, "checkpoint_version": 3.0}
        if self.iteration is not None:
            sd["iteration"] = self.iteration
        chunks = self._files[key]
        for vp, entries in enumerate(chunks):
            model: OrderedDict[str, Any] = OrderedDict()
            for name, b, lp in entries:
                model[name] = None if b is None else engine.storage(b).view(lp.shape)  # type: ignore[union-attr]
            sd["model" if len(chunks) == 1 else f"model{vp}"] = model
        template = self.template or {}
        if self.kind == "adam":
            sd["optimizer"] = self._optimizer(engine, chunks)
            sd["opt_param_scheduler"] = template["opt_param_scheduler"]
        rng = self._rng(key)
        if rng is not None:
            sd["rng_state"] = rng
        sd["num_floating_point_operations_so_far"] = template.get("num_floating_point_operations_so_far", 0)
        if "checkpoint_version" in template:
            sd["checkpoint_version"] = template["checkpoint_version"]
        return sd

    def _same_ranks(self) -> bool:
        """Whether the source is legacy files of the target's TP, PP, DP, EP and expert TP: each
        rank's RNG states then stay its own (Megatron loads them where its ranks are the same)."""
        src = self.own.src if self.own is not None else None
        if not isinstance(src, LegacyBackend) or src.first.get("rng_state") is None:
            return False
        s, t = src.arch, self.arch
        return (s.tp, s.pp, s.dp, s.ep, s.etp) == (t.tp, t.pp, t.dp, t.ep, t.etp) and set(src.files) == set(self._savers)

    def _rng(self, key: tuple[int, int, int]) -> Any:
        """The source file's ``rng_state``, checked, where the ranks are the same (else none)."""
        src = self.own.src if self.own is not None else None
        if not isinstance(src, LegacyBackend) or not self._same_ranks():
            return None
        rng = src.state_dict(key).get("rng_state")
        stack = [rng]
        while stack:  # every tensor's record checked now: it is copied outside the engine's fills
            x = stack.pop()
            if isinstance(x, torch.Tensor):
                verified.ensure(x, f"{src.files[key]}: rng_state")
            elif isinstance(x, dict):
                stack += list(x.values())
            elif isinstance(x, (list, tuple)):
                stack += list(x)
        return rng

    def _optimizer(self, engine: Any, chunks: list) -> Any:
        """Plain Adam's ``state_dict()`` over the file's parameters (docs §3): indices through the
        decay group's parameters, then the others', in module order chunk after chunk; with experts
        apart a chained ``[dense, experts]`` list, each over its own parameters."""
        apart = self.arch.expert_apart
        params = [(b, lp) for entries in chunks for _, b, lp in entries if b is not None and not lp.spec.buffer]
        out = []
        for o, groups in enumerate(self.groups):
            mine = [(b, lp) for b, lp in params if not apart or lp.spec.expert == bool(o)]
            order = [p for p in mine if p[1].spec.decay] + [p for p in mine if not p[1].spec.decay]
            state = {i: {"step": torch.tensor(float(self.step)),
                         **{s: engine.storage(self._moments[(b.key, s)]).view(lp.shape) for s in self.states}}
                     for i, (b, lp) in enumerate(order)}
            decay = sum(lp.spec.decay for _, lp in mine)
            plain = [{k: v for k, v in g.items() if k not in ("params", "step")} for g in groups]
            out.append({"state": state, "param_groups": [
                dict(g, params=list(range(decay)) if g.get("wd_mult", 1.0) != 0 else list(range(decay, len(order))))
                for g in plain]})
        return out if apart else out[0]

    def _write(self, engine: Any, staging: Any, key: tuple[int, int, int]) -> None:
        rel = f"{self.folder}/{_rank_dir(*key, self.arch)}/{MODEL_FILE}"
        with staging.open(rel) as out:
            torch_zip.save(self._state(engine, key), out, pickler=safe.PICKLER)

    def finish(self, staging: Any, gather: Callable[[Any], list], rank: int) -> None:
        return None  # no index: each rank file stands alone


def megatron_writer(reader: Reader, *, ckpt_format: str | None = None, **options: Any) -> Writer:
    """The Megatron target in the format ``ckpt_format`` names (Megatron-LM's ``--ckpt-format``):
    ``torch_dist``, or ``torch`` (legacy files); by default a Megatron source's own, else ``torch_dist``."""
    if ckpt_format is None:
        own = reader.native("megatron")
        ckpt_format = own.loc.fmt if isinstance(own, MegatronReader) else "torch_dist"
    if ckpt_format == "torch":
        return MegatronLegacyWriter(reader, **options)
    if ckpt_format != "torch_dist":
        raise ReshardError(f"--ckpt-format must be torch_dist or torch, got {ckpt_format!r}")
    return MegatronWriter(reader, **options)
