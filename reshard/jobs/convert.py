"""Phase 1: a DeepSpeed checkpoint to a universal checkpoint (one full tensor per parameter).

One loop, every parameter through the IR: for each state, each TP rank's shard is rebuilt from its
ZeRO fragments (the ZeRO map), then F from the TP shards (the TP map), stripped to the valid
region and written. Files are memory-mapped, so only the bytes of the parameter at hand are read;
peak memory is about one parameter per worker. Output appears only when complete (see
``formats.output``)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from ..errors import CheckpointError, ReplicaMismatchError, ReshardError
from ..execute.memory import release
from ..formats.deepspeed import experts as deepspeed_experts
from ..formats.deepspeed.checkpoint import SCALE_POWER, STATES, DeepSpeedCheckpoint
from ..formats.safetensors.io import SafetensorsWriter, plan_files
from ..ir.apply import rebuild_mean
from ..ir.piece import prod
from ..storage.staging import Staging
from ..storage.torch_zip import save
from .cluster import Cluster, commit, open_staging, run_share
from .early_copies import EarlyCopies
from .reports import ConvertReport, Drift, written
from .workers import Progress, run_jobs

POLICIES = ("error", "mean")  # and "rank:N"


def _drift_order(d: Drift) -> tuple[str, int]:
    return d.param, STATES.index(d.state)


def _policy(value: str) -> tuple[str, int | None]:
    if value in POLICIES:
        return value, None
    if value.startswith("rank:") and value[5:].isdigit():
        return "rank", int(value[5:])
    raise ReshardError(f"on_replica_mismatch must be 'error', 'mean' or 'rank:N', got {value!r}")


class _Converter:
    def __init__(self, ck: DeepSpeedCheckpoint, policy: str) -> None:
        self.ck = ck
        self.policy, self.prefer = _policy(policy)
        self.drift: list[Drift] = []

    def full(self, name: str, state: str) -> tuple[torch.Tensor, dict]:
        """F of one state of one parameter, stripped to its valid region, and the extra keys."""
        low = self.ck.tp_map(name)
        m = low.map
        if state == "fp32" and not self.ck.has_optimizer_state(name):
            shards = {t: self.ck.module_tensor(name, t) for t in m.ranks}
            if any(v is None for v in shards.values()):
                raise CheckpointError(f"{self.ck.tag_dir}: {name}: neither optimizer state nor module weights")
            shards = {t: v.float() for t, v in shards.items()}
        else:
            shards = {t: self.ck.tp_shard(name, t, state, m.shards[t].shape) for t in m.ranks}
        power = SCALE_POWER[state]
        only = m.identity_rank
        if only is not None:  # one rank holds F as is: its shard is F, no second copy
            return shards[only].reshape(m.logical_shape), dict(low.extra)
        try:
            f = m.rebuild(shards, power, valid_only=True, prefer=self.prefer)
        except ReplicaMismatchError as e:
            self.drift.append(Drift(name, state, e.ranks, e.max_abs_diff))
            if self.policy == "error":
                raise
            if self.policy == "mean":
                f = rebuild_mean(m, shards, power)
            else:
                f = m.rebuild(shards, power, valid_only=True, prefer=self.prefer, verify=False)
            if m.is_padded:
                f = f[tuple(slice(0, n) for n in m.valid_shape)].contiguous()
        return f, dict(low.extra)


class DeepSpeedTensors:
    """A DeepSpeed checkpoint read parameter by parameter as full tensors, for the routes of
    ``convert_dcp`` (its ``Tensors`` interface)."""

    def __init__(self, path: str | Path, on_replica_mismatch: str = "error") -> None:
        ck = DeepSpeedCheckpoint.open(path)
        ck.check_steps()
        self.ck, self.conv, self._osd = ck, _Converter(ck, on_replica_mismatch), partial(_optimizer_state, ck)
        self.names = ck.names
        self.description = f"DeepSpeed TP={ck.tp} DP={ck.dp} PP={ck.pp} ZeRO-{ck.zero_stage}"
        self.tag = ck.tag_dir.name
        self.sources = ck.sources

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.ck.tp_map(name).map.valid_shape)

    def weight(self, name: str) -> torch.Tensor:
        return self.conv.full(name, "fp32")[0]

    def moment(self, name: str, state: str) -> torch.Tensor | None:
        return self.conv.full(name, state)[0] if self.ck.has_optimizer_state(name) else None

    def step(self, name: str) -> Any:
        return self.ck.step(name) if self.ck.has_optimizer_state(name) else None

    def param_groups(self) -> list[dict[str, Any]]:
        groups = [dict(g) for g in self._osd()["param_groups"]]
        members: dict[int, list[str]] = {}
        for n in self.names:
            z = self.ck.zero_map(n, 0) if self.ck.has_optimizer_state(n) else None
            members.setdefault(0 if z is None else z[0], []).append(n)
        for i, g in enumerate(groups):
            g["params"] = members.get(i, [])
        return groups

    def release(self, name: str, t: torch.Tensor) -> None:
        release(t)  # where t lies in a mapped input file, its pages are done with


def _optimizer_state(ck: DeepSpeedCheckpoint) -> dict:
    """What ``ds_to_universal`` keeps of rank 0's optimizer file: the unsharded entries and the
    parameter groups."""
    osd = ck.osd(0, 0)
    try:
        if ck.zero_stage == 3:
            out = dict(osd)
            out["param_groups"] = osd["optimizer_state_dict"]["param_groups"]
            return out
        sharded = ("base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups")
        out = {k: v for k, v in osd.items() if k not in sharded}
        out["param_groups"] = osd["base_optimizer_state"]["param_groups"]
        if ck.experts is not None:  # DeepSpeed's ZeROCheckpoint sets every group's count to DP (experts' is EDP)
            out["partition_count"] = [ck.dp] * len(out["partition_count"])
        return out
    except (KeyError, TypeError):
        raise CheckpointError(f"{ck.optim_files[(0, 0)]}: optimizer state has no 'param_groups'") from None


def convert(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    *,
    fmt: str = "ucp",
    workers: int = 1,
    on_replica_mismatch: str = "error",
    overwrite: bool = False,
    max_file_bytes: int = 5 * 2**30,
    progress: Callable[[int, int], None] | bool | None = None,
    checksum: str = "crc32",
    cluster: Cluster | None = None,
    rename: Sequence[str] = (),
    with_optimizer: bool = False,
    early_copies: EarlyCopies | None = None,
) -> ConvertReport:
    """Convert the checkpoint in ``ckpt_dir`` (a tag folder, or its parent with ``latest``) into
    ``out_dir/<tag>``: DeepSpeed's universal layout (``fmt="ucp"``, with ``out_dir/latest_universal``)
    or HF-style safetensors (``fmt="safetensors"``). Every file's ``checksum`` (``"crc32"`` or
    ``"sha256"``) goes into the output's manifest, which ``reshard verify`` re-checks. Launched by
    ``torchrun`` (or with ``cluster``), every process writes a share of the files and the commit is
    collective (``reshard.jobs.cluster``).

    A PyTorch DCP folder converts to ``"safetensors"`` (``with_optimizer`` adds the Adam moments in
    the universal layout) or ``"ucp"``; any source converts to ``fmt="dcp"`` (names changed by the
    ``rename`` ``FROM=TO`` regexes): see ``reshard.jobs.convert_dcp``.

    ``early_copies``: the model-state files of this conversion already being copied into its
    staging folder (``reshard.jobs.early_copies``, started by the command line before torch loads).
    They serve one process converting a DeepSpeed checkpoint to ``"ucp"``, from ``ckpt_dir`` to
    ``out_dir``; for any other conversion they are abandoned first. The caller abandons them if
    this raises."""
    if fmt not in ("ucp", "safetensors", "dcp"):
        raise ReshardError(f"format must be 'ucp', 'safetensors' or 'dcp', got {fmt!r}")
    from .convert_dcp import convert_any, open_tensors

    src = open_tensors(ckpt_dir)
    if early_copies is not None and (src is not None or fmt != "ucp"):  # not this route: as without them
        early_copies.abandon()
        early_copies = None
    if src is not None or fmt == "dcp":
        # drift in a DeepSpeed source is resolved as below, but not collected into the report
        return convert_any(src or DeepSpeedTensors(ckpt_dir, on_replica_mismatch), ckpt_dir, out_dir, fmt=fmt, workers=workers, overwrite=overwrite,
                           max_file_bytes=max_file_bytes, checksum=checksum, cluster=cluster, rename=rename,
                           with_optimizer=with_optimizer, on_replica_mismatch=on_replica_mismatch)
    if rename or with_optimizer:
        raise ReshardError("rename goes with fmt='dcp', with_optimizer with a DCP source")
    _policy(on_replica_mismatch)
    ck = DeepSpeedCheckpoint.open(ckpt_dir)
    ck.check_steps()
    conv = _Converter(ck, on_replica_mismatch)
    cluster = cluster or Cluster.from_env()
    if early_copies is not None and (cluster.world > 1 or early_copies.tag_dir != ck.tag_dir
                                     or early_copies.staging.out_dir != Path(out_dir)):
        early_copies.abandon()  # of another source, output or process count
        early_copies = None
    staging = early_copies.staging if early_copies is not None else open_staging(
        cluster, out_dir, ck.tag_dir.name, sources=ck.sources, overwrite=overwrite, checksum=checksum)
    names = ck.names
    bar = Progress(progress, len(names), "param", "reshard convert")
    try:  # the jobs read every parameter's map: a bad one must not leave the staging folder behind
        jobs = _ucp_jobs(ck, conv, staging, names, bar, early_copies) if fmt == "ucp" else _safetensors_jobs(
            ck, conv, staging, names, max_file_bytes, bar, cluster.rank == 0)
    except BaseException:
        if cluster.rank == 0:  # every process builds the same jobs, so every one fails alike
            staging.abandon()
        raise

    def run(mine: list[Callable[[], None]]) -> None:
        try:
            run_jobs(mine, workers, keep_going=(ReplicaMismatchError,))
        except ReplicaMismatchError:
            if not conv.drift:
                raise  # drift is reported below, from every process at once
        finally:
            bar.close()

    run_share(cluster, staging, jobs, run)
    # workers and processes finish in any order; the manifest must not
    drift = sorted((d for part in cluster.gather(conv.drift) for d in part), key=_drift_order)
    if drift and conv.policy == "error":
        if cluster.rank == 0:
            staging.abandon()
        listing = "; ".join(str(d) for d in drift)
        raise ReplicaMismatchError(
            f"{ck.tag_dir}: replicated blocks differ between ranks in {len(drift)} parameter state(s): "
            f"{listing}. Convert anyway with on_replica_mismatch='rank:N' or 'mean' (recorded in the output).",
            ranks=drift[0].ranks, max_abs_diff=max(d.max_abs_diff for d in drift))
    meta = {
        "reshard_version": __version__,
        "format": fmt,
        "source": str(ck.tag_dir),
        "source_topology": {"tp": ck.tp, "dp": ck.dp, "pp": ck.pp, "zero_stage": ck.zero_stage},
        "on_replica_mismatch": on_replica_mismatch,
        "replica_drift": [str(d) for d in drift],
    }
    final = commit(cluster, staging, meta, "latest_universal" if fmt == "ucp" else None)
    return ConvertReport(final, len(names), *written(final, manifest=False), on_replica_mismatch, drift)


def _ucp_jobs(ck, conv: _Converter, staging: Staging, names: list[str], bar,
              early: EarlyCopies | None = None) -> list[tuple[int, Callable[[], None]]]:
    """Every file of the universal checkpoint as ``(bytes, job)``, largest first."""
    # DeepSpeed's converter writes a ZeRO-3 checkpoint without TP as bare flat tensors, and no
    # step file at any TP degree (under AutoTP: {'param': full tensor}, as for ZeRO-1/2); its
    # universal loader expects exactly that, so mirror it.
    bare = ck.zero_stage == 3 and ck.tp == 1
    stepless = ck.zero_stage == 3

    def one(name: str) -> None:
        # a module weight without optimizer state (AutoEP's router aliases) has fp32 only, as in ds_to_universal
        states = STATES if ck.experts is None or ck.has_optimizer_state(name) else ("fp32",)
        for state in states:
            f, extra = conv.full(name, state)
            with staging.open(f"zero/{name}/{state}.pt") as out:
                # AutoEP experts: {'param': F, 'cat_dim': 0, ...} at any stage, as ds_to_universal writes them
                save(f.reshape(-1) if bare and ck.expert(name) is None else {**extra, "param": f}, out)
            release(f)  # where f lies in a mapped input file, its pages are done with
        if ck.has_optimizer_state(name) and not stepless:
            step = ck.step(name)
            if step is not None:
                with staging.open(f"zero/{name}/step.pt") as out:
                    save(step.clone() if isinstance(step, torch.Tensor) else step, out)
        bar.update(1)

    # The verbatim copies of the model-state files are the largest jobs: run them alongside
    # the parameters, not after, and everything largest first so no worker idles at the end.
    copies = [ck.model_files[m] for m in range(ck.mp)]
    copies += [src for (t, d), src in sorted(ck.z3_model_files.items()) if t or d]
    kept = frozenset()
    if early is not None:  # started from the files' names alone: keep those copied as they are
        if ck.experts is None:
            kept = early.files & set(copies)
        for src in early.files - kept:
            early.drop(src)
    # a copy under way since start-up goes last: by then it is done, and no worker waits for it
    jobs = [(0, partial(early.take, src)) if src in kept else (src.stat().st_size, partial(staging.copy, src, src.name))
            for src in copies]
    if ck.experts is not None:  # ds_to_universal rewrites these under AutoEP
        jobs = [(size, partial(_autoep_model_state, ck, staging, m, src)) for m, ((size, _), src)
                in enumerate(zip(jobs, copies))]
    jobs += [(ck.tp_map(n).map.numel * 12, partial(one, n)) for n in names]

    def optimizer_state() -> None:
        with staging.open("zero/optimizer_state.pt") as out:
            save(_optimizer_state(ck), out)

    jobs.append((1, optimizer_state))
    jobs.sort(key=lambda job: -job[0])
    return jobs


def _autoep_model_state(ck, staging: Staging, m: int, src: Path) -> None:
    name = src.name
    state = (deepspeed_experts.universal_model_state_z3(src) if ck.zero_stage == 3  # one file per DP rank
             else deepspeed_experts.universal_model_state(ck, m))
    with staging.writing(name):  # saved by path: torch names the zip's root folder after the file, as DeepSpeed's
        save(state, staging.path(name))


def _safetensors_jobs(ck, conv: _Converter, staging: Staging, names: list[str], max_bytes: int, bar,
                      write_index: bool) -> list[tuple[int, Callable[[], None]]]:
    """One job per safetensors file; the index (known from the shapes) is written by one process."""
    specs = []
    for n in names:
        m = ck.tp_map(n).map
        specs.append((n, m.valid_shape, torch.float32))
    groups = plan_files(specs, max_bytes)
    fnames = ["model.safetensors"] if len(groups) == 1 else [
        f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]

    def one(fname: str, group: list) -> None:
        with staging.writing(fname):
            w = SafetensorsWriter(staging.path(fname), group)
            try:
                for name, _, dtype in group:
                    f, _ = conv.full(name, "fp32")
                    w.write(name, f.to(dtype))
                    bar.update(1)
            finally:
                w.f.close()
            w.close()

    jobs = [(sum(prod(shape) * 4 for _, shape, _ in group), partial(one, fname, group))
            for fname, group in zip(fnames, groups)]
    if write_index:
        weight_map = {name: fname for fname, group in zip(fnames, groups) for name, _, _ in group}
        total = sum(prod(shape) * 4 for _, shape, _ in specs)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        staging.path("model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return jobs
