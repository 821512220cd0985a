"""A legacy ``--ckpt-format torch`` iteration folder (docs/megatron-checkpoints.md §3): one
``mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` per (TP, PP[, EP]) rank holding that rank's local
state dict, plain Adam's states by index, and with the distributed optimizer a ``distrib_optim.pt``
beside it (each stage's buffer gathered over DP: its buckets' unpadded parts back to back,
``buckets.py``).

With expert parallelism (``_EEE``: the EP rank) the ranks that save are those of DP rank 0 or of
expert-DP rank 0 (Megatron's ``save_checkpoint``): each file holds its rank's dense TP part and its
EP rank's experts, and plain Adam is a chained optimizer, ``optimizer = [dense, experts]``. A dense
TP part is read from the file of DP rank 0, an expert from the file of expert-DP rank 0.

Each local tensor is a local parameter of its key (``lowering.local_map``), so a key's map is its
local map: the legacy files' shards are exactly Megatron's module tensors, mapped from the files.
"""

from __future__ import annotations

import re
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from ...errors import CheckpointError
from ...storage import verified
from . import safe
from .buckets import (
    bucket_layouts,
    bucket_size,
    copy_name,
    dense_buffer_params,
    embedding_copy,
    flat_layout,
    shared_embedding,
)
from .files import LEGACY_RANK
from .grouped import TE_GROUPED, te_grouped
from .lowering import Lowered, local_map
from .model import EMBED, Arch, KeySpec, LocalParam

__all__ = ["LegacyBackend"]

MODEL_FILE, OPTIM_FILE = "model_optim_rng.pt", "distrib_optim.pt"
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def _rank_dir(tp: int, pp: int, ep: int, arch: Arch) -> str:
    """Megatron's ``get_checkpoint_name``: the PP rank when PP > 1, the EP rank when EP > 1."""
    return f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if arch.pp > 1 else "") + (f"_{ep:03d}" if arch.ep > 1 else "")


class LegacyBackend:
    """The local tensors of every (TP, PP) rank, their optimizer states, and the run's args."""

    def __init__(self, iter_dir: Path) -> None:
        self.dir = iter_dir
        found = sorted(p for p in iter_dir.iterdir() if LEGACY_RANK.match(p.name))
        if not found:
            raise CheckpointError(f"{iter_dir}: no mp_rank_* folders")
        first = found[0] / MODEL_FILE
        self.first = safe.load_file(first)
        if not isinstance(self.first, dict) or "args" not in self.first:
            raise CheckpointError(f"{first}: not a Megatron model_optim_rng.pt (no 'args')")
        self.args = self.first["args"]
        self.arch = Arch.from_args(self.args, f"{first}: args")
        self.distopt = bool(getattr(self.args, "use_distributed_optimizer", False))
        # --no-save-optim (and reshard's weights-only legacy target): no optimizer entry, the weights alone
        self.optim = self.first.get("optimizer") is not None
        if te_grouped(self.args):  # linear_fc1.weight<i> per local expert, not local_experts.<i>.linear_fc1.weight
            raise CheckpointError(f"{first}: args.moe_grouped_gemm = True (transformer_impl "
                                  f"{getattr(self.args, 'transformer_impl', None)!r}): legacy files of {TE_GROUPED} "
                                  "are not read by reshard")
        if self.arch.vpp > 1 and self.distopt:
            raise CheckpointError(f"{first}: args.virtual_pipeline_model_parallel_size = {self.arch.vpp} with the "
                                  "distributed optimizer: legacy distrib_optim.pt buffers of virtual pipeline stages are "
                                  "not read by reshard")
        self.sharding = "dp_reshardable" if self.distopt else "adam"
        a = self.arch
        # (TP, PP, EP) of every file read: the dense parts' (DP rank 0) and the experts' (expert-DP rank 0)
        keys = {self._dense_key(t, pp) for pp in range(a.pp) for t in range(a.tp)}
        if a.experts:
            keys |= {self._expert_key(x, e, pp) for pp in range(a.pp) for x in range(a.etp) for e in range(a.ep)}
        self.files: dict[tuple[int, int, int], Path] = {}
        for tp, pp, ep in sorted(keys):
            f = iter_dir / _rank_dir(tp, pp, ep, a) / MODEL_FILE
            if not f.is_file():
                raise CheckpointError(f"{f}: file is missing (TP rank {tp}, PP rank {pp}"
                                      + (f", EP rank {ep}" if a.ep > 1 else "") + f" of {a.tp} x {a.pp}"
                                      + (f" x EP {a.ep}" if a.ep > 1 else "") + ")")
            self.files[(tp, pp, ep)] = f
        self._sd: dict[tuple[int, int, int], dict] = {}
        self._local: dict = {}

    # -- which file --------------------------------------------------------------------------------
    def _dense_key(self, tp: int, pp: int) -> tuple[int, int, int]:
        """The file of TP rank ``tp``'s dense part: global rank ``tp`` of the stage (DP rank 0),
        whose EP rank Megatron's expert order ``tp-ep-dp`` gives."""
        return (tp, pp, (tp // self.arch.etp) % self.arch.ep)

    def _expert_key(self, x: int, e: int, pp: int) -> tuple[int, int, int]:
        """The file of expert TP rank ``x``, EP rank ``e`` (expert-DP rank 0): global rank
        ``x + etp * e`` of the stage, whose TP rank is that rank modulo TP."""
        return ((x + self.arch.etp * e) % self.arch.tp, pp, e)

    def _ep_rank(self, lp: LocalParam) -> int:
        return lp.index[-1] // (self.arch.experts // self.arch.ep)

    def _key_of(self, lp: LocalParam) -> tuple[int, int, int]:
        pp = self.arch.stage_of(lp.spec, lp.index)
        return self._expert_key(lp.tp, self._ep_rank(lp), pp) if lp.spec.expert else self._dense_key(lp.tp, pp)

    def state_dict(self, key: tuple[int, int, int]) -> dict:
        sd = self._sd.get(key)
        if sd is None:
            f = self.files[key]
            sd = self.first if key == min(self.files) else safe.load_file(f)
            if not isinstance(sd, dict) or not all(isinstance(sd.get(k), dict) for k in self._model_keys):
                raise CheckpointError(f"{f}: not a Megatron model_optim_rng.pt (no {' / '.join(self._model_keys)} "
                                      "state dict)")
            if (sd.get("optimizer") is not None) != self.optim:  # one file's optimizer state would be left unread
                first = self.files[min(self.files)]
                raise CheckpointError(f"{f}: {'holds' if not self.optim else 'has no'} optimizer state, {first} "
                                      f"{'none' if not self.optim else 'holds it'}: files of different saves mixed")
            self._saved_by(f, sd, *key)
            self._sd[key] = sd
        return sd

    def _saved_by(self, f: Path, sd: dict, tp: int, pp: int, ep: int) -> None:
        """The file's ``args.rank`` (the global rank that saved it) must be of the TP and PP (and EP)
        rank its folder names: Megatron's rank order keeps TP innermost, then CP, then DP and PP
        (or PP and DP with ``use_tp_pp_dp_mapping``); the expert order ``tp-ep-dp-pp``. Two
        same-shaped rank files swapped are refused."""
        args = sd.get("args")
        rank = getattr(args, "rank", None)
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            return
        t, p = self.arch.tp, self.arch.pp
        cp = getattr(args, "context_parallel_size", 1)
        dp = getattr(args, "data_parallel_size", None)
        if not isinstance(cp, int) or cp < 1:
            cp = 1
        if getattr(args, "use_tp_pp_dp_mapping", False):
            want_pp: int | None = rank // (t * cp) % p
        else:
            want_pp = rank // (t * cp * dp) if isinstance(dp, int) and dp > 0 else None
        want_ep = None
        if self.arch.ep > 1 and cp == 1 and isinstance(dp, int) and dp > 0 and not getattr(args, "use_tp_pp_dp_mapping",
                                                                                             False):
            want_ep = (rank % (t * dp) // self.arch.etp) % self.arch.ep
        if rank % t != tp or (want_pp is not None and want_pp != pp) or (want_ep is not None and want_ep != ep):
            saved = (f"TP rank {rank % t}" + (f", PP rank {want_pp}" if want_pp is not None else "")
                     + (f", EP rank {want_ep}" if want_ep is not None else ""))
            raise CheckpointError(f"{f}: saved by global rank {rank} ({saved}), but it lies in the folder of TP rank "
                                  f"{tp}, PP rank {pp}" + (f", EP rank {ep}" if self.arch.ep > 1 else "")
                                  + ": rank files swapped or misplaced")

    @property
    def _model_keys(self) -> list[str]:
        """The state dicts of a file: ``model``, or one per model chunk (virtual stages)."""
        return ["model"] if self.arch.vpp == 1 else [f"model{v}" for v in range(self.arch.vpp)]

    def _chunk_of(self, lp: LocalParam) -> int:
        if lp.spec.layered:
            return self.arch.place(lp.spec.layer_at(lp.index))[1]
        return 0 if lp.spec.key == EMBED else self.arch.vpp - 1

    # -- names -----------------------------------------------------------------------------------
    def _local_name(self, lp: LocalParam) -> str:
        name = lp.spec.local
        if lp.spec.layered:  # the stage's module counts its layers from 0
            name = name.replace("{layer}", str(self.arch.place(lp.spec.layer_at(lp.index))[2]))
        if lp.spec.expert:  # the EP rank's module counts its experts from 0
            name = name.replace("{expert}", str(lp.index[-1] % (self.arch.experts // self.arch.ep)))
        return name

    def tensor(self, lp: LocalParam) -> torch.Tensor:
        """The module tensor of local parameter ``lp``, checked against its shape and dtype."""
        pp, key = self.arch.stage_of(lp.spec, lp.index), self._key_of(lp)
        f, name = self.files[key], self._local_name(lp)
        t = self.state_dict(key)[self._model_keys[self._chunk_of(lp)]].get(name)
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"{f}: model has no tensor {name!r} ({lp.spec.key}{list(lp.index)}, TP rank {lp.tp})")
        if tuple(t.shape) != lp.shape:
            raise CheckpointError(f"{f}: {name} (TP rank {lp.tp}, PP rank {pp}) is {list(t.shape)}, args imply "
                                  f"{list(lp.shape)}")
        return t

    @cached_property
    def dtype(self) -> torch.dtype:
        return self.tensor(self.arch.local(self.arch.keys()[0], (), 0)).dtype

    # -- optimizer -------------------------------------------------------------------------------
    def _optimizer(self, key: tuple[int, int, int], experts: bool) -> dict:
        """A file's plain Adam state dict: the dense one's, or (``experts``, when they are apart)
        the expert optimizer's, the second of a chained optimizer's list."""
        opt = self.state_dict(key).get("optimizer")
        if not self.arch.expert_apart:
            return opt if isinstance(opt, dict) else {}
        if not isinstance(opt, list) or len(opt) != 2 or not all(isinstance(o, dict) for o in opt):
            got = f"a list of {len(opt)}" if isinstance(opt, list) else type(opt).__name__
            raise CheckpointError(f"{self.files[key]}: optimizer is {got}, the chained [dense, experts] optimizer "
                                  "of experts apart (args: expert parallelism or expert TP) is a list of 2")
        return opt[1] if experts else opt[0]

    def _state_index(self, key: tuple[int, int, int], experts: bool) -> dict[tuple[int, str], int]:
        """Plain Adam's state index of each (model chunk, local name): group 0's (decay) then group
        1's, each in the state dicts' (registration) order, chunk after chunk. With experts apart
        the dense optimizer's and the expert optimizer's (that file's EP rank's experts) apart."""
        tp, pp, ep = key
        a = self.arch
        sd = self.state_dict(key)
        specs: dict[tuple[int, str], KeySpec] = {}
        if not experts:
            specs = {(v, self._local_name(lp)): lp.spec for v in range(a.vpp) for lp in a.stage_params(pp, tp, vp=v)}
            if self.embedding_copy(pp):  # a parameter of the last stage's optimizer too (MTP: its first; tied: last)
                specs[(a.vpp - 1, copy_name(a))] = a.spec(EMBED)
        if a.experts and (experts or not a.expert_apart):  # the experts' names depend on their local number only
            specs |= {(v, self._local_name(lp)): lp.spec for v in range(a.vpp)
                      for lp in a.stage_params(pp, 0, expert_rank=ep if a.expert_apart else 0, vp=v)}
        # the optimizer holds parameters only: a buffer (a router's expert_bias, or one no parameter names: held.py)
        # has no index
        names = [(v, k) for v, mk in enumerate(self._model_keys) for k, x in sd[mk].items()
                 if isinstance(x, torch.Tensor) and (v, k) in specs and not specs[(v, k)].buffer]
        decay = [n for n in names if specs[n].decay]
        order = decay + [n for n in names if n not in set(decay)]
        groups = self._optimizer(key, experts).get("param_groups") or []
        have = [len(g.get("params", ())) for g in groups]
        # Megatron makes a group only for the parameters some rank has (no no-decay expert group)
        if [n for n in have if n] != [n for n in (len(decay), len(order) - len(decay)) if n]:
            raise CheckpointError(f"{self.files[key]}: {'expert ' if experts else ''}optimizer param groups hold "
                                  f"{have} parameters, the model {[len(decay), len(order) - len(decay)]}")
        return {n: i for i, n in enumerate(order)}

    def _adam(self, lp: LocalParam, state: str) -> torch.Tensor:
        key = self._key_of(lp)
        experts = lp.spec.expert and self.arch.expert_apart
        f, name = self.files[key], self._local_name(lp)
        i = self._state_index(key, experts)[(self._chunk_of(lp), name)]
        st = (self._optimizer(key, experts).get("state") or {}).get(i) or {}
        t = st.get(state)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != lp.shape:
            raise CheckpointError(f"{f}: {'expert ' if experts else ''}optimizer state {i} ({name}, TP rank {lp.tp}) "
                                  f"has no {state} of shape {list(lp.shape)}")
        if t.dtype != torch.float32:  # Megatron's Adam keeps its moments in fp32 whatever the weights' dtype
            raise CheckpointError(f"{f}: optimizer state {i} ({name}, TP rank {lp.tp}): {state} is {t.dtype}, not "
                                  "torch.float32")
        return t

    @cached_property
    def _buffers(self) -> dict[tuple[int, ...], tuple[dict[str, torch.Tensor], dict[tuple[str, int], tuple[int, int]]]]:
        """Per buffer -- ``(TP, PP)`` a dense one, ``(expert TP, EP, PP)`` an expert one (experts
        apart) -- the flat ``param``/``exp_avg``/``exp_avg_sq`` tensors and each local parameter's
        ``(start, end)`` in them, by (key, label)."""
        a, out = self.arch, {}
        loaded: dict[Path, Any] = {}
        for pp in range(a.pp):
            for tp in range(a.tp):
                out[(tp, pp)] = self._buffer(self._dense_key(tp, pp), 0, dense_buffer_params(a, pp, tp), a.dp, loaded)
            for x in range(a.etp if a.expert_apart else 0):
                for e in range(a.ep):
                    out[(x, e, pp)] = self._buffer(self._expert_key(x, e, pp), 1, a.stage_params(pp, x, expert_rank=e),
                                                   a.edp, loaded)
        return out

    def _buffer(self, key: tuple[int, int, int], which: int, params: list[LocalParam], dp: int,
                loaded: dict[Path, Any]) -> tuple[dict[str, torch.Tensor], dict[tuple[str, int], tuple[int, int]]]:
        """One DDP buffer of a ``distrib_optim.pt``: the file's own (one optimizer), or entry
        ``which`` of a chained optimizer's ``[dense, experts]`` list (each its DP group's rank 0's)."""
        f = self.files[key]
        g = f.parent / OPTIM_FILE
        d = loaded[g] = loaded[g] if g in loaded else safe.load_file(g)
        what = "dense" if which == 0 else "expert"
        if self.arch.expert_apart:
            if not isinstance(d, list) or len(d) != 2 or not isinstance(d[which], dict):
                got = f"a list of {len(d)}" if isinstance(d, list) else type(d).__name__
                raise CheckpointError(f"{g}: holds {got}, not the chained [dense, experts] optimizer's states with the "
                                      f"{what} one (saved by its DP group's rank 0: this file's rank)")
            d = d[which]
        try:
            (buf,) = d[0].values()
        except (KeyError, TypeError, ValueError, AttributeError):
            raise CheckpointError(f"{g}: not one {what} DDP buffer of one dtype (several buffers are not read by "
                                  "reshard)") from None
        tp, pp, ep = key
        size = bucket_size(self.args, self.arch, pp, 0, f"{f}: args")
        layout, unpadded = flat_layout(bucket_layouts(params, dp, size, shared_embedding(self.arch)))
        for k in ("param", "exp_avg", "exp_avg_sq"):
            t = buf.get(k) if isinstance(buf, dict) else None
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() != unpadded:
                got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise CheckpointError(f"{g}: {what} '{k}' is {got}, the bucket layout args imply [{unpadded}]: "
                                      "truncated or another layout")
            if t.dtype != torch.float32:  # the distributed optimizer's main params and moments are fp32
                raise CheckpointError(f"{g}: '{k}' is {t.dtype}, not torch.float32 (TP rank {tp}, PP rank {pp})")
        return buf, {(lp.spec.key, lp.label): (s, e) for lp, s, e in layout}

    def _flat(self, lp: LocalParam, state: str) -> torch.Tensor:
        pp = self.arch.stage_of(lp.spec, lp.index)
        apart = lp.spec.expert and self.arch.expert_apart
        buf, where = self._buffers[(lp.tp, self._ep_rank(lp), pp) if apart else (lp.tp, pp)]
        s, e = where[(lp.spec.key, lp.label)]
        return buf["param" if state == "fp32" else state].narrow(0, s, e - s)

    # -- what the reader reads -------------------------------------------------------------------
    def states(self, spec: KeySpec) -> tuple[str, ...]:
        if spec.buffer or not self.optim:
            return ("weight",)
        return ("weight", "fp32", "exp_avg", "exp_avg_sq") if self.distopt else ("weight", "exp_avg", "exp_avg_sq")

    def lowered(self, spec: KeySpec, state: str) -> Lowered:
        m, lps = local_map(self.arch, spec, self._local)

        def fragment(label: int) -> torch.Tensor:
            lp = lps[label]
            if state == "weight":
                return self.tensor(lp).reshape(-1)
            return (self._flat(lp, state) if self.distopt else self._adam(lp, state).reshape(-1))

        return Lowered(m, fragment, lambda label: lps[label].tp,
                       lambda label: self.state_dict(self._key_of(lps[label]))["args"].rank)  # checked: _saved_by

    def embedding_copy(self, pp: int) -> bool:
        """Whether stage ``pp`` keeps a copy of the word embeddings beside the first stage's: the last
        one, over several stages, for the MTP block (GPTModel registers it first in the last model
        chunk) or tied embeddings (``output_layer.weight``, registered last); a parameter of that
        stage's optimizer, its gradient all-reduced with the first stage's, so equal to it."""
        return embedding_copy(self.arch, pp)

    @property
    def _copy_for(self) -> str:
        return "the MTP block" if self.arch.mtp else "the tied output layer"

    def _check_embedding_copy(self) -> None:
        """The last stage's embedding copy (weights and moments) equals the first stage's, bit for
        bit: reshard reads the first stage's (as ``torch_dist`` stores one copy)."""
        a = self.arch
        spec, name = a.spec(EMBED), copy_name(a)
        for lp in a.locals_of(spec):
            key = self._dense_key(lp.tp, a.pp - 1)
            f = self.files[key]
            copy = self.state_dict(key)[self._model_keys[-1]].get(name)
            if not isinstance(copy, torch.Tensor) or tuple(copy.shape) != lp.shape:
                raise CheckpointError(f"{f}: model has no tensor {name!r} of shape {list(lp.shape)} (the last "
                                      f"stage's embedding copy for {self._copy_for}, TP rank {lp.tp})")
            first = self.files[self._key_of(lp)]
            pairs = [("weight", copy, self.tensor(lp), f, first)]
            if self.optim and self.distopt:  # the copy's own bucket in the last stage's distrib_optim.pt
                buf, where = self._buffers[(lp.tp, a.pp - 1)]
                s, e = where[(EMBED, lp.label)]
                pairs += [(st, buf["param" if st == "fp32" else st].narrow(0, s, e - s), self._flat(lp, st),
                           f.parent / OPTIM_FILE, first.parent / OPTIM_FILE) for st in ("fp32", "exp_avg", "exp_avg_sq")]
            elif self.optim:
                i = self._state_index(key, False)[(a.vpp - 1, name)]
                st = (self._optimizer(key, False).get("state") or {}).get(i) or {}
                pairs += [(s, st.get(s), self._adam(lp, s), f, first) for s in ("exp_avg", "exp_avg_sq")]
            for what, got, want, there, here in pairs:
                if isinstance(got, torch.Tensor):  # read outside the engine's fills: their records checked now
                    verified.ensure(got, f"{there}: {name} ({what})")
                    verified.ensure(want, f"{here}: {EMBED} ({what})")
                if not isinstance(got, torch.Tensor) or got.shape != want.shape or not torch.equal(got, want):
                    raise CheckpointError(f"{there}: {name} ({what}, TP rank {lp.tp}): the last stage's copy for "
                                          f"{self._copy_for} differs from the first stage's {EMBED} ({here})")

    def check(self) -> None:
        if self.embedding_copy(self.arch.pp - 1):
            self._check_embedding_copy()
        for spec in self.arch.keys():
            for lp in self.arch.locals_of(spec):
                t = self.tensor(lp)
                if t.dtype != (torch.float32 if spec.buffer else self.dtype):  # expert_bias: fp32 always
                    raise CheckpointError(f"{self.files[self._key_of(lp)]}: {self._local_name(lp)} is {t.dtype}, "
                                          f"other weights {self.dtype}")
                for s in self.states(spec)[1:]:
                    (self._flat(lp, s) if self.distopt else self._adam(lp, s))

    def step(self) -> Any:
        if not self.optim:
            return None
        opt = self._optimizer(min(self.files), False)
        if self.distopt:
            groups = (opt.get("optimizer") or {}).get("param_groups") or []
            return groups[0].get("step") if groups else None
        st = (opt.get("state") or {}).get(0) or {}
        step = st.get("step")
        if isinstance(step, torch.Tensor):  # read outside the engine's fills: its record is checked now
            verified.ensure(step, f"{self.files[min(self.files)]}: optimizer state 0 (step)")
        return step

    def param_groups(self) -> list[dict[str, Any]]:
        """Every optimizer's groups: the dense one's, then (experts apart) the expert optimizer's."""
        groups: list[dict[str, Any]] = []
        for experts in (False, True) if self.arch.expert_apart and self.optim else (False,) if self.optim else ():
            opt = self._optimizer(min(self.files), experts)  # distributed: {'optimizer': {'param_groups': ...}}
            groups += ((opt.get("optimizer") or {}) if self.distopt else opt).get("param_groups") or []
        return [{k: v for k, v in g.items() if k != "params"} for g in groups]

    @property
    def iteration_files(self) -> list[Path]:
        out = list(self.files.values())
        if self.distopt and self.optim:
            out += [f.parent / OPTIM_FILE for f in self.files.values()]
        return out
