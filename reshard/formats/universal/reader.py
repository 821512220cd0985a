"""A universal checkpoint (DeepSpeed's ``ds_to_universal`` layout, or reshard's) as the engine
reads it: ``zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt`` each hold F whole (bare, or as
``{"param": F, ...}``), so every state's map is F on one rank; ``step.pt`` and
``zero/optimizer_state.pt`` give Adam's step and the parameter groups.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from ...errors import CheckpointError
from ...ir.param_map import ParamMap
from ...ir.piece import prod
from ...layouts import replicated
from ...layouts.zero import zero3 as zero3_map
from ...layouts.zero import zero3_partition_numel
from ...storage import verified
from ...storage.safe_load import load
from ..contract import ExpertLayer, Held, Reader
from ..deepspeed.checks import check_step
from ..deepspeed.reader import model_state_held

__all__ = ["STATE_FILES", "UniversalReader", "universal_dir"]

STATE_FILES = ("fp32", "exp_avg", "exp_avg_sq")
LATEST = "latest_universal"


def universal_dir(p: Path) -> Path | None:
    """The tag folder of a universal checkpoint at ``p`` (the folder itself, or the one its
    ``latest_universal`` names); ``None`` when ``p`` is not one."""
    if (p / "zero").is_dir():
        return p
    latest = p / LATEST
    if latest.is_file():
        try:
            tag = latest.read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{latest}: unreadable ({e})") from None
        if tag and "/" not in tag and len(tag) < 256 and (p / tag / "zero").is_dir():
            return p / tag
        raise CheckpointError(f"{latest}: names tag {tag[:80]!r}, but {p / tag[:80] / 'zero'} is missing")
    return None


class UniversalReader(Reader):
    format = "universal"

    def __init__(self, path: str | Path) -> None:
        p = Path(path)
        tag_dir = universal_dir(p)
        if tag_dir is None:
            raise CheckpointError(f"{p}: no zero/ folder and no {LATEST}: not a universal checkpoint")
        self.tag_dir, self.root = tag_dir, tag_dir / "zero"
        found = {d.name for d in self.root.iterdir() if d.is_dir()}
        lacking = sorted(n for n in found if not (self.root / n / "fp32.pt").is_file())
        if lacking:  # a parameter folder without its master: never "no such parameter"
            raise CheckpointError(f"{self.root / lacking[0] / 'fp32.pt'}: missing (or not a regular file): the "
                                  f"parameter's fp32 master ({len(lacking)} parameter(s) lack theirs)")
        # the model's order (what a DeepSpeed target flattens in): the model states' param_shapes
        ordered = [n for n in self._recorded if n in found]
        self._alias = self._router_aliases(found)  # a folder each, but the router's tensor: no parameter
        self._frozen = self._frozen_params(found)
        rest = sorted(found - set(ordered) - set(self._alias))
        if self._frozen:  # frozen parameters at their place in the module's order
            module = [k for k in self._model_state.get("module") or {}]
            held = set(ordered) | set(rest) | set(self._frozen)
            ordered = [k for k in module if k in held]
            rest = sorted(held - set(ordered))
        self.names = ordered + rest
        if not self.names:
            raise CheckpointError(f"{tag_dir}: no zero/<param>/fp32.pt files: not a universal checkpoint")
        self.tag = tag_dir.name
        self.sources = (p, tag_dir) if p != tag_dir else (tag_dir,)
        self.description = "universal checkpoint"
        self.topology: dict[str, int] = {}
        self._maps: dict[str, ParamMap] = {}
        unknown = [n for n in self._recorded if n not in found]
        if unknown:
            raise CheckpointError(f"{self.root / unknown[0]}: missing, but the model states beside zero/ record "
                                  f"{unknown[0]!r} ({len(unknown)} parameter(s) missing)")

    def check(self) -> None:
        """Every state file of every parameter: a float32 tensor (as ds_to_universal and reshard
        write them; another dtype is refused, never cast) of F's elements, the moments in the
        fp32 file's shape."""
        kinds = {}
        for name in self.names:  # every parameter the same states and a step, or none
            held = (self.states(name), (self.root / name / "step.pt").is_file())
            if held == (("fp32",), False) and name in self._buffer_names:
                continue  # a buffer the model states name (an expert bias): no optimizer state, as recorded
            if name in self._frozen:
                continue  # a frozen parameter: its weight alone (fp32.pt, or a ZeRO-3 source's partitions)
            kinds.setdefault(held, name)
        if len(kinds) > 1:
            (a, na), (b, nb) = list(kinds.items())[:2]
            raise CheckpointError(f"{self.root}: parameters hold different optimizer states ({na!r}: {list(a[0])}"
                                  f"{' + step' if a[1] else ''}; {nb!r}: {list(b[0])}{' + step' if b[1] else ''}): a "
                                  "file is missing")
        for alias, router in self._alias.items():
            if not torch.equal(self._tensor(alias, "fp32"), self._tensor(router, "fp32")):
                raise CheckpointError(f"{self.root / alias / 'fp32.pt'}: differs from the fp32 master of {router!r}, "
                                      "whose AutoEP router alias the model states make it")
        for name in self.names:
            if name in self._partitioned:
                self._check_partitions(name)
                continue
            n = prod(self.shape(name))
            stored = tuple(self._tensor(name, "fp32").shape)
            self.step(name)
            for state in self.states(name):
                t = self._tensor(name, state)
                f = self.root / name / f"{state}.pt"
                if t.dtype != torch.float32:
                    raise CheckpointError(f"{f}: a {t.dtype} tensor; a universal checkpoint's {state} is float32 "
                                          "(refused, not cast)")
                if t.numel() != n:
                    raise CheckpointError(f"{f}: {t.numel()} elements, the parameter has {n} ({list(self.shape(name))})")
                if tuple(t.shape) != stored:
                    raise CheckpointError(f"{f}: shape {list(t.shape)}, fp32.pt's is {list(stored)}")

    def unlowered(self) -> list[Held]:
        """What the copied model-state files hold beside the parameters (buffers, scheduler, client
        state: ``deepspeed.reader.model_state_held``), and any file of ``zero/`` reshard does not read."""
        seen, out = set(self.names), []
        for f in sorted(self.tag_dir.glob("*model_states.pt")):
            state = load(f)
            if isinstance(state, dict):
                out += model_state_held(f, state, seen)
        read = {*(f"{s}.pt" for s in STATE_FILES), "step.pt"}
        for d in sorted(self.root.iterdir()):
            if d.is_dir() and d.name in seen:
                out += [Held(f"{d.name}/{f.name}", str(f), "state", "a state file of the parameter reshard does not "
                             "read") for f in sorted(d.iterdir()) if f.name not in read]
            elif d.is_dir() and d.name in self._alias:
                out.append(Held(d.name, str(d / "fp32.pt"), "weights", f"AutoEP's router alias of "
                                f"{self._alias[d.name]!r} (the same values, checked): written where the target's "
                                "model holds the alias"))
            elif d.name != "optimizer_state.pt" and not d.is_dir():
                out.append(Held(d.name, str(d), "state", "a file of zero/ reshard does not read"))
        return out

    def _frozen_params(self, found: set[str]) -> dict[str, tuple[int, ...]]:
        """Frozen parameters (module weights no optimizer group owns) the model states beside
        ``zero/`` record: ``frozen_param_shapes`` (ZeRO-2/3), and where they record ``param_shapes``,
        a module entry of its own folder that no group, ``buffer_names``, ``shared_params`` or
        router alias accounts for (ZeRO-1: ``ds_to_universal`` writes its ``fp32.pt`` alone)."""
        out: dict[str, tuple[int, ...]] = {}
        state = self._model_state
        shapes = state.get("frozen_param_shapes")
        if isinstance(shapes, dict):
            for n, sh in shapes.items():
                try:
                    shape = tuple(int(x) for x in sh)
                except (TypeError, ValueError):
                    raise CheckpointError(f"{self.tag_dir}: the model states' frozen_param_shapes[{n!r}] is {sh!r}, "
                                          "not a shape") from None
                if prod(shape):
                    out[str(n)] = shape
        if self._recorded:
            known = set(self._recorded) | self._buffer_names | set(state.get("shared_params") or {}) | set(self._alias)
            for k, v in (state.get("module") or {}).items():
                if k in found and k not in known and k not in out and isinstance(v, torch.Tensor) and v.numel():
                    out[k] = tuple(v.shape)
        return out

    @cached_property
    def _partitioned(self) -> dict[str, tuple[int, ...]]:
        """Frozen parameters without a folder: a ZeRO-3 source's, whose partitions stay in the copied
        model-state files' ``frozen_param_fragments`` (``ds_to_universal`` writes no ``fp32.pt`` for them)."""
        return {n: s for n, s in self._frozen.items() if not (self.root / n).is_dir()}

    @cached_property
    def _dp_files(self) -> list[Path]:
        """The copied ZeRO-3 model-state files, one per DP rank of the source, in DP order."""
        files = sorted(self.tag_dir.glob("zero_pp_rank_*_mp_rank_*_model_states.pt"))
        by_rank: dict[int, Path] = {}
        for f in files:
            parts = f.name.split("_")
            if parts[6] != "00":
                raise CheckpointError(f"{f}: frozen parameters of a ZeRO-3 source at TP > 1 are not supported")
            by_rank[int(parts[3])] = f
        if sorted(by_rank) != list(range(len(by_rank))) or not by_rank:
            raise CheckpointError(f"{self.tag_dir}: the ZeRO-3 model-state files that hold the frozen parameters' "
                                  f"partitions are not one per DP rank 0..D-1 ({[f.name for f in files]})")
        return [by_rank[d] for d in range(len(by_rank))]

    def _frozen_fragment(self, name: str, d: int) -> torch.Tensor:
        f = self._dp_files[d]
        state = load(f)
        frag = (state.get("frozen_param_fragments") or {}).get(name) if isinstance(state, dict) else None
        if not isinstance(frag, torch.Tensor):
            raise CheckpointError(f"{f}: frozen_param_fragments has no tensor for frozen parameter {name!r}")
        return frag

    def _check_partitions(self, name: str) -> None:
        """A ZeRO-3 frozen parameter's partitions: one per DP rank, each DeepSpeed's (1-D, of
        ``ceil(numel / dp)`` elements), all of one dtype."""
        shape, dp = self._partitioned[name], len(self._dp_files)
        part = zero3_partition_numel(prod(shape), dp)
        dtypes = set()
        for d, f in enumerate(self._dp_files):
            frag = self._frozen_fragment(name, d)
            if frag.dim() != 1 or frag.numel() != part:
                raise CheckpointError(f"{f}: frozen_param_fragments[{name!r}] (DP rank {d}) has shape "
                                      f"{list(frag.shape)}; DeepSpeed's ZeRO-3 partition of {list(shape)} over "
                                      f"DP={dp} is 1-D of {part}")
            dtypes.add(frag.dtype)
        if len(dtypes) != 1:
            raise CheckpointError(f"{self.tag_dir}: frozen parameter {name!r} has partitions of dtypes "
                                  f"{sorted(map(str, dtypes))}")

    def frozen(self) -> tuple[str, ...]:
        return tuple(n for n in self.names if n in self._frozen)

    @cached_property
    def _recorded(self) -> dict[str, tuple[int, ...]]:
        """Shapes the model-state files beside ``zero/`` record (``param_shapes``): a universal
        checkpoint of a ZeRO-3 job stores each F flat, and only these say its shape."""
        for f in sorted(self.tag_dir.glob("*model_states.pt")):
            groups = load(f).get("param_shapes")  # one that is not a regular file is refused, not skipped
            groups = groups if isinstance(groups, list) else [groups] if isinstance(groups, dict) else []
            return {n: tuple(int(x) for x in s) for g in groups if isinstance(g, dict) for n, s in g.items()}
        return {}

    @cached_property
    def _recorded_groups(self) -> list[list[str]]:
        """Each parameter group's names as the model-state files beside ``zero/`` record them
        (``param_shapes``, one per group, in the optimizer's order)."""
        for f in sorted(self.tag_dir.glob("*model_states.pt")):
            groups = load(f).get("param_shapes")
            groups = groups if isinstance(groups, list) else [groups] if isinstance(groups, dict) else []
            return [[n for n in g if isinstance(n, str)] for g in groups if isinstance(g, dict)]
        return []

    @cached_property
    def _model_state(self) -> dict:
        """The first model-state file beside ``zero/`` (DeepSpeed's, which ds_to_universal copies), or {}."""
        for f in sorted(self.tag_dir.glob("*model_states.pt")):
            state = load(f)
            return state if isinstance(state, dict) else {}
        return {}

    @cached_property
    def _autoep_entries(self) -> list[dict]:
        """DeepSpeed AutoEP's ``ds_autoep_layers`` in the copied model states, else []."""
        entries = self._model_state.get("ds_autoep_layers")
        if entries is None:
            return []
        info = self._model_state.get("universal_checkpoint_info")
        merged = info.get("ds_autoep_layers") if isinstance(info, dict) else None
        if isinstance(merged, list) and len(merged) > len(entries):  # every stage's layers (PP), as written
            entries = merged
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise CheckpointError(f"{self.tag_dir}: the model states' ds_autoep_layers is not a list of layer entries")
        return entries

    def _router_aliases(self, found: set[str]) -> dict[str, str]:
        """AutoEP's router aliases among the folders (``{alias: router}``): a module entry no optimizer
        group holds, ``<module_path>.<alias>.<rest>`` for a recorded ``<module_path>.router.<rest>``
        (a parameter, or a buffer: MiniMax-M3's router bias)
        (DeepSpeed's AutoEP layer sets its router a second time under that name), whose folder
        ds_to_universal gives its fp32 value alone."""
        paths = [str(e.get("module_path", "")) for e in self._autoep_entries]
        states = self._stage_states if paths else []
        # a pipeline source's stages each copy their own model state: their aliases and routers too
        recorded = {n for st in states for g in _groups(st) for n in g} | set(self._recorded)
        out = {}
        for key in (k for st in states for k in st.get("module") or {}):
            if key in recorded or key not in found or (self.root / key / "exp_avg.pt").exists():
                continue
            path = next((p for p in paths if p and key.startswith(p + ".")), None)
            rest = key[len(path) + 1:].split(".", 1) if path is not None else []
            router = f"{path}.router.{rest[1]}" if len(rest) == 2 else None
            if router not in (None, key) and (router in recorded or router in self._buffer_names) \
                    and router in found:
                out[key] = router
        return out

    @cached_property
    def _stage_states(self) -> list[dict]:
        """Every model-state file beside ``zero/`` (one per pipeline stage of an AutoEP pipeline source)."""
        out = []
        for f in sorted(self.tag_dir.glob("*model_states.pt")):
            state = load(f)
            out.append(state if isinstance(state, dict) else {})
        return out

    def model_order(self) -> list[str] | None:
        """The model's order where the model states beside ``zero/`` record every parameter in
        ``param_shapes`` (DeepSpeed's, and reshard's from a source with optimizer groups), each
        buffer (:meth:`buffers`) where the module holds it: before the first recorded parameter
        that follows it there; ``None`` where they do not (the folders' names sorted are no model's
        order: a DeepSpeed target flattened in it would load each state into another parameter)."""
        recorded, buffers = self._recorded, self.buffers() + self.frozen()
        if not all(n in recorded or n in buffers for n in self.names):
            return None
        order = [n for n in self.names if n not in buffers]
        module = list(self._model_state.get("module") or {})
        for b in sorted(buffers, key=lambda k: module.index(k) if k in module else len(module)):
            after = module[module.index(b) + 1:] if b in module else []
            nxt = next((n for n in after if n in order), None)
            order.insert(order.index(nxt) if nxt is not None else len(order), b)
        return order

    def buffers(self) -> tuple[str, ...]:
        """The module buffers the model states beside ``zero/`` name (``buffer_names``) whose folder
        holds their value (``fp32.pt`` alone, as ``ds_to_universal`` writes it), in module order;
        none where they record no ``param_shapes`` (reshard's universal checkpoint of a source
        without optimizer groups names every entry in ``buffer_names``: it cannot tell)."""
        if not self._recorded:
            return ()
        held = set(self.names) & self._buffer_names
        module = [k for k in self._model_state.get("module") or {} if k in held]
        return tuple(module + sorted(held - set(module)))

    def tied(self) -> dict[str, str]:
        return dict(self._alias)

    def grad_clip(self) -> float | None:
        clip = self.optimizer_state.get("clip_grad")
        return float(clip) if isinstance(clip, (int, float)) and not isinstance(clip, bool) else None

    def expert_layers(self) -> tuple[ExpertLayer, ...]:
        """The AutoEP layers the copied model states record (``ds_autoep_layers``): each fused
        ``<expert_key_prefix>.w1/w2/w3`` here whole, ``[num_experts, ...]``."""
        out = []
        for i, e in enumerate(self._autoep_entries):
            where = f"{self.tag_dir}: ds_autoep_layers[{i}]"
            layer, path, num, prefix = (e.get(k) for k in ("moe_layer_id", "module_path", "num_experts",
                                                            "expert_key_prefix"))
            if not isinstance(layer, int) or not isinstance(path, str) or not isinstance(num, int) or num < 1 \
                    or not isinstance(prefix, str):
                raise CheckpointError(f"{where}: needs moe_layer_id, module_path, num_experts and expert_key_prefix")
            recorded = ((e.get("affine_maps") or {}).get("params") or {}) if isinstance(e.get("affine_maps"), dict) \
                else {}
            params = tuple(recorded) or tuple(n for n in self.names if n.startswith(prefix + "."))
            for n in params:
                if n not in self.names:
                    raise CheckpointError(f"{where}: expert parameter {n!r} has no folder in {self.root}")
                if self.shape(n)[:1] != (num,):
                    raise CheckpointError(f"{self.root / n / 'fp32.pt'}: shape {list(self.shape(n))}, but the layer "
                                          f"has {num} experts (a fused expert parameter is [num_experts, ...])")
            if not params:
                raise CheckpointError(f"{where}: no fused expert parameter under {prefix!r}")
            out.append(ExpertLayer(layer, path, num, params, e))
        return tuple(out)

    @cached_property
    def _buffer_names(self) -> frozenset[str]:
        """What the model-state files beside ``zero/`` name as buffers (``buffer_names``): entries
        no optimizer group holds, whose folder has ``fp32.pt`` alone."""
        for f in sorted(self.tag_dir.glob("*model_states.pt")):
            names = load(f).get("buffer_names")
            return frozenset(n for n in names if isinstance(n, str)) if isinstance(names, list) else frozenset()
        return frozenset()

    def _tensor(self, name: str, state: str) -> torch.Tensor:
        f = self.root / name / f"{state}.pt"
        obj = load(f)
        t = obj.get("param") if isinstance(obj, dict) else obj
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"{f}: expected a tensor or a dict with 'param', got {type(obj).__name__}")
        return t

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._partitioned:
            return self._partitioned[name]
        stored = tuple(self._tensor(name, "fp32").shape)  # memory-mapped: the shape costs no read of the data
        recorded = self._recorded.get(name)
        if len(stored) == 1 and recorded is not None and prod(recorded) == stored[0]:
            return recorded  # stored flat (ZeRO-3)
        return stored

    def states(self, name: str) -> tuple[str, ...]:
        if name in self._partitioned:  # the module weight's partitions, in the training dtype
            return ("weight",)
        out = []
        for s in STATE_FILES:
            f = self.root / name / f"{s}.pt"
            if f.is_file():
                out.append(s)
            elif f.exists() or f.is_symlink():  # a folder, a device, a broken link: never "no such state"
                raise CheckpointError(f"{f}: not a regular file")
        return tuple(out)

    def dtype(self, name: str, state: str) -> torch.dtype:
        if name in self._partitioned:
            return self._frozen_fragment(name, 0).dtype
        return self._tensor(name, state).dtype

    def map(self, name: str, state: str) -> ParamMap:
        m = self._maps.get(name)
        if m is None and name in self._partitioned:  # DeepSpeed's ZeRO-3 partition over the source's DP ranks
            m = self._maps[name] = zero3_map(self.shape(name), len(self._dp_files), shard="fragment")
        if m is None:
            m = self._maps[name] = replicated(self.shape(name), 1)
        return m

    def fragment(self, name: str, state: str, rank: int) -> torch.Tensor:
        if name in self._partitioned:
            return self._frozen_fragment(name, rank).detach().reshape(-1)[:self.map(name, state).shard(rank).numel]
        t = self._tensor(name, state)
        if t.numel() != self.map(name, state).numel:
            raise CheckpointError(f"{self.root / name / (state + '.pt')}: {t.numel()} elements, fp32.pt has "
                                  f"{self.map(name, state).numel}")
        return t.detach().reshape(-1)

    def tp_index(self, name: str, state: str, rank: int) -> None:
        return None

    def step(self, name: str) -> Any:
        if name in self._frozen:
            return None
        f = self.root / name / "step.pt"
        if not f.is_file():
            if f.exists() or f.is_symlink():
                raise CheckpointError(f"{f}: not a regular file")
            return self._zero3_step
        step = load(f)
        check_step(step, f)
        if isinstance(step, torch.Tensor):  # read outside the engine's fills: its record is checked now
            verified.ensure(step, f"{name} (step)")
        return step

    def extras(self, name: str) -> dict[str, Any]:
        if name in self._partitioned:
            return {}
        obj = load(self.root / name / "fp32.pt")
        return {k: v for k, v in obj.items() if k != "param"} if isinstance(obj, dict) else {}

    @cached_property
    def _zero3_step(self) -> Any:
        """Adam's step of a ZeRO-3 job's universal checkpoint, whose parameters have no ``step.pt``
        (``ds_to_universal``'s ZeRO-3 path writes none): ``optimizer_state.pt``'s
        ``optimizer_state_dict.state[0].step``, the one DeepSpeed's ZeRO-3 universal loader gives
        every sub-group. ``None`` for any other checkpoint."""
        osd = self.optimizer_state.get("optimizer_state_dict")
        if self.optimizer_state.get("zero_stage") != 3 or not isinstance(osd, dict):
            return None
        state = osd.get("state")
        entry = state.get(0) if isinstance(state, dict) else None
        step = entry.get("step") if isinstance(entry, dict) else None
        if step is not None:
            check_step(step, self.root / "optimizer_state.pt")
            if isinstance(step, torch.Tensor):  # read outside the engine's fills: its record is checked now
                verified.ensure(step, "optimizer_state.pt (step)")
        return step

    @cached_property
    def optimizer_state(self) -> dict:
        f = self.root / "optimizer_state.pt"
        # absent is a checkpoint without one; anything else there (a folder, a device) is loaded, and refused
        obj = load(f) if f.exists() or f.is_symlink() else {}
        if not isinstance(obj, dict):
            raise CheckpointError(f"{f}: expected a dict, got {type(obj).__name__}")
        return obj

    def param_groups(self) -> list[dict[str, Any]]:
        groups = self.optimizer_state.get("param_groups", [])
        experts = {n for layer in self.expert_layers() for n in layer.params}
        if len(groups) == 2 and experts and sorted(bool(g.get("moe")) for g in groups) == [False, True]:
            # DeepSpeed AutoEP's two groups: the experts (``moe``), partitioned over EDP groups, and the rest
            return [{**g, "params": [n for n in self.names if (n in experts) == bool(g.get("moe"))]} for g in groups]
        if len(groups) > 1:  # which parameter belongs to which: the model states' param_shapes, where they say
            recorded = self._recorded_groups
            placed = [n for g in recorded for n in g]
            # buffers (a router's expert bias) and frozen parameters in no group
            optimized = set(self.names) - self._buffer_names - set(self._frozen)
            if len(recorded) == len(groups) and len(placed) == len(set(placed)) and set(placed) == optimized:
                return [{**g, "params": [n for n in names if n in self.names]} for g, names in zip(groups, recorded)]
            raise CheckpointError(f"{self.root / 'optimizer_state.pt'}: {len(groups)} parameter groups, and the "
                                  "model states beside zero/ do not record which parameter belongs to which "
                                  "(param_shapes: one group per optimizer group, every parameter once)")
        return [{**groups[0], "params": [n for n in self.names if n not in self._frozen]}] if groups else []


def _groups(state: dict) -> list[dict]:
    """A model state's ``param_shapes`` as a list of groups."""
    groups = state.get("param_shapes")
    groups = groups if isinstance(groups, list) else [groups] if isinstance(groups, dict) else []
    return [g for g in groups if isinstance(g, dict)]
