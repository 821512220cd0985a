"""A Megatron-Core checkpoint (``torch_dist`` or legacy ``torch``) as the engine reads it
(``formats.contract.Reader``), under one of two namings chosen when it is opened:

* ``names="megatron"``: Megatron's own keys, stacked over layers (and experts), fused as Megatron
  stores them (QKV grouped per query group, SwiGLU's fc1 ``[gate; up]``), the padded vocabulary
  whole;
* ``names="hf"``: Hugging Face names through an architecture mapping document (``hfmap``): per
  layer, q/k/v per query group, gate/up halves, norms renamed, vocabulary padding outside the
  valid region, ``lm_head`` only when the embeddings are untied.

States: ``weight`` (the model keys), ``exp_avg``/``exp_avg_sq`` (plain Adam, either distributed
optimizer layout, legacy files) and ``fp32`` (the distributed optimizer's main parameters). Each
map is over rank labels whose shards lie contiguous in the files (``lowering``), so every fragment
is a view of a mapped file. :meth:`MegatronReader.check` reads every header, object and map
before any output folder exists.
"""

from __future__ import annotations

import copy
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from ...errors import CheckpointError, ReshardError
from ...ir.param_map import ParamMap
from ..contract import STATES, ExpertLayer, Held, Reader
from ..fused_experts import fused_expert_layers
from ..hf_order import hf_model_order, in_model_order
from .dist import TorchDistBackend
from .files import Location, locate
from .held import held
from .hfmap import HfParam, hf_params, restrict, unplaced
from .legacy import LegacyBackend
from .lowering import Lowered
from .model import EMBED, OUTPUT, Arch

__all__ = ["NAMES", "MegatronReader"]

NAMES = ("megatron", "hf")


class MegatronReader(Reader):
    format = "megatron"

    def __init__(self, loc: Location, *, names: str = "megatron", mapping: Any = None, given: Path | None = None) -> None:
        if names not in NAMES:
            raise ReshardError(f"names (--names) must be 'megatron' or 'hf', got {names!r}")
        self.loc, self.naming, self.mapping = loc, names, mapping
        self.src: TorchDistBackend | LegacyBackend = TorchDistBackend(loc.iter_dir) if loc.fmt == "torch_dist" else LegacyBackend(loc.iter_dir)
        self.arch: Arch = self.src.arch
        self.args = self.src.args
        self.tag = loc.save_dir.name
        given = Path(given) if given is not None else loc.save_dir
        self.sources = tuple(dict.fromkeys((given, loc.save_dir)))
        a = self.arch
        ep = (f" EP={a.ep}" + (f" expert-TP={a.etp}" if a.etp != a.tp else "")) if a.experts else ""
        self._ep = ep
        self.topology = {"tp": a.tp, "pp": a.pp, "dp": a.dp, **({"ep": a.ep} if a.experts else {}),
                         **({"etp": a.etp} if a.experts and a.etp != a.tp else {})}
        self._vocab_rows = a.padded_vocab
        self._maps: dict[tuple[str, str], Lowered] = {}

    @cached_property  # the contract's attribute; whether optimizer state was saved needs the keys read
    def description(self) -> str:  # type: ignore[override]
        a = self.arch
        saved = any(len(self.states(n)) > 1 for n in self.names)  # --no-save-optim: the weights alone
        optimizer = f"optimizer {self.src.sharding}" if saved else "no optimizer state"
        return (f"Megatron-Core {self.loc.fmt} checkpoint, TP={a.tp} PP={a.pp} DP={a.dp}{self._ep}, "
                f"{optimizer}, {self.naming} names")

    @classmethod
    def open(cls, path: str | Path, *, names: str = "megatron", mapping: Any = None) -> MegatronReader:
        return cls(locate(Path(path)), names=names, mapping=mapping, given=Path(path))

    # -- names -----------------------------------------------------------------------------------
    @cached_property
    def hf(self) -> dict[str, HfParam]:
        try:
            return {p.name: p for p in hf_params(self.arch, self.mapping)}
        except ReshardError as e:  # said of this checkpoint (its args decide the mapping)
            raise CheckpointError(f"{self.loc.iter_dir}: {e}") from None

    @cached_property
    def specs(self) -> dict:
        return {s.key: s for s in self.arch.keys()}

    @cached_property  # the contract's attribute, computed once
    def names(self) -> list[str]:  # type: ignore[override]
        return list(self.hf) if self.naming == "hf" else list(self.specs)

    def _spec(self, name: str) -> Any:
        key = self.hf[name].key if self.naming == "hf" else name
        try:
            return self.specs[key]
        except KeyError:
            raise CheckpointError(f"{self.loc.iter_dir}: no parameter {name!r}") from None

    def with_vocabulary(self, rows: int) -> MegatronReader:
        """This source with only the first ``rows`` rows of the padded vocabulary (Megatron names)
        as the valid region of the embedding and output maps, for a target padded to fewer rows (as
        Megatron's own load into a smaller vocabulary truncates); ``self`` is left as it is.
        ``rows`` is at least ``vocab_size``."""
        if not self.arch.vocab <= rows <= self.arch.padded_vocab:
            raise ReshardError(f"vocabulary rows {rows} outside [{self.arch.vocab}, {self.arch.padded_vocab}]")
        view = copy.copy(self)
        view._vocab_rows = rows
        view._maps = {k: m for k, m in self._maps.items() if k[0] not in (EMBED, OUTPUT)}
        return view

    def native(self, fmt: str) -> MegatronReader | None:
        """The Megatron source itself (its args, architecture, files and naming)."""
        return self if fmt == "megatron" else None

    # -- the contract --------------------------------------------------------------------------
    def check(self) -> None:
        """Every check that can refuse the source: files, objects (restricted unpickling), key
        shapes against args, and every map of every state."""
        if isinstance(self.src, TorchDistBackend):
            self.src.check_objects()
            self.src.ck.check_records()  # each record holds the dtype and shape .metadata says
            self.src.check_copy()  # the last stage's embedding copy in its own buckets: equal to the first stage's
        else:
            self.src.check()
        for name in self.names:
            for state in self.states(name):
                self.map(name, state)

    def unlowered(self) -> list[Held]:
        """What the files hold beside the parameter states (``held``): _extra_state, RNG and
        rerun states, common_state's run entries, and tensors no parameter takes."""
        out = held(self.src, self.specs)
        if self.naming == "hf":  # keys the HF model has no place for (MTP layers): weights, refused unless dropped
            out += [Held(key, str(self.loc.iter_dir), "weights", why) for key, why in self.placeless]
        return out

    @cached_property
    def placeless(self) -> list[tuple[str, str]]:
        """Under HF names: the keys the mapping document gives no place (``hfmap.unplaced``), with why."""
        try:
            return unplaced(self.arch, self.mapping)
        except ReshardError as e:
            raise CheckpointError(f"{self.loc.iter_dir}: {e}") from None

    def labels(self) -> str:
        return "rank label"  # a shard is a chunk, a local parameter or a bucket range (lowering), not a process

    def world(self) -> int | None:
        a, n = self.arch, getattr(self.args, "world_size", None)
        return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else a.tp * a.pp * a.dp

    def saver(self, name: str, state: str, rank: int) -> int | None:
        """The storage rank whose file holds label ``rank``: a torch_dist chunk's or bucket chunk's
        writer (the R of ``__R_0.distcp``), a legacy file's saving rank (its ``args.rank``); under HF
        names, that of the shard the run is cut from."""
        return self.lowered(name, state).saver(rank)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.map(name, "weight").valid_shape)

    def states(self, name: str) -> tuple[str, ...]:
        have = self.src.states(self._spec(name))
        return tuple(s for s in STATES if s in have)

    def dtype(self, name: str, state: str) -> torch.dtype:
        if state != "weight":
            return torch.float32
        if isinstance(self.src, LegacyBackend):
            return torch.float32 if self._spec(name).buffer else self.src.dtype
        return self.src.ck.entry(self._spec(name).key).dtype

    def lowered(self, name: str, state: str) -> Lowered:
        got = self._maps.get((name, state))
        if got is None:
            got = self._maps[(name, state)] = self._lower(name, state)
        return got

    def _lower(self, name: str, state: str) -> Lowered:
        if state not in self.states(name):
            raise CheckpointError(f"{self.loc.iter_dir}: {name!r} has no {state} state")
        spec = self._spec(name)
        base = self.src.lowered(spec, state)
        if self.naming == "hf":
            m, origin = restrict(base.map, self.hf[name])

            def fragment(label: int, base: Lowered = base, origin: dict = origin) -> torch.Tensor:
                r, lo, hi = origin[label]
                return base.fragment(r).narrow(0, lo, hi - lo)

            return Lowered(m, fragment, lambda label: base.tp(origin[label][0]),
                           lambda label: base.saver(origin[label][0]))  # a run lies in its base shard's file
        if spec.key in (EMBED, OUTPUT) and self._vocab_rows != base.map.valid_shape[0]:
            m = base.map
            return Lowered(ParamMap(m.logical_shape, m.shards, (self._vocab_rows, *m.logical_shape[1:])),
                           base.fragment, base.tp, base.saver)
        return base

    def map(self, name: str, state: str) -> ParamMap:
        return self.lowered(name, state).map

    def fragment(self, name: str, state: str, rank: int) -> torch.Tensor:
        lw = self.lowered(name, state)
        t = lw.fragment(rank)
        want = lw.map.shard(rank).numel
        if t.numel() != want:
            raise CheckpointError(f"{self.loc.iter_dir}: {name} ({state}) shard {rank} has {t.numel()} elements, "
                                  f"its map {want}")
        return t

    def tp_index(self, name: str, state: str, rank: int) -> int | None:
        return self.lowered(name, state).tp(rank)

    def step(self, name: str) -> Any:
        return self.src.step() if len(self.states(name)) > 1 else None

    def param_groups(self) -> list[dict[str, Any]]:
        """Megatron's groups (weight decay, then none; with experts the expert optimizer's two
        after the dense one's), ``params`` the names in each."""
        groups = self.src.param_groups()
        if not groups:
            return []
        for g in groups:  # experts to the expert optimizer's groups, each name by its weight decay
            expert, decay = bool(g.get("is_expert_parallel")), g.get("wd_mult", 1.0) != 0
            g["params"] = [n for n in self.names if (self._spec(n).expert and self.arch.expert_apart) == expert
                           and self._decays(n) == decay and not self._spec(n).buffer]
        return groups

    def _decays(self, name: str) -> bool:
        if self.naming == "hf":
            return len(self.hf[name].shape) >= 2 and not name.endswith(".bias") and not name.endswith("norm.weight")
        return self._spec(name).decay

    def grad_clip(self) -> float | None:
        """``args.clip_grad`` (Megatron's ``--clip-grad``; 0 turns clipping off), where the run saved
        its optimizer state."""
        clip = getattr(self.args, "clip_grad", None)
        if isinstance(clip, bool) or not isinstance(clip, (int, float)):
            return None
        return float(clip) if any(len(self.states(n)) > 1 for n in self.names) else None

    def expert_layers(self) -> tuple[ExpertLayer, ...]:
        """In HF names, each MoE layer's experts as the mapping document fuses them
        (``mlp.experts.gate_up_proj`` / ``down_proj``, ``[num_experts, ...]``: ``fused_experts``);
        in Megatron's names none (its expert keys are stacked over layers)."""
        if self.naming != "hf":
            return ()
        layers = fused_expert_layers(self.names, self.shape, str(self.loc.iter_dir))
        for lay in layers:
            if lay.num_experts != self.arch.experts:
                raise CheckpointError(f"{self.loc.iter_dir}: {lay.module_path}: {lay.num_experts} experts in its "
                                      f"fused tensors, args.num_experts = {self.arch.experts}")
        return layers

    def extras(self, name: str) -> dict[str, Any]:
        return {}

    def model_order(self) -> list[str] | None:
        """In Megatron's keys, its own; in HF names, the HF model's (``hf_config`` built by
        transformers), not the mapping document's: a DeepSpeed target's flat buffers and a DCP
        target's entries follow it. ``None`` (refused by a DeepSpeed target) where that model
        cannot be built."""
        if self.naming != "hf":
            return list(self.names)
        return in_model_order(self.names, hf_model_order(self.hf_config()))

    # -- for a Hugging Face export -----------------------------------------------------------------
    def hf_config(self) -> dict[str, Any]:
        """A transformers ``config.json`` for this model (Llama / Qwen2 style, from ``args``)."""
        from .hfconfig import hf_config

        return hf_config(self.args, self.arch, self.dtype(self.names[0], "weight"))

    @property
    def iteration(self) -> int | None:
        return self.loc.iteration
