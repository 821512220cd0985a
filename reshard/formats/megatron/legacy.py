"""A legacy ``--ckpt-format torch`` iteration folder (docs/megatron-checkpoints.md §3): one
``mp_rank_TT[_PPP]/model_optim_rng.pt`` per (TP, PP) rank holding that rank's local state dict,
plain Adam's states by index, and with the distributed optimizer a ``distrib_optim.pt`` beside it
(each stage's buffer gathered over DP: its buckets' unpadded parts back to back, ``buckets.py``).

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
from . import safe
from .buckets import bucket_layouts, bucket_size, flat_layout
from .files import LEGACY_RANK
from .grouped import TE_GROUPED, te_grouped
from .lowering import Lowered, local_map
from .model import EMBED, Arch, KeySpec, LocalParam

__all__ = ["LegacyBackend"]

MODEL_FILE, OPTIM_FILE = "model_optim_rng.pt", "distrib_optim.pt"
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def _rank_dir(tp: int, pp: int, arch: Arch) -> str:
    return f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if arch.pp > 1 else "")


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
        if self.arch.ep > 1:
            raise CheckpointError(f"{first}: args.expert_model_parallel_size = {self.arch.ep}: legacy checkpoints "
                                  "with expert parallelism are not read by reshard")
        if self.arch.expert_apart:  # expert TP apart from TP: a chained optimizer, expert files of their own
            raise CheckpointError(f"{first}: args.expert_tensor_parallel_size = {self.arch.etp} (TP {self.arch.tp}): "
                                  "legacy checkpoints with expert TP apart from TP are not read by reshard")
        if self.arch.mtp:  # no legacy fixture: the MTP block's legacy names are unverified
            raise CheckpointError(f"{first}: args.mtp_num_layers = {self.arch.mtp}: legacy checkpoints with "
                                  "multi-token prediction layers are not read by reshard")
        if te_grouped(self.args):  # linear_fc1.weight<i> per local expert, not local_experts.<i>.linear_fc1.weight
            raise CheckpointError(f"{first}: args.moe_grouped_gemm = True (transformer_impl "
                                  f"{getattr(self.args, 'transformer_impl', None)!r}): legacy files of {TE_GROUPED} "
                                  "are not read by reshard")
        self.distopt = bool(getattr(self.args, "use_distributed_optimizer", False))
        if self.arch.vpp > 1 and self.distopt:
            raise CheckpointError(f"{first}: args.virtual_pipeline_model_parallel_size = {self.arch.vpp} with the "
                                  "distributed optimizer: legacy distrib_optim.pt buffers of virtual pipeline stages are "
                                  "not read by reshard")
        self.sharding = "dp_reshardable" if self.distopt else "adam"
        self.files: dict[tuple[int, int], Path] = {}
        for pp in range(self.arch.pp):
            for tp in range(self.arch.tp):
                f = iter_dir / _rank_dir(tp, pp, self.arch) / MODEL_FILE
                if not f.is_file():
                    raise CheckpointError(f"{f}: file is missing (TP rank {tp}, PP rank {pp} of {self.arch.tp} x "
                                          f"{self.arch.pp})")
                self.files[(tp, pp)] = f
        self._sd: dict[tuple[int, int], dict] = {}
        self._local: dict = {}

    def state_dict(self, tp: int, pp: int) -> dict:
        sd = self._sd.get((tp, pp))
        if sd is None:
            f = self.files[(tp, pp)]
            sd = self.first if f == self.files[min(self.files)] and (tp, pp) == min(self.files) else safe.load_file(f)
            if not isinstance(sd, dict) or not all(isinstance(sd.get(k), dict) for k in self._model_keys):
                raise CheckpointError(f"{f}: not a Megatron model_optim_rng.pt (no {' / '.join(self._model_keys)} "
                                      "state dict)")
            self._saved_by(f, sd, tp, pp)
            self._sd[(tp, pp)] = sd
        return sd

    def _saved_by(self, f: Path, sd: dict, tp: int, pp: int) -> None:
        """The file's ``args.rank`` (the global rank that saved it) must be of the TP and PP rank
        its folder names: Megatron's rank order keeps TP innermost, then CP, then DP and PP (or
        PP and DP with ``use_tp_pp_dp_mapping``). Two same-shaped rank files swapped are refused."""
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
        if rank % t != tp or (want_pp is not None and want_pp != pp):
            saved = f"TP rank {rank % t}" + (f", PP rank {want_pp}" if want_pp is not None else "")
            raise CheckpointError(f"{f}: saved by global rank {rank} ({saved}), but it lies in the folder of TP rank "
                                  f"{tp}, PP rank {pp}: rank files swapped or misplaced")

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
        if lp.spec.expert:
            name = name.replace("{expert}", str(lp.index[-1]))
        return name

    def tensor(self, lp: LocalParam) -> torch.Tensor:
        """The module tensor of local parameter ``lp``, checked against its shape and dtype."""
        pp = self.arch.stage_of(lp.spec, lp.index)
        f, name = self.files[(lp.tp, pp)], self._local_name(lp)
        t = self.state_dict(lp.tp, pp)[self._model_keys[self._chunk_of(lp)]].get(name)
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
    def _state_index(self, tp: int, pp: int) -> dict[tuple[int, str], int]:
        """Plain Adam's state index of each (model chunk, local name): group 0's (decay) then group
        1's, each in the state dicts' (registration) order, chunk after chunk."""
        sd = self.state_dict(tp, pp)
        buffers = {(self._chunk_of(lp), self._local_name(lp)) for s in self.arch.keys() if s.buffer
                   for lp in self.arch.locals_of(s) if lp.tp == tp and self.arch.stage_of(s, lp.index) == pp}
        specs = {(v, self._local_name(lp)): lp.spec for v in range(self.arch.vpp)
                 for lp in self.arch.stage_params(pp, tp, vp=v)}
        experts = {(v, self._local_name(lp)) for v in range(self.arch.vpp) if self.arch.experts
                   for lp in self.arch.stage_params(pp, tp, expert_rank=0, vp=v)}
        # the optimizer holds parameters only: a buffer (a router's expert_bias, or one no parameter names: held.py)
        # has no index
        names = [(v, k) for v, mk in enumerate(self._model_keys) for k, x in sd[mk].items()
                 if isinstance(x, torch.Tensor) and ((v, k) in specs or (v, k) in experts) and (v, k) not in buffers]
        decay = [n for n in names if specs.get(n) is None or specs[n].decay]
        order = decay + [n for n in names if n not in set(decay)]
        groups = (sd.get("optimizer") or {}).get("param_groups") or []
        want = [len(decay), len(order) - len(decay)]
        if [len(g.get("params", ())) for g in groups] != want:
            raise CheckpointError(f"{self.files[(tp, pp)]}: optimizer param groups hold "
                                  f"{[len(g.get('params', ())) for g in groups]} parameters, the model {want}")
        return {n: i for i, n in enumerate(order)}

    def _adam(self, lp: LocalParam, state: str) -> torch.Tensor:
        pp = self.arch.stage_of(lp.spec, lp.index)
        f, name = self.files[(lp.tp, pp)], self._local_name(lp)
        i = self._state_index(lp.tp, pp)[(self._chunk_of(lp), name)]
        st = ((self.state_dict(lp.tp, pp).get("optimizer") or {}).get("state") or {}).get(i) or {}
        t = st.get(state)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != lp.shape:
            raise CheckpointError(f"{f}: optimizer state {i} ({name}, TP rank {lp.tp}) has no {state} of shape "
                                  f"{list(lp.shape)}")
        if t.dtype != torch.float32:  # Megatron's Adam keeps its moments in fp32 whatever the weights' dtype
            raise CheckpointError(f"{f}: optimizer state {i} ({name}, TP rank {lp.tp}): {state} is {t.dtype}, not "
                                  "torch.float32")
        return t

    @cached_property
    def _buffers(self) -> dict[tuple[int, int], tuple[dict[str, torch.Tensor], dict[tuple[str, int], tuple[int, int]]]]:
        """Per (TP, PP) rank: the flat ``param``/``exp_avg``/``exp_avg_sq`` buffers and each local
        parameter's ``(start, end)`` in them, by (key, label)."""
        out = {}
        for (tp, pp), f in self.files.items():
            g = f.parent / OPTIM_FILE
            d = safe.load_file(g)
            try:
                (buf,) = d[0].values()
            except (KeyError, TypeError, ValueError, AttributeError):
                raise CheckpointError(f"{g}: not one DDP buffer of one dtype (experts or several buffers are not "
                                      "read by reshard)") from None
            size = bucket_size(self.args, self.arch, pp, 0, f"{self.files[(tp, pp)]}: args")
            layout, unpadded = flat_layout(bucket_layouts(self.arch.stage_params(pp, tp), self.arch.dp, size))
            for k in ("param", "exp_avg", "exp_avg_sq"):
                t = buf.get(k) if isinstance(buf, dict) else None
                if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() != unpadded:
                    got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                    raise CheckpointError(f"{g}: '{k}' is {got}, the bucket layout args imply [{unpadded}]: "
                                          "truncated or another layout")
                if t.dtype != torch.float32:  # the distributed optimizer's main params and moments are fp32
                    raise CheckpointError(f"{g}: '{k}' is {t.dtype}, not torch.float32 (TP rank {tp}, PP rank {pp})")
            out[(tp, pp)] = (buf, {(lp.spec.key, lp.label): (s, e) for lp, s, e in layout})
        return out

    def _flat(self, lp: LocalParam, state: str) -> torch.Tensor:
        buf, where = self._buffers[(lp.tp, self.arch.stage_of(lp.spec, lp.index))]
        s, e = where[(lp.spec.key, lp.label)]
        return buf["param" if state == "fp32" else state].narrow(0, s, e - s)

    # -- what the reader reads -------------------------------------------------------------------
    def states(self, spec: KeySpec) -> tuple[str, ...]:
        if spec.buffer:
            return ("weight",)
        return ("weight", "fp32", "exp_avg", "exp_avg_sq") if self.distopt else ("weight", "exp_avg", "exp_avg_sq")

    def lowered(self, spec: KeySpec, state: str) -> Lowered:
        m, lps = local_map(self.arch, spec, self._local)

        def fragment(label: int) -> torch.Tensor:
            lp = lps[label]
            if state == "weight":
                return self.tensor(lp).reshape(-1)
            return (self._flat(lp, state) if self.distopt else self._adam(lp, state).reshape(-1))

        return Lowered(m, fragment, lambda label: lps[label].tp)

    def check(self) -> None:
        for spec in self.arch.keys():
            for lp in self.arch.locals_of(spec):
                t = self.tensor(lp)
                if t.dtype != (torch.float32 if spec.buffer else self.dtype):  # expert_bias: fp32 always
                    raise CheckpointError(f"{self.files[(lp.tp, self.arch.stage_of(spec, lp.index))]}: "
                                          f"{self._local_name(lp)} is {t.dtype}, other weights {self.dtype}")
                for s in self.states(spec)[1:]:
                    (self._flat(lp, s) if self.distopt else self._adam(lp, s))

    def step(self) -> Any:
        sd = self.state_dict(0, 0)
        opt = sd.get("optimizer") or {}
        if self.distopt:
            groups = (opt.get("optimizer") or {}).get("param_groups") or []
            return groups[0].get("step") if groups else None
        st = (opt.get("state") or {}).get(0) or {}
        return st.get("step")

    def param_groups(self) -> list[dict[str, Any]]:
        opt = self.state_dict(0, 0).get("optimizer") or {}
        groups = (opt.get("optimizer") or {}).get("param_groups") if self.distopt else opt.get("param_groups")
        return [{k: v for k, v in g.items() if k != "params"} for g in groups or []]

    @property
    def iteration_files(self) -> list[Path]:
        out = list(self.files.values())
        if self.distopt:
            out += [f.parent / OPTIM_FILE for f in self.files.values()]
        return out
