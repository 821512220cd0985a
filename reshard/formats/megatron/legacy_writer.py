"""A legacy ``--ckpt-format torch`` Megatron-LM checkpoint (docs/megatron-checkpoints.md §3.5),
written from any source the ``torch_dist`` writer takes: ``OUT/<tag>/`` holds
``latest_checkpointed_iteration.txt`` and ``iter_NNNNNNN/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt``,
one file per (TP, PP[, EP]) rank that Megatron-Core 0.19.2's ``save_checkpoint`` saves from (DP
rank 0 or expert-DP rank 0), each ``torch.save`` of that rank's state dict: ``args`` (the target's
topology, ``ckpt_format = 'torch'``, ``args.rank`` the saving rank), ``checkpoint_version``,
``iteration``, ``model`` (``model0``, ``model1``, ... with virtual stages) -- the stage's module
tensors under their local names (layers and experts counted from 0), ``_extra_state`` ``None``
after each linear module as the local spec saves it -- and ``num_floating_point_operations_so_far``.

Weights only: the args say ``no_save_optim`` and ``no_save_rng`` (Megatron loads it with
``--no-load-optim --no-load-rng``); optimizer state is refused by name before any output exists.
Each module tensor is one buffer whose map is the key's local map (``lowering.local_map``),
streamed by ``storage.torch_zip`` (one tensor in memory at a time).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable
from functools import partial
from typing import Any

from ...errors import ReshardError
from ...ir.param_map import ParamMap
from ...storage import torch_zip
from ..contract import Buffer, Held, Reader
from . import safe
from .files import TRACKER
from .legacy import MODEL_FILE, _rank_dir
from .lowering import local_map
from .model import EMBED, OUTPUT, LocalParam
from .writer import MegatronWriter

__all__ = ["MegatronLegacyWriter"]

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
        if optimizer not in (None, "none"):
            raise ReshardError(f"--optimizer {optimizer} with --ckpt-format torch: optimizer state in legacy files is "
                               "not written by reshard (weights only: --optimizer none; or --ckpt-format torch_dist)")
        if optimizer is None and reader.native("megatron") is not None and _has_optimizer(reader):
            raise ReshardError("--ckpt-format torch: the source's optimizer state is not written to legacy files by "
                               "reshard; pass --optimizer none to write the weights only (Megatron loads them with "
                               "--no-load-optim --no-load-rng), or --ckpt-format torch_dist to keep it")
        super().__init__(reader, optimizer="none", **options)
        a = self.arch
        if a.mtp:  # the reader refuses legacy MTP (names unverified): the writer writes nothing it cannot read back
            raise ReshardError(f"--ckpt-format torch with {a.mtp} multi-token prediction layers: legacy files of MTP "
                               "layers are not written by reshard")
        self.args = copy.copy(self.args)
        for k, v in dict(ckpt_format="torch", no_save_optim=True, no_save_rng=True, use_distributed_optimizer=False,
                         dist_ckpt_optim_fully_reshardable=False).items():
            setattr(self.args, k, v)
        self._savers = self._saving_ranks()
        self._lmaps: dict[str, ParamMap] = {}
        for spec in a.keys():
            m, _ = local_map(a, spec)
            if spec.key in (EMBED, OUTPUT) and self.vocab_rows != m.logical_shape[0]:
                m = ParamMap(m.logical_shape, m.shards, (self.vocab_rows, *m.logical_shape[1:]))
            self._lmaps[spec.key] = m
            self._plan_key(spec.key, "weight", m)
        self._files = {key: self._file_buffers(key, x) for key, (_, x) in self._savers.items()}
        self._notes.append("legacy torch files, weights only (args: no_save_optim, no_save_rng): Megatron loads them "
                           "with --no-load-optim --no-load-rng")

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
                module = name.rsplit(".", 1)[0]
                following = self._name(lps[n + 1]).rsplit(".", 1)[0] if n + 1 < len(lps) else None
                if module.rsplit(".", 1)[-1] in _LINEARS and following != module:
                    out.append((f"{module}._extra_state", None, None))
            chunks.append(out)
        return chunks

    # -- the writer's contract ---------------------------------------------------------------------
    def buffers(self) -> list[Buffer]:
        return [b for chunks in self._files.values() for entries in chunks for _, b, _ in entries if b is not None]

    def meta(self) -> dict[str, Any]:
        a = self.arch
        return {"target": "Megatron-Core legacy torch checkpoint (weights only)", "optimizer": "none",
                "target_topology": {"tp": a.tp, "pp": a.pp, "dp": a.dp,
                                    **({"ep": a.ep, "etp": a.etp} if a.experts else {})}}

    def carries(self, held: Held) -> bool:
        return self.template is not None and held.key.rpartition("/")[2] in _KEPT

    def jobs(self, engine: Any, staging: Any) -> list[tuple[int, Callable[[], None]]]:
        jobs = [(sum(b.numel * b.dtype.itemsize for ch in chunks for _, b, _ in ch if b is not None) + 1,
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
        sd["num_floating_point_operations_so_far"] = template.get("num_floating_point_operations_so_far", 0)
        if "checkpoint_version" in template:
            sd["checkpoint_version"] = template["checkpoint_version"]
        return sd

    def _write(self, engine: Any, staging: Any, key: tuple[int, int, int]) -> None:
        rel = f"{self.folder}/{_rank_dir(*key, self.arch)}/{MODEL_FILE}"
        with staging.open(rel) as out:
            torch_zip.save(self._state(engine, key), out, pickler=safe.PICKLER)

    def finish(self, staging: Any, gather: Callable[[Any], list], rank: int) -> None:
        return None  # no index: each rank file stands alone
