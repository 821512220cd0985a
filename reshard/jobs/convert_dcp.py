"""Jobs at the PyTorch DCP end, run like ``convert`` (atomic, checksummed output; shares of the
files over the processes of a ``torchrun`` launch):

* a DCP checkpoint to HF-style safetensors (weights; ``with_optimizer`` adds the Adam moments in the
  universal layout) or to DeepSpeed's universal layout;
* a DeepSpeed checkpoint (any kind ``convert`` reads) or a universal checkpoint to DCP, loadable by
  ``dcp.load`` into ``get_state_dict(model, optim)`` at any world size;
and the job frame those routes and ``reshard_dcp`` (a DCP checkpoint laid out for N loading
ranks) share.

Every route reads parameters through one small interface (:class:`Tensors`): full tensors of a
parameter's weight and optimizer states, its step, and the parameter groups.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch

from .. import __version__
from ..errors import CheckpointError, ReshardError
from ..execute.local import WindowFill
from ..execute.memory import release
from ..formats.dcp.reader import DcpCheckpoint, is_dcp
from ..formats.dcp.writer import DcpFile, Record, TensorSpec, metadata_bytes
from ..formats.safetensors.io import SafetensorsWriter, plan_files
from ..ir.piece import prod
from ..layouts import replicated
from ..plan.planner import plan
from ..storage import torch_zip
from ..storage.pickling import Pickler, save
from ..storage.safe_load import load
from ..storage.staging import Staging
from .cluster import Cluster, commit, open_staging, run_share
from .reports import ConvertReport, written
from .workers import run_jobs

MOMENTS = ("exp_avg", "exp_avg_sq")


class Tensors(Protocol):
    """What a route reads of a source checkpoint, one parameter at a time."""

    names: list[str]
    description: str
    tag: str
    sources: tuple[Path, ...]  # the folders it reads, which no output may touch

    def shape(self, name: str) -> tuple[int, ...]: ...
    def weight(self, name: str) -> torch.Tensor: ...
    def moment(self, name: str, state: str) -> torch.Tensor | None: ...
    def step(self, name: str) -> Any: ...
    def param_groups(self) -> list[dict[str, Any]]: ...  # "params": parameter names
    def release(self, name: str, t: torch.Tensor) -> None: ...  # done with t, one of name's tensors


# -- sources -----------------------------------------------------------------------------------


class DcpTensors:
    def __init__(self, ck: DcpCheckpoint) -> None:
        self.ck = ck
        self.names = ck.params
        self.description = f"DCP checkpoint ({len({c.rank for e in ck.tensors.values() for c in e.chunks})} "\
            "storage ranks)"
        self.tag = ck.path.name
        self.sources = (ck.path,)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.ck.entry(self.ck.param_key(name)).shape

    def weight(self, name: str) -> torch.Tensor:
        return self.ck.full(self.ck.param_key(name))

    def moment(self, name: str, state: str) -> torch.Tensor | None:
        key = self.ck.state_key(name, state)
        return None if key is None else self.ck.full(key)

    def step(self, name: str) -> Any:
        key = self.ck.state_key(name, "step")
        if key is None:
            return None
        return self.ck.full(key).clone() if key in self.ck.tensors else self.ck.object(key)

    def param_groups(self) -> list[dict[str, Any]]:
        return self.ck.param_groups

    def release(self, name: str, t: torch.Tensor) -> None:
        for key in (self.ck.param_key(name), *(self.ck.state_key(name, s) for s in MOMENTS)):
            if key in self.ck.tensors:
                self.ck.release(key)


class UniversalTensors:
    """A universal checkpoint folder (``zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt``)."""

    def __init__(self, tag_dir: Path) -> None:
        self.root = tag_dir / "zero"
        self.names = sorted(d.name for d in self.root.iterdir() if (d / "fp32.pt").is_file())
        if not self.names:
            raise CheckpointError(f"{tag_dir}: no zero/<param>/fp32.pt files: not a universal checkpoint")
        self.description = "universal checkpoint"
        self.tag = tag_dir.name
        self.sources = (tag_dir,)

    def _tensor(self, name: str, state: str) -> torch.Tensor | None:
        f = self.root / name / f"{state}.pt"
        if not f.is_file():
            return None
        obj = load(f)
        t = obj.get("param") if isinstance(obj, dict) else obj
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"{f}: expected a tensor or a dict with 'param', got {type(obj).__name__}")
        return t

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.weight(name).shape)  # memory-mapped: the shape costs no read of the data

    def weight(self, name: str) -> torch.Tensor:
        t = self._tensor(name, "fp32")
        assert t is not None  # names holds only parameters with fp32.pt
        return t

    def moment(self, name: str, state: str) -> torch.Tensor | None:
        return self._tensor(name, state)

    def step(self, name: str) -> Any:
        f = self.root / name / "step.pt"
        return load(f) if f.is_file() else None

    def param_groups(self) -> list[dict[str, Any]]:
        f = self.root / "optimizer_state.pt"
        groups = load(f).get("param_groups", []) if f.is_file() else []
        if len(groups) > 1:
            raise CheckpointError(f"{f}: {len(groups)} parameter groups, and a universal checkpoint does not record "
                                  "which parameter belongs to which")
        return [{**groups[0], "params": list(self.names)}] if groups else []

    def release(self, name: str, t: torch.Tensor) -> None:
        release(t)


def open_tensors(path: str | Path) -> Tensors | None:
    """A DCP folder or a universal checkpoint (tag folder or parent with ``latest_universal``) as
    :class:`Tensors`; ``None`` for anything else (``convert`` reads DeepSpeed checkpoints)."""
    from ..formats.detect import _universal_dir

    p = Path(path)
    if not p.is_dir():
        return None
    if is_dcp(p):
        return DcpTensors(DcpCheckpoint.open(p))
    ucp = _universal_dir(p)
    return None if ucp is None else UniversalTensors(ucp)


# -- the job frame -----------------------------------------------------------------------------


def _renamer(rules: Sequence[str]) -> Callable[[str], str]:
    """``FROM=TO`` regex substitutions, applied in order."""
    compiled = []
    for rule in rules:
        src, sep, dst = rule.partition("=")
        if not sep or not src:
            raise ReshardError(f"--rename takes FROM=TO (a regex and its replacement), got {rule!r}")
        try:
            compiled.append((re.compile(src), dst))
        except re.error as e:
            raise ReshardError(f"--rename {rule!r}: bad regex ({e})") from None

    def rename(name: str) -> str:
        for pattern, dst in compiled:
            name = pattern.sub(dst, name)
        return name

    return rename


def run_shares(cluster: Cluster, staging: Staging, jobs: list[tuple[int, Callable[[], None]]], workers: int) -> None:
    jobs.sort(key=lambda job: -job[0])
    run_share(cluster, staging, jobs, lambda mine: run_jobs(mine, workers))


def on_rank0(cluster: Cluster, staging: Staging, fn: Callable[[], None]) -> None:
    """Something only process 0 writes (an index, DCP's ``.metadata``), agreed on by all."""
    error = None
    if cluster.rank == 0:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 -- every process must learn of it
            error = e
    try:
        cluster.agree(error)
    except BaseException:
        if cluster.rank == 0:
            staging.abandon()
        raise


def finish_report(cluster: Cluster, staging: Staging, src: Tensors, fmt: str, latest: str | None, extra: dict) -> ConvertReport:
    meta = {"reshard_version": __version__, "format": fmt, "source": src.description, **extra}
    final = commit(cluster, staging, meta, latest)
    return ConvertReport(final, len(src.names), *written(final, manifest=False), "error", [])


# -- to DCP ------------------------------------------------------------------------------------


def _as_step(step: Any) -> torch.Tensor:
    """Adam's step as ``torch.optim`` keeps it (a float32 scalar tensor)."""
    value = step.item() if isinstance(step, torch.Tensor) else step
    return torch.tensor(float(value), dtype=torch.float32)


def to_dcp(src: Tensors, cluster: Cluster, staging: Staging, *, rename: Callable[[str], str], workers: int,
           max_file_bytes: int) -> None:
    """Every parameter as ``model.<name>`` (fp32) with ``optim.state.<name>.{exp_avg,exp_avg_sq,step}``
    and ``optim.param_groups``, in files of about ``max_file_bytes``; ``.metadata`` last."""
    names = [(n, rename(n)) for n in src.names]
    dup = sorted({new for _, new in names if sum(1 for _, x in names if x == new) > 1})
    if dup:
        raise ReshardError(f"--rename maps several parameters to {dup[0]!r}")
    groups = plan_files([(n, (prod(src.shape(n)) * 3,), torch.float32) for n, _ in names], max_file_bytes)
    new_name = dict(names)
    records: list[Record] = []
    specs: dict[str, TensorSpec] = {}
    lock = threading.Lock()

    def one(i: int, members: list[str]) -> None:
        rel = f"__{i}_0.distcp"
        local: dict[str, TensorSpec] = {}
        with staging.open(rel) as out:
            f = DcpFile(out, rel)
            for n in members:
                _write_param(f, src, n, new_name[n], local)
        with lock:
            records.extend(f.records)
            specs.update(local)

    jobs = [(sum(prod(s) for _, s, _ in g), partial(one, i, [n for n, _, _ in g])) for i, g in enumerate(groups)]
    value_file = f"__{len(groups)}_0.distcp"
    values: list[str] = []

    def param_groups() -> None:
        with staging.open(value_file) as out:
            f = DcpFile(out, value_file)
            for i, g in enumerate(src.param_groups()):
                for k, v in g.items():
                    f.value(f"optim.param_groups.{i}.{k}", [new_name[n] for n in v] if k == "params" else v)
        with lock:
            records.extend(f.records)
            values.extend(r.key for r in f.records)

    jobs.append((1, param_groups))
    run_shares(cluster, staging, jobs, workers)
    write_metadata(cluster, staging, records, specs, values)


def _write_param(f: DcpFile, src: Tensors, name: str, new: str, specs: dict[str, TensorSpec]) -> None:
    def put(key: str, t: torch.Tensor) -> None:
        t = t.detach().to(torch.float32) if t.dtype.is_floating_point else t.detach()
        shape = tuple(t.shape)
        f.tensor(key, (0,) * len(shape), t.dtype, shape, t.contiguous())
        src.release(name, t)
        specs[key] = TensorSpec(t.dtype, shape, (((0,) * len(shape), shape),))

    put(f"model.{new}", src.weight(name))
    for state in MOMENTS:
        m = src.moment(name, state)
        if m is not None:
            put(f"optim.state.{new}.{state}", m)
    step = src.step(name)
    if step is not None:
        put(f"optim.state.{new}.step", _as_step(step))


def write_metadata(cluster: Cluster, staging: Staging, records: list[Record], specs: dict[str, TensorSpec],
                    values: list[str]) -> None:
    gathered = cluster.gather((records, specs, values))

    def write() -> None:
        all_records = [r for part in gathered for r in part[0]]
        all_specs = {k: v for part in gathered for k, v in part[1].items()}
        all_values = [k for part in gathered for k in part[2]]
        keys = list(all_specs) + all_values
        planner = {k: _path_of(k) for k in sorted(keys)}  # any number of processes: the same bytes
        ordered = dict(sorted(all_specs.items()))
        with staging.open(".metadata") as out:
            out.write(metadata_bytes(ordered, sorted(all_values), all_records, planner))

    on_rank0(cluster, staging, write)


def _path_of(key: str) -> tuple:
    """The nested-dict path DCP's planners rebuild a flattened key from."""
    if key.startswith("model."):
        return ("model", key[len("model."):])
    if key.startswith("optim.state."):
        fqn, _, state = key[len("optim.state."):].rpartition(".")
        return ("optim", "state", fqn, state)
    if key.startswith("optim.param_groups."):
        index, _, name = key[len("optim.param_groups."):].partition(".")
        return ("optim", "param_groups", int(index), name)
    return (key,)


# -- from DCP ----------------------------------------------------------------------------------


def dcp_to_safetensors(src: DcpTensors, cluster: Cluster, staging: Staging, *, workers: int, max_file_bytes: int,
                       with_optimizer: bool) -> None:
    """HF-style safetensors of the weights, by parameter name, in their stored dtype; split into
    files of at most ``max_file_bytes`` with ``model.safetensors.index.json``."""
    ck = src.ck
    specs = [(n, ck.entry(ck.param_key(n)).shape, ck.entry(ck.param_key(n)).dtype) for n in src.names]
    groups = plan_files(specs, max_file_bytes)
    fnames = ["model.safetensors"] if len(groups) == 1 else [
        f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]

    def one(fname: str, group: list) -> None:
        with staging.open(fname) as out:
            w = SafetensorsWriter(out, group)
            for name, shape, dtype in group:
                whole = _whole(ck, ck.param_key(name))
                if isinstance(whole, torch.Tensor):
                    w.write(name, whole)
                else:
                    w.write_fill(name, shape, dtype, whole)
                ck.release(ck.param_key(name))
            w.close()

    def size(group: list) -> int:
        return sum(prod(s) * d.itemsize for _, s, d in group)

    jobs = [(size(g), partial(one, f, g)) for f, g in zip(fnames, groups)]
    if with_optimizer:
        jobs += _moment_jobs(src, staging, wrap=False)

    def index() -> None:
        weight_map = {name: f for f, g in zip(fnames, groups) for name, _, _ in g}
        doc = {"metadata": {"total_size": size(specs)}, "weight_map": weight_map}
        with staging.open("model.safetensors.index.json") as out:
            out.write((json.dumps(doc, indent=2, sort_keys=True) + "\n").encode())

    run_shares(cluster, staging, jobs, workers)
    on_rank0(cluster, staging, index)


def _whole(ck: DcpCheckpoint, key: str) -> torch.Tensor | WindowFill:
    """F of ``key``: its one chunk as mapped when that chunk is F, else a window-by-window fill
    planned from the chunks' map to F whole on one rank (memory: a window, not F)."""
    e = ck.entry(key)
    live = [i for i, c in enumerate(e.chunks) if c.numel]
    if len(live) == 1 and e.chunks[live[0]].sizes == e.shape or not prod(e.shape):
        return ck.full(key)
    p = plan(ck.param_map(key), replicated(e.shape, 1))
    return WindowFill([(0, s, partial(flat_shard, ck, key, s.src_rank)) for s in p.segments])


def flat_shard(ck: DcpCheckpoint, key: str, rank: int) -> torch.Tensor:
    return ck.shard(key, rank).reshape(-1)


def _moment_jobs(src: DcpTensors, staging: Staging, *, wrap: bool) -> list[tuple[int, Callable[[], None]]]:
    """``zero/<name>/{exp_avg,exp_avg_sq,step}.pt`` (and ``fp32.pt`` with ``wrap``), as DeepSpeed's
    universal checkpoint holds them: each tensor streamed from its chunks (:func:`_fp32`)."""

    def one(name: str) -> None:
        for state in (("fp32",) if wrap else ()) + MOMENTS:
            key = src.ck.param_key(name) if state == "fp32" else src.ck.state_key(name, state)
            if key is None:
                continue
            t = _fp32(src.ck, key)
            with staging.open(f"zero/{name}/{state}.pt") as out:
                if isinstance(t, torch_zip.TensorRef):
                    torch_zip.save({"param": t}, out, pickler=Pickler)
                else:
                    save({"param": t}, out)
            src.ck.release(key)
        step = src.step(name)
        if step is not None:
            with staging.open(f"zero/{name}/step.pt") as out:
                save(step, out)

    return [(prod(src.shape(n)) * 12, partial(one, n)) for n in src.names]


def _fp32(ck: DcpCheckpoint, key: str, *, lazy: bool = False) -> torch.Tensor | torch_zip.TensorRef:
    """Tensor ``key`` in float32 for a streamed writer (memory: a window, not F): as mapped when one
    float32 chunk is all of it, unless ``lazy``; else a placeholder filled window by window, from
    its chunks through a plan or converted slice by slice from its one chunk, read only when the
    writer reaches it."""
    whole = _whole(ck, key)
    if isinstance(whole, WindowFill):
        return torch_zip.tensor(torch.float32, ck.entry(key).shape, whole, label=key)
    if whole.dtype == torch.float32 and not lazy:
        return whole.contiguous()
    return torch_zip.tensor(torch.float32, ck.entry(key).shape, _Slices(ck, key), label=key)


class _Slices:
    """``fill(out, start)`` from a tensor held whole in one mapped chunk: each window converted to
    float32 and its source pages released once copied."""

    def __init__(self, ck: DcpCheckpoint, key: str) -> None:
        self.ck, self.key, self.flat = ck, key, None

    def __call__(self, out: torch.Tensor, start: int) -> None:
        if self.flat is None or start == 0:
            self.flat = self.ck.full(self.key).reshape(-1)
        part = self.flat.narrow(0, start, out.numel())
        out.copy_(part)
        release(part)
        if start + out.numel() >= self.flat.numel():
            self.flat = None  # the last window: let the mapping go


# The DeepSpeed release whose universal loader the files of ``dcp_to_ucp`` are written for (and
# resumed by in tests/test_dcp_to_deepspeed.py); stage 1/2's loader asserts a non-empty version
# of at least 0.3.17.
_UCP_DS_VERSION = "0.19.8"
_UCP_MODEL_STATES = "mp_rank_00_model_states.pt"


def _ucp_global_steps(src: Tensors) -> int:
    """DeepSpeed's ``global_steps`` of a source without skipped steps: Adam's step count (the
    largest one recorded; 0 without optimizer state)."""
    steps = []
    for n in src.names:
        s = src.step(n)
        if s is not None:
            steps.append(float(s.item() if isinstance(s, torch.Tensor) else s))
    return int(max(steps, default=0.0))


def _ucp_model_states(src: DcpTensors, groups: list[dict[str, Any]]) -> dict[str, Any]:
    """``mp_rank_00_model_states.pt`` as DeepSpeed 0.19.8's ``_save_checkpoint`` writes it for a
    ZeRO-1 job at DP=1 x TP=1 x PP=1 (keys in its order), from what a DCP checkpoint records.

    A universal resume (``checkpoint.load_universal``) reads of this file only ``dp_world_size``,
    ``global_steps``, ``skipped_steps``, ``mp_world_size`` (which must equal the number of
    ``mp_rank_*_model_states.pt`` files: 1), ``lr_scheduler`` (when the job has a scheduler) and
    ``global_samples`` (optional); it never loads ``module`` (weights come from ``zero/``), and
    the rest reaches the caller as client state or serves offline tools."""
    from collections import OrderedDict

    names = set(src.names)
    # DeepSpeed's param_shapes: one OrderedDict name -> torch.Size per parameter group, in the
    # optimizer's order; entries no group lists are buffers (or frozen/tied weights: DCP does not
    # tell them apart), which DeepSpeed keeps in module alone and names in buffer_names.
    param_shapes = [OrderedDict((n, torch.Size(src.shape(n))) for n in g.get("params", []) if n in names)
                    for g in groups]
    optimized = {n for shapes in param_shapes for n in shapes}
    module = OrderedDict()
    for n in src.names:  # each weight is read when the writer reaches it
        module[n] = _fp32(src.ck, src.ck.param_key(n), lazy=True)
    return {
        "module": module,  # the weights by name, fp32 (never loaded by a universal resume)
        "buffer_names": [n for n in src.names if n not in optimized],
        "optimizer": None,  # ZeRO keeps the optimizer state elsewhere (here: zero/)
        "param_shapes": param_shapes,
        "frozen_param_shapes": None,  # ZeRO-1 records none (ZeRO-2 would: {} without frozen ones)
        "shared_params": {},  # DCP records no tying; a tied copy is an entry of its own (buffer_names)
        "frozen_param_fragments": None,
        "lr_scheduler": None,  # DCP's {"model", "optim"} state has no scheduler
        "data_sampler": None,  # no curriculum learning
        "random_ltd": None,  # no random layer-token drop
        "skipped_steps": 0,  # every step of the source updated the weights (no fp16 overflow skips)
        # global_steps counts skipped steps too, so = Adam's step + skipped_steps. DeepSpeed also
        # writes global_samples (= steps x train batch size), which DCP does not record: it is left
        # out, and the resuming engine computes exactly that from its own batch size.
        "global_steps": _ucp_global_steps(src),
        "dp_world_size": 1,  # one full copy of every tensor (the universal layout has no DP shards)
        "mp_world_size": 1,  # one model-states file
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": {},  # no DeepSpeed job wrote this; readers take it as a dict with defaults
        "ds_version": _UCP_DS_VERSION,
    }


def dcp_to_ucp(src: DcpTensors, cluster: Cluster, staging: Staging, *, workers: int) -> None:
    """DeepSpeed's universal checkpoint, complete enough for ``engine.load_checkpoint`` with
    ``checkpoint.load_universal``: ``zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt``,
    ``zero/optimizer_state.pt`` and the tag folder's ``mp_rank_00_model_states.pt``
    (:func:`_ucp_model_states`).

    ``zero/optimizer_state.pt`` holds what ZeRO-1/2's universal loader
    (``load_hp_checkpoint_state_from_checkpoint_dir``) reads: ``param_groups`` (every key but
    ``params`` is copied into the engine's group ``i``; ``params`` numbers the source's entries),
    ``ds_version`` (required) and ``overflow``. It leaves out what the loader takes from the
    engine when absent and DCP does not know -- ``clip_grad``, ``loss_scaler``,
    ``dynamic_loss_scale`` (written, they would override the resuming job's own configuration) --
    and what ``ds_to_universal`` copies but no universal loader reads (``zero_stage``,
    ``group_paddings``, ``param_alignment_paddings``, ``partition_count``: the source's flat ZeRO
    partitioning, which a DCP source has none of). Everything is plain data, readable with
    ``torch.load(weights_only=True)``."""
    jobs = _moment_jobs(src, staging, wrap=True)
    index = {n: i for i, n in enumerate(src.names)}
    groups = src.param_groups()

    def optimizer_state() -> None:
        numbered = [{**g, "params": [index[n] for n in g.get("params", []) if n in index]} for g in groups]
        with staging.open("zero/optimizer_state.pt") as out:
            save({"overflow": False, "ds_version": _UCP_DS_VERSION, "param_groups": numbered}, out)

    def model_states() -> None:
        with staging.open(_UCP_MODEL_STATES) as out:  # streamed: one weight in memory at a time
            torch_zip.save(_ucp_model_states(src, groups), out, pickler=Pickler)

    jobs.append((1, optimizer_state))
    jobs.append((sum(prod(src.shape(n)) for n in src.names) * 4 + 1, model_states))
    run_shares(cluster, staging, jobs, workers)


# -- entry points --------------------------------------------------------------------------------


def convert_any(src: Tensors, ckpt_dir: str | Path, out_dir: str | Path, *, fmt: str, workers: int = 1,
                overwrite: bool = False, max_file_bytes: int = 5 * 2**30, checksum: str = "crc32",
                cluster: Cluster | None = None, rename: Sequence[str] = (), with_optimizer: bool = False,
                on_replica_mismatch: str = "error") -> ConvertReport:
    """The routes ``convert`` does not take itself, from ``src`` (read from ``ckpt_dir``): from DCP
    or a universal checkpoint, or to DCP."""
    if isinstance(src, DcpTensors) and fmt == "dcp":
        raise ReshardError(f"{ckpt_dir} is already a DCP checkpoint: use 'reshard reshard --files N' to lay it out "
                           "for another world size")
    if not isinstance(src, DcpTensors) and fmt != "dcp":
        raise ReshardError(f"{ckpt_dir}: a {src.description} converts to 'dcp' here (to {fmt!r} only from DCP)")
    cluster = cluster or Cluster.from_env()
    staging = open_staging(cluster, out_dir, src.tag, sources=(Path(ckpt_dir), *src.sources), overwrite=overwrite,
                           checksum=checksum)
    if fmt == "dcp":
        to_dcp(src, cluster, staging, rename=_renamer(rename), workers=workers, max_file_bytes=max_file_bytes)
        latest = None
    elif fmt == "safetensors":
        assert isinstance(src, DcpTensors)
        dcp_to_safetensors(src, cluster, staging, workers=workers, max_file_bytes=max_file_bytes,
                           with_optimizer=with_optimizer)
        latest = None
    else:
        assert isinstance(src, DcpTensors)
        dcp_to_ucp(src, cluster, staging, workers=workers)
        latest = "latest_universal"
    return finish_report(cluster, staging, src, fmt, latest,
                   {"rename": list(rename), "on_replica_mismatch": on_replica_mismatch})
