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
and the source's ``opt_param_scheduler``; with ``none`` the args say ``no_save_optim``. With
``--optimizer distributed`` (alias ``dp_reshardable``; the default from a distributed-optimizer
source: Megatron's ``--use-distributed-optimizer``) ``optimizer`` is ``DistributedOptimizer.state_dict()``
(param groups with their step, no tensors) and a ``distrib_optim.pt`` beside the file holds what
``save_parameter_state`` gathers to DP rank 0 (``get_parameter_state_dp_zero``): per DDP buffer the
fp32 main parameters, ``exp_avg`` and ``exp_avg_sq`` over its buckets' unpadded parts back to back
(``buckets.flat_layout``; a chained ``[dense, experts]`` list with experts apart, ``None`` where the
saving rank is not rank 0 of that optimizer's DP group). RNG states only where the source is legacy
files of the same ranks (each file's copied, checked); else ``no_save_rng`` (Megatron loads with
``--no-load-rng``). Plain Adam under mixed precision, the distributed optimizer under fp16 or with
virtual stages are refused by name before any output exists.
Each module tensor (and each moment) is one buffer whose map is the key's local map (``lowering.local_map``),
streamed by ``storage.torch_zip`` (one tensor in memory at a time); a ``distrib_optim.pt`` flat
tensor is one buffer whose slots are its parameters' local maps at their flat offsets, streamed
window by window (gaps zero, as Megatron's gathered buffers hold them).
"""

from __future__ import annotations

import copy
import dataclasses
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
from .buckets import (
    bucket_layouts,
    bucket_size,
    copy_first,
    copy_name,
    dense_buffer_params,
    embedding_copy,
    flat_layout,
    shared_embedding,
)
from .common import buffer_dtype
from .files import TRACKER
from .legacy import MODEL_FILE, OPTIM_FILE, LegacyBackend, _rank_dir
from .lowering import local_map
from .model import EMBED, OUTPUT, LocalParam
from .reader import MegatronReader
from .writer import MegatronWriter

__all__ = ["MegatronLegacyWriter", "megatron_writer"]

# the local spec's modules that save an ``_extra_state`` (None): its linear layers
_LINEARS = frozenset({"linear_proj", "linear_qkv", "linear_fc1", "linear_fc2", "linear_q_proj", "linear_q_down_proj",
                      "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj", "output_layer", "eh_proj"})
_KEPT = ("checkpoint_version", "num_floating_point_operations_so_far")  # of the source's, as they are
_KEY = {"fp32": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}  # distrib_optim.pt's names


def _has_optimizer(reader: Reader) -> bool:
    return any(len(reader.states(n)) > 1 for n in reader.names)


class MegatronLegacyWriter(MegatronWriter):
    """The torch_dist writer's target (args, topology, names, vocabulary rows), laid out as legacy files."""

    keeps_replicas = False  # each file's copy of a replicated block is filled from the one merged copy

    def __init__(self, reader: Reader, *, optimizer: str | None = None, **options: Any) -> None:
        kind = self._kind(reader, optimizer)
        super().__init__(reader, optimizer=kind, **options)
        a = self.arch
        if kind in ("adam", "dp_reshardable") and not isinstance((self.template or {}).get("opt_param_scheduler"),
                                                                 dict):
            shown = "distributed" if kind == "dp_reshardable" else kind
            raise ReshardError(f"--optimizer {shown} with --ckpt-format torch: the source records no learning-rate "
                               "scheduler state (opt_param_scheduler), which Megatron loads beside the optimizer; "
                               "--optimizer none")
        if kind == "dp_reshardable":
            self._check_distributed()
            if self.dtype != torch.float32 and not any("fp32" in reader.states(n) for n in reader.names):
                self._notes.append(f"the source holds no fp32 main parameters: distrib_optim.pt's are its {self.dtype} "
                                   "weights, upcast (exact)")
        if kind == "adam":
            if self.dtype != torch.float32:  # Megatron's fp16/bf16 optimizer wraps Adam with fp32 copies of its own
                raise ReshardError(f"--optimizer adam with --ckpt-format torch for {self.dtype} weights: the mixed-"
                                   "precision optimizer's legacy state (fp32_from_fp16_params) is not written by "
                                   "reshard; --optimizer distributed, none, or --ckpt-format torch_dist")
            for o, groups in enumerate(self.groups):
                decays = [g.get("wd_mult", 1.0) != 0 for g in groups]
                if sorted(decays) != sorted(set(decays)):
                    raise ReshardError(f"--ckpt-format torch: the {'expert' if o else 'dense'} optimizer has "
                                       f"{len(groups)} parameter groups, not one with weight decay and one without: "
                                       "their legacy indices are not written by reshard")
        self.args = copy.copy(self.args)
        self._savers = self._saving_ranks()
        for k, v in dict(ckpt_format="torch", no_save_optim=_flag(self.args, "no_save_optim", kind == "none"),
                         no_save_rng=_flag(self.args, "no_save_rng", not self._same_ranks()),
                         use_distributed_optimizer=kind == "dp_reshardable",
                         dist_ckpt_optim_fully_reshardable=False).items():
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
        # per file, per optimizer (dense[, experts]): its distrib_optim.pt entry's flat buffers, or None
        self._flat: dict[tuple[int, int, int], list[dict[str, Buffer] | None]] = \
            self._flat_buffers() if kind == "dp_reshardable" else {}
        self._notes.append("legacy torch files, " + {
            "adam": "weights and plain Adam's moments",
            "dp_reshardable": "weights and the distributed optimizer's state (distrib_optim.pt: fp32 main parameters "
                              "and moments, gathered per DDP buffer)",
            "none": "weights only (args: no_save_optim): Megatron loads them with --no-load-optim"}[kind]
            + ("" if self._same_ranks() else "; no RNG states (args: no_save_rng): Megatron loads them with "
               "--no-load-rng"))

    @staticmethod
    def _kind(reader: Reader, optimizer: str | None) -> str:
        """``none``, plain ``adam`` or the distributed optimizer (``dp_reshardable``, alias
        ``distributed``); by default the source's (either distributed layout: the distributed one)."""
        if optimizer == "distributed":
            optimizer = "dp_reshardable"
        if optimizer not in (None, "none", "adam", "dp_reshardable"):
            raise ReshardError(f"--optimizer {optimizer} with --ckpt-format torch: legacy files hold plain Adam "
                               "(adam), Megatron's distributed optimizer (distributed: distrib_optim.pt) or none; "
                               f"{optimizer} is a torch_dist layout (--ckpt-format torch_dist)")
        if optimizer is not None:
            return optimizer
        own = reader.native("megatron")
        if not isinstance(own, MegatronReader) or not _has_optimizer(reader):
            return "none"
        return "adam" if own.src.sharding == "adam" else "dp_reshardable"

    def _check_distributed(self) -> None:
        """What the distributed optimizer's legacy files of this target would need that reshard
        does not write (each refused by name)."""
        a = self.arch
        if self.dtype == torch.float16:  # fp16 adds the grad scaler's state beside the param groups
            raise ReshardError("--optimizer distributed with --ckpt-format torch for torch.float16 weights: the "
                               "grad scaler's state (optimizer['grad_scaler']) is not written by reshard; --optimizer "
                               "none, or --ckpt-format torch_dist")
        if a.vpp > 1:  # a buffer per model chunk, which reshard's legacy reader does not read back
            raise ReshardError(f"--optimizer distributed with --ckpt-format torch at virtual pipeline size {a.vpp}: "
                               "legacy distrib_optim.pt buffers of virtual pipeline stages are not written by reshard; "
                               "--optimizer adam or none, another --pp (stages merged), or --ckpt-format torch_dist")

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
        elif embedding_copy(a, pp) and copy_first(a) and vp == a.vpp - 1:  # the MTP block's copy, registered first
            out.append(a.local(keys[0], (), t))
        per = a.experts // a.ep if a.experts else 0

        def block(specs: list, i: int) -> None:
            experts = [s for s in specs if s.expert]
            for s in specs:
                if not s.expert:
                    out.append(a.local(s, s.at(i), t))
                elif s is experts[0]:
                    out.extend(a.local(z, z.at(i, j), x) for j in range(ep * per, (ep + 1) * per) for z in experts)

        for i in a.chunk_layers(pp, vp):
            block(a.layer_keys(i), i)
        if pp == a.pp - 1 and vp == a.vpp - 1:  # final norm, the MTP layers (an MoE one's experts too), output
            block([s for s in keys if not s.layered and s.key != EMBED], 0)
            if embedding_copy(a, pp) and not copy_first(a):  # tied: the output layer's copy, registered last
                out.append(a.local(dataclasses.replace(keys[0], local=copy_name(a)), (), t))
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
                for state in () if lp.spec.buffer or self.kind != "adam" else self.states:  # plain Adam's: fp32
                    st = self._slots[(lp.spec.key, state)].get(lp.label, [])
                    self._moments[(f"{at}{name}", state)] = Buffer(f"{at}{name}@{state}", self._dtype(state), lp.numel,
                                                                   tuple(st))
                module = name.rsplit(".", 1)[0]
                following = self._name(lps[n + 1]).rsplit(".", 1)[0] if n + 1 < len(lps) else None
                if module.rsplit(".", 1)[-1] in _LINEARS and following != module:
                    out.append((f"{module}._extra_state", None, None))
            chunks.append(out)
        return chunks

    def _distributed_savers(self) -> dict[tuple[int, int, int], tuple[tuple[int, int] | None, tuple[int, int] | None]]:
        """``{(TP, PP, EP): (dense, experts)}``: what each file's ``distrib_optim.pt`` holds, as
        Megatron's ``save_parameter_state`` saves it from each rank of DP rank 0 or expert-DP
        rank 0 -- the dense buffer ``(TP rank, PP)`` where the rank is DP rank 0, the expert buffer
        ``(expert TP rank, EP rank)`` (experts apart) where it is expert-DP rank 0, else None."""
        a = self.arch
        out: dict[tuple[int, int, int], tuple[tuple[int, int] | None, tuple[int, int] | None]] = {}
        per = a.tp * a.dp
        for r in range(a.world):
            t, d, pp, s = r % a.tp, (r // a.tp) % a.dp, r // per, r % per
            x, e, k = s % a.etp, (s // a.etp) % a.ep, s // (a.etp * a.ep)  # the expert order tp-ep-dp
            if not a.expert_apart:
                x, e, k = t, 0, d
            if d and k:
                continue
            what = ((t, pp) if d == 0 else None, (x, e) if a.expert_apart and k == 0 else None)
            folder = (t, pp, e)
            old = out.setdefault(folder, what)
            if old != what:  # two ranks of one folder would save different distrib_optim.pt (Megatron: the last)
                raise ReshardError(f"--optimizer distributed with --ckpt-format torch at TP {a.tp}, DP {a.dp}, EP "
                                   f"{a.ep}, expert TP {a.etp}: two ranks would save {_rank_dir(*folder, a)}/"
                                   f"{OPTIM_FILE} with other buffers: not written by reshard")
        return out

    def _flat_buffers(self) -> dict[tuple[int, int, int], list[dict[str, Buffer] | None]]:
        """Per file, per optimizer, its ``distrib_optim.pt`` entry's ``param``/``exp_avg``/
        ``exp_avg_sq``: one fp32 buffer each over the DDP buffer's buckets' unpadded parts back to
        back, a slot per parameter at its flat offset (gaps: zeros). Checked first that the file
        reshard's (and Megatron's) reader takes each buffer from holds it."""
        a = self.arch
        saved = self._distributed_savers()
        if set(saved) != set(self._savers):  # every model_optim_rng.pt has its distrib_optim.pt, as Megatron saves them
            raise ReshardError(f"internal: distrib_optim.pt folders {sorted(saved)} differ from the model files' "
                               f"{sorted(self._savers)}")
        for pp in range(a.pp):  # the dense buffer from DP rank 0's file, the experts' from expert-DP rank 0's
            need = [((t, pp, (t // a.etp) % a.ep), 0, (t, pp)) for t in range(a.tp)]
            if a.expert_apart:
                need += [(((x + a.etp * e) % a.tp, pp, e), 1, (x, e)) for x in range(a.etp) for e in range(a.ep)]
            for folder, o, want in need:
                if folder not in saved or saved[folder][o] != want:
                    raise ReshardError(f"--optimizer distributed with --ckpt-format torch at TP {a.tp}, DP {a.dp}, EP "
                                       f"{a.ep}, expert TP {a.etp}: {_rank_dir(*folder, a)}/{OPTIM_FILE} would not hold "
                                       f"the {'expert' if o else 'dense'} buffer {want} its readers take from it: not "
                                       "written by reshard")
        out: dict[tuple[int, int, int], list[dict[str, Buffer] | None]] = {}
        for folder, what in saved.items():
            pp = folder[1]
            rel = f"{self.folder}/{_rank_dir(*folder, a)}/{OPTIM_FILE}"
            entries: list[dict[str, Buffer] | None] = []
            for o, w in enumerate(what[:2 if a.expert_apart else 1]):
                if w is None:
                    entries.append(None)
                    continue
                params = a.stage_params(pp, w[0], expert_rank=w[1]) if o else dense_buffer_params(a, pp, w[0])
                size = bucket_size(self.args, a, pp, 0, "target args")
                layout, unpadded = flat_layout(bucket_layouts(params, a.edp if o else a.dp, size, shared_embedding(a)))
                entries.append({state: Buffer(f"{rel}:{o}.{state}", torch.float32, unpadded, tuple(
                    dataclasses.replace(sl, offset=sl.offset + start) for lp, start, _ in layout
                    for sl in self._slots[(lp.spec.key, state)].get(lp.label, []))) for state in self.states})
            out[folder] = entries
        return out

    # -- the writer's contract ---------------------------------------------------------------------
    def buffers(self) -> list[Buffer]:
        return [b for chunks in self._files.values() for entries in chunks for _, b, _ in entries if b is not None] + \
            list(self._moments.values()) + [b for entries in self._flat.values() for e in entries if e is not None
                                            for b in e.values()]

    def meta(self) -> dict[str, Any]:
        a = self.arch
        return {"target": "Megatron-Core legacy torch checkpoint" + (" (weights only)" if self.kind == "none" else ""),
                "optimizer": self.kind,
                "target_topology": {"tp": a.tp, "pp": a.pp, "dp": a.dp,
                                    **({"ep": a.ep, "etp": a.etp} if a.experts else {})}}

    def carries(self, held: Held) -> bool:
        kept = _KEPT + (("iteration",) if self.iteration is not None else ()) + \
            (("opt_param_scheduler",) if self.kind != "none" else ())
        if held.key.startswith("rng_state"):
            return self._same_ranks()
        return self.template is not None and held.key.rpartition("/")[2] in kept

    def jobs(self, engine: Any, staging: Any) -> list[tuple[int, Callable[[], None]]]:
        moments = len(self.states) if self.kind == "adam" else 0
        jobs = [(sum(b.numel * b.dtype.itemsize * (1 + moments) for ch in chunks for _, b, _ in ch
                     if b is not None) + 1,
                 partial(self._write, engine, staging, key)) for key, chunks in self._files.items()]
        jobs += [(sum(b.numel * 4 for e in entries if e is not None for b in e.values()) + 1,
                  partial(self._write_distributed, engine, staging, key)) for key, entries in self._flat.items()]
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
        elif self.kind == "dp_reshardable":  # DistributedOptimizer.state_dict(): its groups, each with the step
            entries = [{"optimizer": {"param_groups": [
                dict({k: v for k, v in g.items() if k != "params"}, step=self.step) for g in groups]}}
                for groups in self.groups]
            sd["optimizer"] = entries if self.arch.expert_apart else entries[0]
        if self.kind != "none":
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

    def _write_distributed(self, engine: Any, staging: Any, key: tuple[int, int, int]) -> None:
        """``distrib_optim.pt``: ``get_parameter_state_dp_zero``'s dict per DDP buffer (a chained
        optimizer's ``[dense, experts]`` list with experts apart)."""
        dtypes = buffer_dtype(self.args)
        states: list[dict[Any, Any] | None] = []
        for entry in self._flat[key]:
            if entry is None:
                states.append(None)
                continue
            n = next(iter(entry.values())).numel
            world = {_KEY[s]: engine.storage(b).view((n,)) for s, b in entry.items()}
            states.append({"buckets_coalesced": True, 0: {dtypes: {**world, "numel_unpadded": n}}})
        rel = f"{self.folder}/{_rank_dir(*key, self.arch)}/{OPTIM_FILE}"
        with staging.open(rel) as out:
            torch_zip.save(states if self.arch.expert_apart else states[0], out, pickler=safe.PICKLER)

    def finish(self, staging: Any, gather: Callable[[Any], list], rank: int) -> None:
        return None  # no index: each rank file stands alone


def megatron_writer(reader: Reader, *, ckpt_format: str | None = None, **options: Any) -> Writer:
    """The Megatron target in the format ``ckpt_format`` names (Megatron-LM's ``--ckpt-format``):
    ``torch_dist``, or ``torch`` (legacy files); by default a Megatron source's own, else ``torch_dist``."""
    if options.get("optimizer") == "distributed":  # Megatron's --use-distributed-optimizer, the format's layout
        options["optimizer"] = "dp_reshardable"
    if ckpt_format is None:
        own = reader.native("megatron")
        ckpt_format = own.loc.fmt if isinstance(own, MegatronReader) else "torch_dist"
    if ckpt_format == "torch":
        return MegatronLegacyWriter(reader, **options)
    if ckpt_format != "torch_dist":
        raise ReshardError(f"--ckpt-format must be torch_dist or torch, got {ckpt_format!r}")
    return MegatronWriter(reader, **options)


def _flag(args: Any, name: str, on: bool) -> Any:
    """A ``store_true`` flag as Megatron saves it: ``True`` where the output needs it, else the
    source's own unset value (argparse's default ``None``), never a ``False`` Megatron would not write."""
    if on:
        return True
    was = getattr(args, name, None)
    return was if not was else None
