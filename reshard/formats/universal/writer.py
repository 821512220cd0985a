"""A universal checkpoint written from any source: ``zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt``
(F whole, as ``{"param": F, ...}``), ``zero/<name>/step.pt``, ``zero/optimizer_state.pt`` and the
tag folder's model states, which DeepSpeed's ``load_universal`` resumes at any topology.

From a DeepSpeed source the files are ``ds_to_universal``'s, byte for byte: each parameter
carries the keys DeepSpeed writes beside ``param`` (``cat_dim``, ...); a ZeRO-3 checkpoint without
TP is written as bare flat tensors and without step files, as its universal loader expects; the
model-state files are copied as they are (AutoEP's rewritten as ``ds_to_universal`` does). From
any other source (DCP, safetensors, a universal checkpoint) the masters are the most precise
weights it holds, cast to fp32, the moments are what it holds, and the one
``mp_rank_00_model_states.pt`` is built as a DeepSpeed job at DP=1 would have saved it
(:func:`model_states`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ...ir.piece import prod
from ...layouts import replicated
from ...storage import torch_zip
from ...storage.pickling import Pickler
from ..contract import BEST, MOMENTS, Buffer, Held, Reader, Slot, Writer
from ..deepspeed.reader import DeepSpeedNative, optimizer_state
from ..hf_order import in_model_order

__all__ = ["UniversalWriter", "model_states"]

DS_VERSION = "0.19.8"  # the DeepSpeed release whose universal loader these files are written for
MODEL_STATES = "mp_rank_00_model_states.pt"


class UniversalWriter(Writer):
    format = "ucp"
    latest = "latest_universal"
    keeps_replicas = False

    def __init__(self, reader: Reader, *, early: Any = None, moments_only: bool = False) -> None:
        self.reader, self.early = reader, early
        self.tag = reader.tag
        own = reader.native("deepspeed")
        self.own = own if isinstance(own, DeepSpeedNative) else None  # a DeepSpeed source: ds_to_universal's files
        self.native = self.own is not None
        self.moments_only = moments_only  # the moments beside another format's weights (safetensors)
        self._maps = {n: replicated(reader.shape(n), 1) for n in reader.names}
        self._buffers = {b.key: b for b in self._declare()}

    def carries(self, held: Held) -> bool:
        """From a DeepSpeed source, what its model-state files hold beside the parameters (copied as
        ds_to_universal copies them), a ZeRO-3 source's frozen parameters among them."""
        if self.own is None:
            return False
        ck = self.own.ck
        if ck.zero_stage == 3 and held.what == "weights" and held.key in ck.frozen.shapes:
            return True  # a ZeRO-3 frozen parameter: its partitions stay in the copied model-state files
        f = Path(held.file)
        return f.parent == ck.tag_dir and f.name.endswith("model_states.pt")

    # -- what each parameter's files hold -----------------------------------------------------
    def _states(self, name: str) -> list[tuple[str, tuple[str, ...]]]:
        """(file state, source states it is made from) for each of ``name``'s state files."""
        have = self.reader.states(name)
        if self.own is not None:
            ck = self.own.ck
            # a module weight without optimizer state (AutoEP's router aliases, a frozen parameter) has fp32
            # only, as in ds_to_universal, which copies ZeRO-1/2 module entries it has no fragments of; at
            # ZeRO-3 it reads no module (placeholders): a frozen parameter stays in the model-state files
            if name in ck.frozen.shapes:
                states = () if ck.zero_stage == 3 else ("fp32",)
            else:
                states = ("fp32",) + MOMENTS if ck.experts is None or ck.has_optimizer_state(name) else ("fp32",)
        else:
            states = ("fp32",) + tuple(m for m in MOMENTS if m in have)
        if self.moments_only:
            states = tuple(s for s in states if s in MOMENTS)
        return [(s, BEST if s == "fp32" else (s,)) for s in states]

    def _declare(self) -> list[Buffer]:
        """Each parameter's state files, whole; built from another format, the model states' weights."""
        out = [Buffer(_file(n, state), torch.float32, prod(self.reader.shape(n)), (Slot(0, n, want, self._maps[n], 0),))
               for n in self.reader.names for state, want in self._states(n)]
        if self.own is None and not self.moments_only:
            out += [Buffer(f"{MODEL_STATES}:{n}", torch.float32, prod(self.reader.shape(n)),
                           (Slot(0, n, BEST, self._maps[n], 0),)) for n in self.reader.names]
        return out

    def buffers(self) -> list[Buffer]:
        return list(self._buffers.values())

    def meta(self) -> dict[str, Any]:
        return {"target": "universal checkpoint"}

    def notes(self) -> list[str]:
        return []

    def _bare(self, name: str) -> bool:
        """DeepSpeed's converter writes a ZeRO-3 checkpoint without TP as bare flat tensors, and no
        step file at any TP degree (under AutoTP: {'param': full tensor}); AutoEP experts keep
        their dict at any stage."""
        ck = self.own.ck if self.own is not None else None
        return ck is not None and ck.zero_stage == 3 and ck.tp == 1 and ck.expert(name) is None

    def _steps(self) -> bool:
        return not (self.own is not None and self.own.ck.zero_stage == 3)

    # -- files ---------------------------------------------------------------------------------
    def jobs(self, engine: Any, staging: Any) -> list[tuple[int, Callable[[], None]]]:
        reader = self.reader
        jobs = [(prod(reader.shape(n)) * 12, partial(self._param, engine, staging, n)) for n in reader.names]
        if not self.moments_only:
            jobs += self._model_state_jobs(engine, staging)
            jobs.append((1, partial(self._optimizer_state, staging)))
        jobs.sort(key=lambda job: -job[0])
        return jobs

    def _param(self, engine: Any, staging: Any, name: str) -> None:
        shape = self.reader.shape(name)
        extra = self.reader.extras(name) if self.native else {}
        for state, _ in self._states(name):
            buf = self._buffers[_file(name, state)]
            ref = engine.storage(buf).view((prod(shape),) if self._bare(name) else shape)
            with staging.open(buf.key) as out:
                torch_zip.save(ref if self._bare(name) else {**extra, "param": ref}, out, pickler=Pickler)
        step = self.reader.step(name) if self._steps() else None
        if step is not None:
            with staging.open(f"zero/{name}/step.pt") as out:
                torch_zip.save(step.clone() if isinstance(step, torch.Tensor) else step, out, pickler=Pickler)

    def _optimizer_state(self, staging: Any) -> None:
        if self.own is not None:
            state = optimizer_state(self.own.ck)
        else:
            index = {n: i for i, n in enumerate(self.reader.names)}
            groups = [{**g, "params": [index[n] for n in g.get("params", []) if n in index]}
                      for g in self.reader.param_groups()]
            state = {"overflow": False, "ds_version": DS_VERSION, "param_groups": groups}
        with staging.open("zero/optimizer_state.pt") as out:
            torch_zip.save(state, out, pickler=Pickler)

    def _model_state_jobs(self, engine: Any, staging: Any) -> list[tuple[int, Callable[[], None]]]:
        if self.own is None:
            size = sum(prod(self.reader.shape(n)) for n in self.reader.names) * 4 + 1
            return [(size, partial(self._built_model_states, engine, staging))]
        ck = self.own.ck
        copies = [ck.model_files[m] for m in range(ck.mp)]
        copies += [src for (t, d), src in sorted(ck.z3_model_files.items()) if t or d]
        kept = frozenset()
        if self.early is not None:  # started from the files' names alone: keep those copied as they are
            if ck.experts is None:
                kept = self.early.files & set(copies)
            for src in self.early.files - kept:
                self.early.drop(src)
        if ck.experts is not None:  # ds_to_universal rewrites these under AutoEP
            return [(src.stat().st_size, partial(_autoep_model_state, ck, staging, m, src))
                    for m, src in enumerate(copies)]
        # a copy under way since start-up goes last: by then it is done, and no worker waits for it
        return [(0, partial(self.early.take, src)) if src in kept else
                (src.stat().st_size, partial(staging.copy, src, src.name)) for src in copies]

    def _built_model_states(self, engine: Any, staging: Any) -> None:
        """Each weight an fp32 placeholder, read when the writer reaches it."""
        weights = {n: engine.storage(self._buffers[f"{MODEL_STATES}:{n}"]).view(self.reader.shape(n))
                   for n in self.reader.names}
        with staging.open(MODEL_STATES) as out:  # streamed: one weight in memory at a time
            torch_zip.save(model_states(self.reader, weights), out, pickler=Pickler)


def _file(name: str, state: str) -> str:
    return f"zero/{name}/{state}.pt"


def _autoep_model_state(ck: Any, staging: Any, m: int, src: Path) -> None:
    from ..deepspeed import experts

    name = src.name
    state = (experts.universal_model_state_z3(src) if ck.zero_stage == 3  # one file per DP rank
             else experts.universal_model_state(ck, m))
    with staging.writing(name):  # saved by path: torch names the zip's root folder after the file, as DeepSpeed's
        torch_zip.save(state, staging.path(name), pickler=Pickler)


def _global_steps(reader: Reader) -> int:
    """DeepSpeed's ``global_steps`` of a source without skipped steps: Adam's step count (the
    largest one recorded; 0 without optimizer state)."""
    steps = []
    for n in reader.names:
        s = reader.step(n)
        if s is not None:
            steps.append(float(s.item() if isinstance(s, torch.Tensor) else s))
    return int(max(steps, default=0.0))


def model_states(reader: Reader, module: dict[str, Any]) -> dict[str, Any]:
    """``mp_rank_00_model_states.pt`` as DeepSpeed 0.19.8's ``_save_checkpoint`` writes it for a
    ZeRO-1 job at DP=1 x TP=1 x PP=1 (keys in its order), from what any source records.

    A universal resume (``checkpoint.load_universal``) reads of this file only ``dp_world_size``,
    ``global_steps``, ``skipped_steps``, ``mp_world_size`` (which must equal the number of
    ``mp_rank_*_model_states.pt`` files: 1), ``lr_scheduler`` (when the job has a scheduler) and
    ``global_samples`` (optional); it never loads ``module`` (weights come from ``zero/``), and
    the rest reaches the caller as client state or serves offline tools."""
    names = set(reader.names)
    groups = reader.param_groups()
    # each group in the model's order where the source tells it (a DeepSpeed target written from this
    # checkpoint flattens each group in the order recorded here, and DeepSpeed loads it by position):
    # a Megatron source in HF names lists its groups in its mapping document's order, not the model's
    order = reader.model_order()
    if not groups:  # no optimizer (an HF folder): one group of the model's parameters
        groups = [{"params": [n for n in order if n in names]}] if order else []
    elif order:
        groups = [{**g, "params": in_model_order(g.get("params", []), order) or g.get("params", [])} for g in groups]
    # DeepSpeed's param_shapes: one OrderedDict name -> torch.Size per parameter group, in the
    # optimizer's order; entries no group lists are buffers (or tied weights, or frozen ones the source
    # cannot tell apart), which DeepSpeed keeps in module alone and names in buffer_names; frozen
    # parameters the source names (Reader.frozen) are in module alone, as DeepSpeed's ZeRO-1 keeps them.
    param_shapes = [OrderedDict((n, torch.Size(reader.shape(n))) for n in g.get("params", []) if n in names)
                    for g in groups]
    optimized = {n for shapes in param_shapes for n in shapes}
    frozen = set(reader.frozen())  # a module entry in no group and not a buffer: how DeepSpeed's ZeRO-1 keeps them
    return {
        "module": OrderedDict((n, module[n]) for n in reader.names),  # fp32 (never loaded by a universal resume)
        "buffer_names": [n for n in reader.names if n not in optimized and n not in frozen],
        "optimizer": None,  # ZeRO keeps the optimizer state elsewhere (here: zero/)
        "param_shapes": param_shapes,
        "frozen_param_shapes": None,  # ZeRO-1 records none (ZeRO-2 would: {} without frozen ones)
        "shared_params": {},  # the source records no tying; a tied copy is an entry of its own
        "frozen_param_fragments": None,
        "lr_scheduler": None,  # the source's state has no scheduler
        "data_sampler": None,  # no curriculum learning
        "random_ltd": None,  # no random layer-token drop
        "skipped_steps": 0,  # every step of the source updated the weights (no fp16 overflow skips)
        # global_steps counts skipped steps too, so = Adam's step + skipped_steps. DeepSpeed also
        # writes global_samples (= steps x train batch size), which the source does not record: it
        # is left out, and the resuming engine computes exactly that from its own batch size.
        "global_steps": _global_steps(reader),
        "dp_world_size": 1,  # one full copy of every tensor (the universal layout has no DP shards)
        "mp_world_size": 1,  # one model-states file
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": {},  # no DeepSpeed job wrote this; readers take it as a dict with defaults
        "ds_version": DS_VERSION,
    }
