"""A Megatron-Core ``torch_dist`` checkpoint at TP x PP x DP (x EP), written from any source, as
Megatron-LM's ``save_checkpoint`` lays it out closely enough that ``load_checkpoint`` (and
``dist_checkpointing.load``) reads it at the target topology: ``OUT/<tag>/`` is a save folder
holding ``latest_checkpointed_iteration.txt`` and ``iter_NNNNNNN/`` (``release/`` from a source
without iterations): ``metadata.json``, one ``__R_0.distcp`` per global rank and ``.metadata``.

* Model keys stacked over layers (and experts), one chunk per TP part (``target``); the
  optimizer state as ``optimizer`` says: ``none``, plain ``adam`` (moments chunked as the model),
  ``fully_reshardable`` (fp32 main parameters and moments chunked as the model) or
  ``dp_reshardable`` (each model-parallel rank's buckets over its DP group, Megatron's layout).
* From a Megatron source (its own names) every key's target map is planned against the source's
  map of the same key. From any other source (Hugging Face names: safetensors, a Megatron source
  read with HF names, ...) each target chunk is split by the architecture mapping document into
  one slot per HF tensor block (``hfmap.restrict``): a QKV chunk is q, k and v slots per query
  group, an fc1 chunk gate or up.
* Pipeline stages: ``vpp`` (``--vpp``) virtual stages per stage, placed as Megatron places them
  (``Arch.chunk_layers``), the args' virtual-stage fields as ``validate_args`` leaves them; by
  default the source's virtual / uneven stages at the source's PP, else even plain stages.
* Objects: ``common_state`` (``common``), the ``_extra_state`` placeholders, and, where Megatron
  would load them (TP and PP, or the whole job, unchanged), the source's ``rng_state`` and
  rerun-state records copied as they are.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ...errors import ReshardError
from ...ir.param_map import ParamMap
from ..contract import BEST, MODULE, Buffer, Held, Reader, Slot, Writer
from ..dcp.records import DcpFile, Record, TensorSpec, metadata_bytes
from ..deepspeed.autoep_hf import AutoEPHfView, autoep_hf_view
from ..table import noun_of
from . import safe
from .buckets import FULLY_RESHARDABLE_SHIFTED, bucket_size, several_buckets
from .common import KINDS, args_for, buffer_dtype, common_state, default_groups, extra_state_keys
from .dist import TorchDistBackend
from .files import TRACKER, iteration_folder
from .grouped import TE_GROUPED, te_grouped
from .held import carried
from .hfconfig import args_from_hf, padded_vocab
from .hfmap import hf_params, hub_document, restrict
from .model import EMBED, OUTPUT, Arch
from .reader import MegatronReader
from .target import TargetLayout

__all__ = ["MegatronWriter"]

METADATA_JSON = b'{"sharded_backend": "torch_dist", "sharded_backend_version": 1}'
_KIND_KEYS = {"fp32": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


def _positive(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ReshardError(f"{what} must be a positive integer (--{what}), got {value!r}")
    return value


def _config_file(folder: str | Path) -> dict:
    """``config.json`` of the folder ``--hf-config`` names (a source in HF names without one)."""
    path = Path(folder) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ReshardError(f"{path}: unreadable (--hf-config takes the folder of a model's config.json: {e})") from None
    if not isinstance(cfg, dict):
        raise ReshardError(f"{path}: not a JSON object")
    return cfg


def _want(state: str) -> tuple[str, ...]:
    return MODULE if state == "weight" else BEST if state == "fp32" else (state,)


class MegatronWriter(Writer):
    format = "megatron"
    latest = None  # the tracker is inside the committed save folder
    keeps_replicas = False  # torch_dist keeps one copy of each replicated block

    def __init__(self, reader: Reader, *, tp: int | None = None, pp: int | None = None, dp: int | None = None,
                 ep: int | None = None, etp: int | None = None, optimizer: str | None = None,
                 dtype: torch.dtype | None = None, hf_config: str | Path | None = None,
                 megatron_args: str | Path | None = None, vpp: int | None = None) -> None:
        own = reader.native("megatron")
        self.own = own if isinstance(own, MegatronReader) else None  # a Megatron source: its args, files, naming
        self._notes: list[str] = []
        self._hf_view: Reader | None = None  # a DeepSpeed AutoEP source in HF names (autoep.json, read back)
        cfg = (_config_file(hf_config) if hf_config is not None else reader.hf_config()) \
            if self.own is None and megatron_args is None else None
        if cfg:
            view = autoep_hf_view(reader, cfg)
            if isinstance(view, AutoEPHfView):
                self._hf_view = reader = view
                self._notes.append(view.how)
        self.reader = reader
        self.native = self.own is not None and self.own.naming == "megatron"
        # another format's source in Megatron's names (DCP / universal written from a Megatron source): the model's
        # args, optimizer groups and run state from the Megatron checkpoint --megatron-args names
        self.ref = self._reference(reader, megatron_args, hf_config)
        if self.ref is not None:
            self.extra_sources = self.ref.sources
        src = self.own.arch if self.own is not None else self.ref.arch if self.ref is not None else None
        tp = _positive(tp, "tp") if tp is not None else (src.tp if src else 1)
        pp = _positive(pp, "pp") if pp is not None else (src.pp if src else 1)
        dp = _positive(dp, "dp") if dp is not None else (src.dp if src else 1)
        self.source: MegatronReader | None = None  # the source cut to the target's vocabulary rows (view)
        etp = _positive(etp, "etp") if etp is not None else None
        self._vpp = _positive(vpp, "vpp") if vpp is not None else None
        if self.own is not None:
            if hf_config is not None:
                raise ReshardError("--hf-config: a Megatron target from a Megatron source keeps the source's args")
            self._from_megatron(self.own, tp, pp, dp, ep, etp, optimizer, dtype)
        elif self.ref is not None:
            self._from_megatron(self.ref, tp, pp, dp, ep, etp, optimizer, dtype, data=reader)
        else:
            self._from_hf(reader, tp, pp, dp, ep, etp, optimizer, dtype, hf_config)
        if self.kind == "dp_reshardable" and te_grouped(self.args):
            raise ReshardError(f"--optimizer dp_reshardable from a source of {TE_GROUPED}: its buckets (every expert's "
                               "fc1, then fc2) are not written by reshard; --optimizer fully_reshardable or adam")
        if self.kind == "fully_reshardable" and several_buckets(self.args, self.arch, "target args"):
            raise ReshardError(f"--optimizer fully_reshardable where the source's args (overlap_grad_reduce, "
                               f"ddp_bucket_size) make several DDP buckets: {FULLY_RESHARDABLE_SHIFTED} is not written "
                               "by reshard; --optimizer dp_reshardable keeps the buckets")
        self.tag = reader.tag
        self.folder = iteration_folder(self.iteration)
        self.layout = TargetLayout(self.arch, buckets=self.kind == "dp_reshardable", vocab_rows=self.vocab_rows,
                                   bucket_size=self._bucket_size)
        self.states = {"none": (), "adam": ("exp_avg", "exp_avg_sq"),
                       "fully_reshardable": ("fp32", "exp_avg", "exp_avg_sq"),
                       "dp_reshardable": ("fp32", "exp_avg", "exp_avg_sq")}[self.kind]
        self._slots: dict[tuple[str, str], dict[int, list[Slot]]] = {}
        for spec in self.arch.keys():
            self._plan_key(spec.key, "weight", self.layout.maps[spec.key])
            for s in () if spec.buffer else self.states:
                m = self.layout.bucket_maps[spec.key] if self.kind == "dp_reshardable" else self.layout.maps[spec.key]
                self._plan_key(spec.key, s, m)
        self._chunks = self._declare()
        self.records: list[Record] = []
        self.specs: dict[str, TensorSpec] = {}
        self._lock = threading.Lock()

    # -- which target --------------------------------------------------------------------------
    @staticmethod
    def _reference(reader: Reader, megatron_args: str | Path | None, hf_config: str | Path | None
                   ) -> MegatronReader | None:
        """The Megatron checkpoint ``--megatron-args`` names, for a source of another format."""
        if megatron_args is None:
            return None
        if isinstance(reader.native("megatron"), MegatronReader):
            raise ReshardError("--megatron-args: a Megatron target from a Megatron source keeps the source's args")
        if hf_config is not None:
            raise ReshardError("--megatron-args and --hf-config: the model's args come from one of them (Megatron's "
                               "names with --megatron-args, Hugging Face names with --hf-config)")
        try:
            ref = MegatronReader.open(megatron_args)
        except FileNotFoundError as e:
            raise ReshardError(f"--megatron-args {megatron_args}: not a Megatron checkpoint ({e})") from None
        return ref

    def _from_megatron(self, own: MegatronReader, tp: int, pp: int, dp: int, ep: int | None, etp: int | None,
                       optimizer: str | None, dtype: torch.dtype | None, data: Reader | None = None) -> None:
        """The target of a Megatron source ``own``, or (``data``) of a source in Megatron's names whose
        args, optimizer groups and run state are those of the Megatron checkpoint ``own``."""
        src, args = own.arch, own.args
        if dtype is not None and dtype != own.dtype(own.names[0], "weight"):
            raise ReshardError("--dtype: a Megatron target from a Megatron source keeps the source's training dtype"
                               if data is None else "--dtype: a Megatron target takes the training dtype of the "
                               "checkpoint --megatron-args names")
        divisible = int(getattr(args, "make_vocab_size_divisible_by", 128) or 128)
        ep = ep if ep is not None else src.ep
        if etp is None:  # expert TP follows TP unless the source kept it apart (MoE parallel folding)
            etp = tp if src.etp == src.tp else src.etp
        arch = dataclasses.replace(src, tp=tp, pp=pp, dp=dp, ep=ep, etp=etp,
                                   padded_vocab=padded_vocab(src.vocab, divisible, tp))
        arch = self._virtual(arch, src, args)
        arch.check("target topology")
        moments = data is None or any("exp_avg" in data.states(n) for n in data.names)
        self.kind = optimizer or (own.src.sharding if moments else "none")
        self._check_kind()
        self.arch = arch
        self.iteration = own.iteration
        self.template = own.src.common if isinstance(own.src, TorchDistBackend) else own.src.state_dict(min(own.src.files))
        self.args = args_for(args, arch, self.kind)
        self.dtype = own.dtype(own.names[0], "weight")
        if data is None:
            self.hf = None if self.native else self._hf_names(own)
            self.vocab_rows = self._vocab_rows(own)
        else:
            self.hf = None
            self.vocab_rows = self._megatron_names(data, own)
        groups = own.src.param_groups()  # dense optimizer's, then the experts' (is_expert_parallel)
        dense = [g for g in groups if not g.get("is_expert_parallel")] or default_groups(args)
        self.groups = [dense]
        if arch.expert_apart:  # else the experts join the dense optimizer's groups (one optimizer)
            # a source with one optimizer (EP=1): its groups with the flag Megatron sets, those the experts fill
            # (Megatron makes a group only for parameters it has: no biases, no no-decay expert group)
            decays = {s.decay for s in arch.keys() if s.expert}
            self.groups.append([g for g in groups if g.get("is_expert_parallel")]
                               or [dict(g, is_expert_parallel=True) for g in dense
                                   if (g.get("wd_mult", 1.0) != 0) in decays])
        self.step = self._step(own if data is None else data)
        if data is not None:
            self._check_run(data, own)

    def _from_hf(self, reader: Reader, tp: int, pp: int, dp: int, ep: int | None, etp: int | None,
                 optimizer: str | None, dtype: torch.dtype | None, hf_config: str | Path | None) -> None:
        cfg = _config_file(hf_config) if hf_config is not None else reader.hf_config()
        if not isinstance(cfg, dict):
            raise ReshardError(f"{reader.sources[-1]}: a Megatron target from {noun_of(reader)} needs the "
                               "model's Hugging Face config.json beside its weights (or --hf-config DIR)"
                               + (", or, in Megatron's names, a Megatron checkpoint of the model (--megatron-args "
                                  "CKPT)" if EMBED in reader.names else ""))
        have = {reader.dtype(n, s) for n in reader.names for s in reader.states(n)[:1]}
        dtype = dtype or (have.pop() if len(have) == 1 else torch.float32)
        self.args = args_from_hf(cfg, tp=tp, pp=pp, dp=dp, dtype=dtype, ep=ep or 1, etp=etp)
        self.arch = self._virtual(Arch.from_args(self.args, f"{reader.sources[-1]}: config.json"), None, self.args)
        self.kind = optimizer or "none"
        self._check_kind()
        self.args = args_for(self.args, self.arch, self.kind)
        self.iteration, self.template, self.dtype = None, None, dtype
        self.hf = self._hf_names(reader)
        self.vocab_rows = self.arch.vocab
        self.groups = [default_groups(self.args)]
        if self.arch.expert_apart:  # the experts' optimizer: Megatron makes only the groups they fill (decay)
            self.groups.append([g for g in default_groups(self.args, expert=True) if g["wd_mult"] != 0])
        self.step = self._step(reader)
        self._notes.append(f"args built from config.json (Megatron-LM defaults for training fields); a release "
                           f"checkpoint, padded vocabulary {self.arch.padded_vocab}")

    def _virtual(self, arch: Arch, src: Arch | None, args: Any) -> Arch:
        """``arch`` (the target's sizes) over the target's virtual stages: ``--vpp``, else the
        source's at the source's PP (uneven first / last stages too), else none. At a new PP the
        stages are even; a new VPP at the source's PP keeps its uneven first / last stage."""
        if src is None or arch.pp != src.pp:
            arch = arch.evened()
        vpp = self._vpp
        if vpp is None or vpp == arch.vpp:
            return arch
        if vpp > 1 and arch.pp == 1:
            raise ReshardError(f"--vpp {vpp} with --pp 1: Megatron interleaves virtual pipeline stages over several "
                               "pipeline stages only")
        if vpp > 1 and arch.pp <= 2 and getattr(args, "overlap_p2p_comm", True) is False \
                and getattr(args, "virtual_pipeline_model_parallel_size", None):
            raise ReshardError(f"--vpp {vpp} at PP={arch.pp}: the source's args turn off overlap_p2p_comm, with which "
                               "Megatron's interleaved schedule needs more than 2 pipeline stages")
        out = dataclasses.replace(arch, vpp=vpp)
        try:
            out.check("target topology")
        except ReshardError as e:
            raise ReshardError(f"--vpp {vpp} at PP={arch.pp}: Megatron cannot build it ({e})") from None
        return out

    def _check_kind(self) -> None:
        if self.kind not in KINDS:
            raise ReshardError(f"optimizer (--optimizer) must be one of {', '.join(KINDS)}, got {self.kind!r}")

    def _hf_names(self, reader: Reader) -> dict[str, list]:
        """Each key's HF tensors, checked against the source's names and shapes: of the Megatron
        source's own mapping, else of the document whose names an HF source holds (experts fused
        as transformers 5 holds them in memory, or apart as save_pretrained and the Hub write them)."""
        out: dict[str, list] = {}
        have = set(reader.names)
        doc = self.own.mapping if self.own is not None else None
        if self.own is None and self.arch.experts:  # the layout the folder holds more of (a missing name is named)
            docs: list[Any] = [None, hub_document(self.arch)]
            doc = min(docs, key=lambda d: sum(p.name not in have for p in hf_params(self.arch, d)))
        for p in hf_params(self.arch, doc):
            if p.name not in have:
                raise ReshardError(f"{reader.sources[-1]}: has no {p.name!r}, which the Megatron model needs")
            if tuple(reader.shape(p.name)) != tuple(p.valid):
                raise ReshardError(f"{reader.sources[-1]}: {p.name!r} is {list(reader.shape(p.name))}, the config "
                                   f"implies {list(p.valid)}")
            out.setdefault(p.key, []).append(p)
        lacking = [s.key for s in self.arch.keys() if s.key not in out]
        if lacking:  # under HF names a key the document gives no place (an MTP layer) cannot be filled
            raise ReshardError(f"{reader.sources[-1]}: the Megatron target's key {lacking[0]!r} (of {len(lacking)}) has "
                               "no Hugging Face name in the architecture mapping, so a source read under HF names "
                               "cannot fill it (read a Megatron source under its own names: --names megatron)")
        extra = sorted(have - {p.name for ps in out.values() for p in ps})
        if extra:
            raise ReshardError(f"{reader.sources[-1]}: {extra[0]!r} (of {len(extra)}) has no Megatron key in the "
                               "architecture mapping (--drop REGEX leaves such tensors out, recorded in the report)")
        return out

    def _megatron_names(self, data: Reader, ref: MegatronReader) -> int:
        """Every key of the model ``ref``'s args describe, checked against the names and shapes of a
        source in Megatron's names; the vocabulary rows it holds (the padded vocabulary of the
        topology it came from), which the target's padded vocabulary must hold."""
        where = data.sources[-1]
        have = set(data.names)
        for s in ref.arch.keys():
            if s.key not in have:
                raise ReshardError(f"{where}: has no {s.key!r}, which the Megatron model of --megatron-args "
                                   f"{ref.sources[0]} holds (is the source in Megatron's names, of that model?)")
            want = self.arch.full_shape(s)
            got = tuple(data.shape(s.key))
            if s.key in (EMBED, OUTPUT):
                ok = len(got) == 2 and got[1:] == want[1:] and self.arch.vocab <= got[0]
            else:
                ok = got == want
            if not ok:
                raise ReshardError(f"{where}: {s.key!r} is {list(got)}, the args of --megatron-args "
                                   f"{ref.sources[0]} imply {list(want)}")
        extra = sorted(have - {s.key for s in ref.arch.keys()})
        if extra:
            raise ReshardError(f"{where}: {extra[0]!r} (of {len(extra)}) is no key of the Megatron model of "
                               f"--megatron-args {ref.sources[0]} (--drop REGEX leaves such tensors out, recorded in "
                               "the report)")
        rows = data.shape(EMBED)[0]
        if rows > self.arch.padded_vocab:
            raise ReshardError(f"{where}: {EMBED!r} holds {rows} vocabulary rows, more than the target's padded "
                               f"vocabulary ({self.arch.padded_vocab} at TP={self.arch.tp}): not written by reshard "
                               "from a source of another format")
        return rows

    def _check_run(self, data: Reader, ref: MegatronReader) -> None:
        """The run state a target in Megatron's names takes from ``ref`` (iteration, learning-rate
        scheduler) must be the source's: their optimizer steps agree."""
        mine = self._step(ref)
        if self.kind != "none" and any(data.step(n) is not None for n in data.names) and mine != self.step:
            raise ReshardError(f"{data.sources[-1]}: its optimizer step {self.step:g} is not that of --megatron-args "
                               f"{ref.sources[0]} ({mine:g}), whose iteration and learning-rate scheduler the target "
                               "would take; --megatron-args the Megatron checkpoint of the same step, or --optimizer "
                               "none")
        self._notes.append(f"args, optimizer groups and run state (iteration {self.iteration}, learning-rate "
                           f"scheduler) from the Megatron checkpoint {ref.sources[0]} (--megatron-args)")

    def _vocab_rows(self, own: MegatronReader) -> int:
        if self.hf is not None:
            return self.arch.vocab
        rows = own.shape(EMBED)[0]
        if rows > self.arch.padded_vocab:  # fewer padding rows at the target: read the first ones (view)
            self.source = own.with_vocabulary(self.arch.padded_vocab)
            self._notes.append(f"padded vocabulary {rows} -> {self.arch.padded_vocab} rows (the first kept)")
            return self.arch.padded_vocab
        return rows

    def _step(self, reader: Reader) -> float:
        for n in reader.names:
            s = reader.step(n)
            if s is not None:
                return float(s.item() if isinstance(s, torch.Tensor) else s)
        if self.kind != "none":
            self._notes.append("the source holds no optimizer step: written as 0 with zero moments")
        return 0.0

    # -- targets and slots -----------------------------------------------------------------------
    def _plan_key(self, key: str, state: str, m: ParamMap) -> None:
        want = _want(state)
        slots: dict[int, list[Slot]] = {}
        if self.hf is None:
            slots = {r: [Slot(0, key, want, m, r)] for r in m.ranks}
        else:
            for p in self.hf[key]:
                hm, origin = restrict(m, p)
                for label, (r, lo, _) in origin.items():
                    slots.setdefault(r, []).append(Slot(lo, p.name, want, hm, label))
        self._slots[(key, state)] = slots

    def _declare(self) -> list[list[_Chunk]]:
        """Each global rank's file's tensor chunks, in the order it writes them: the model's
        tensors (weights, and the optimizer states beside them unless in buckets), then its chunks
        of the distributed optimizer's buckets (a bucket's padding a chunk without slots)."""
        world = self.arch.tp * self.arch.pp * self.arch.dp
        out: list[list[_Chunk]] = [[] for _ in range(world)]

        def put(r: int, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...], dtype: torch.dtype,
                slots: list[Slot], shape: tuple[int, ...]) -> None:
            n = 1
            for x in sizes:
                n *= x
            buf = Buffer(f"__{r}_0.distcp:{key}@{list(offsets)}", dtype, n, tuple(slots))
            out[r].append(_Chunk(buf, key, tuple(offsets), tuple(sizes), tuple(shape)))

        model_states = ("weight",) + (self.states if self.kind != "dp_reshardable" else ())
        for key, chunks in self.layout.model.items():
            for state in model_states:
                if state != "weight" and (key, state) not in self._slots:
                    continue  # a buffer: no optimizer state
                for c in chunks:
                    put(c.rank, self._tensor_key(key, state), c.offsets, c.sizes, self._dtype(state, key),
                        self._slots[(key, state)].get(c.label, []), self.layout.maps[key].logical_shape)
        # the last stage's embedding copy: each range written as the first stage's range of the same
        # local parameter (both alone in their buckets, so cut alike)
        first = {(bc.param.label, bc.at, bc.end - bc.start): bc.label for b in self.layout.buckets for bc in b.chunks
                 if bc.param is not None and bc.param.spec.key == EMBED and not bc.copy}
        for b in self.layout.buckets:
            for state in self.states:
                bkey = self._bucket_key(b.prefix, b.m, state, b.gbuf, b.idx)
                for bc in b.chunks:
                    label = first[(bc.param.label, bc.at, bc.end - bc.start)] if bc.copy and bc.param else bc.label
                    slots = [] if bc.param is None else self._slots[(bc.param.spec.key, state)].get(label, [])
                    put(bc.rank, bkey, (bc.start,), (bc.end - bc.start,), torch.float32, slots, (b.unpadded,))
        return out

    def buffers(self) -> list[Buffer]:
        return [c.buffer for chunks in self._chunks for c in chunks]

    def view(self, reader: Reader) -> Reader:
        return self.source if self.source is not None else self._hf_view if self._hf_view is not None else reader

    def meta(self) -> dict[str, Any]:
        a = self.arch
        return {"target": "Megatron-Core torch_dist checkpoint", "optimizer": self.kind,
                "target_topology": {"tp": a.tp, "pp": a.pp, "dp": a.dp,
                                    **({"ep": a.ep, "etp": a.etp} if a.experts else {})}}

    def notes(self) -> list[str]:
        return list(self._notes)

    # -- files ---------------------------------------------------------------------------------
    def _tensor_key(self, key: str, state: str) -> str:
        if state == "weight":
            return key
        return f"optimizer.state.{_KIND_KEYS[state]}.{key}"

    def _bucket_size(self, pp: int, vp: int) -> int | None:
        """Megatron's bucket size at the target (the source's bucket args kept: one bucket unless
        they ask for several)."""
        return bucket_size(self.args, self.arch, pp, vp, "target args")

    def _bucket_key(self, prefix: str, m: int, state: str, gbuf: int = 0, idx: int = 0) -> str:
        return (f"{prefix}optimizer.distributed.dp_group_idx_{m}.gbuf_idx_{gbuf}.dtype_{buffer_dtype(self.args)}"
                f".bucket_idx_{idx}.{_KIND_KEYS[state]}")

    def jobs(self, engine: Any, staging: Any) -> list[tuple[int, Callable[[], None]]]:
        world = self.arch.tp * self.arch.pp * self.arch.dp
        sizes = [1] * world
        for chunks in self.layout.model.values():
            for c in chunks:
                n = 1
                for x in c.sizes:
                    n *= x
                sizes[c.rank] += n * (1 + len(self.states) * (self.kind != "dp_reshardable"))
        for b in self.layout.buckets:
            for bc in b.chunks:
                sizes[bc.rank] += (bc.end - bc.start) * 3
        jobs = [(sizes[r] * 4, partial(self._rank_file, engine, staging, r)) for r in range(world)]
        jobs.append((1, partial(self._small, staging)))
        return jobs

    def _small(self, staging: Any) -> None:
        with staging.open(f"{self.folder}/metadata.json") as out:
            out.write(METADATA_JSON)
        with staging.open(TRACKER) as out:
            out.write(("release" if self.iteration is None else str(self.iteration)).encode())

    def carries(self, held: Held) -> bool:
        """What ``_objects`` copies of a Megatron source (``held.carried``); AutoEP's router alias,
        written as its router (checked equal to it)."""
        if isinstance(self._hf_view, AutoEPHfView) and held.key in self._hf_view.aliases():
            return True
        src = self.own.src if self.own is not None else None
        if not isinstance(src, TorchDistBackend) or src.ck is None:
            return carried(held, template=self.template is not None, objects=set(), rng=False, rerun=False)
        s, t = src.arch, self.arch
        return carried(held, template=True, objects=set(extra_state_keys(t)) & set(src.ck.objects),
                       rng=(s.tp, s.pp) == (t.tp, t.pp), rerun=(s.tp, s.pp, s.dp) == (t.tp, t.pp, t.dp))

    def _objects(self, r: int) -> list[tuple[str, bytes]]:
        """The object records of global rank ``r``'s file (objects come first, as DCP writes them)."""
        a, out = self.arch, []
        if r == 0:
            common = common_state(self.template, self.args, a, self.kind, self.groups, self.step,
                                  self.iteration or 0)
            out.append(("common_state/shard_0_1", safe.dumps([common])))
            src = self.own.src if self.own is not None else None
            objects = src.ck.objects if isinstance(src, TorchDistBackend) and src.ck is not None else {}
            for key in extra_state_keys(a):
                out.append((key, src.raw(key) if isinstance(src, TorchDistBackend) and key in objects
                            else safe.dumps([None])))
        if self.kind == "dp_reshardable":
            dtypes = buffer_dtype(self.args)
            for b in self.layout.buckets:
                first = next(c.rank for c in b.chunks)
                if first != r or b.gbuf or b.idx:
                    continue
                mine = [x for x in self.layout.buckets if (x.prefix, x.m) == (b.prefix, b.m)]
                gbufs = [[x for x in mine if x.gbuf == g] for g in sorted({x.gbuf for x in mine})]  # one per chunk
                pre = f"{b.prefix}optimizer.distributed.dp_group_idx_{b.m}"
                groups = self.groups[1 if b.prefix == "chained_1." else 0]
                out += [(f"{pre}.optimizer/shard_0_1", safe.dumps([{"param_groups": [
                            dict({k: v for k, v in g.items() if k != "params"}, step=self.step) for g in groups]}])),
                        (f"{pre}.per_bucket_numel/shard_0_1",
                         safe.dumps([[{dtypes: [x.numel for x in g]} for g in gbufs]])),
                        (f"{pre}.per_bucket_numel_unpadded/shard_0_1",
                         safe.dumps([[{dtypes: [x.unpadded for x in g]} for g in gbufs]]))]
        out += self._copied(r)
        return out

    def _copied(self, r: int) -> list[tuple[str, bytes]]:
        """The source's rng and rerun records, where Megatron would load them at the target."""
        src = self.own.src if self.own is not None else None
        if not isinstance(src, TorchDistBackend) or src.ck is None:
            return []
        s, t = src.arch, self.arch
        out = []
        tp, dp, pp = r % t.tp, (r // t.tp) % t.dp, r // (t.tp * t.dp)
        if (s.tp, s.pp) == (t.tp, t.pp) and dp == 0:
            key = f"rng_state/shard_{pp}.{tp}_{t.pp}.{t.tp}"
            if key in src.ck.objects:
                out.append((key, src.raw(key)))
        if (s.tp, s.pp, s.dp) == (t.tp, t.pp, t.dp):
            key = f"rerun_state_machine_state/shard_{r}_{t.world}"
            if key in src.ck.objects:
                out.append((key, src.raw(key)))
        return out

    def _rank_file(self, engine: Any, staging: Any, r: int) -> None:
        rel = f"{self.folder}/__{r}_0.distcp"
        with staging.open(rel) as out:
            f = DcpFile(out, rel.rsplit("/", 1)[1])
            for key, raw in self._objects(r):
                out.write(raw)
                f.records.append(Record(key, None, f.name, f.at, len(raw)))
                f.at += len(raw)
            for c in self._chunks[r]:
                self._chunk(engine, f, c)
        with self._lock:
            self.records.extend(f.records)

    def _dtype(self, state: str, key: str | None = None) -> torch.dtype:
        """The training dtype for weights; fp32 for optimizer states and buffers (Megatron keeps the
        router's expert_bias in fp32 whatever the model's dtype)."""
        if state == "weight" and not (key is not None and self.arch.spec(key).buffer):
            return self.dtype
        return torch.float32

    def _chunk(self, engine: Any, f: DcpFile, c: _Chunk) -> None:
        dtype = c.buffer.dtype
        f.tensor(c.key, c.offsets, dtype, c.sizes, engine.fill(c.buffer))
        with self._lock:
            spec = self.specs.get(c.key)
            chunks = (spec.chunks if spec else ()) + ((c.offsets, c.sizes),)
            self.specs[c.key] = TensorSpec(dtype, c.shape, chunks)

    def finish(self, staging: Any, gather: Callable[[Any], list], rank: int) -> None:
        """``.metadata``, by process 0, from every process's records."""
        gathered = gather((self.records, self.specs))
        if rank != 0:
            return
        records = [r for part in gathered for r in part[0]]
        specs: dict[str, TensorSpec] = {}
        for part in gathered:
            for k, v in part[1].items():
                old = specs.get(k)
                specs[k] = v if old is None else TensorSpec(v.dtype, v.shape, tuple(dict.fromkeys(old.chunks + v.chunks)))
        values = [r.key for r in records if r.offsets is None]
        with staging.open(f"{self.folder}/.metadata") as out:
            out.write(metadata_bytes(dict(sorted(specs.items())), values, records, {}))


@dataclasses.dataclass(frozen=True, slots=True)
class _Chunk:
    """A declared buffer of a rank's file: tensor ``key``'s chunk at ``offsets`` of ``sizes``, of a
    tensor of ``shape``."""

    buffer: Buffer
    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    shape: tuple[int, ...]
