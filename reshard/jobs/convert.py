"""``convert`` and ``reshard``: any checkpoint reshard reads to any target format, through the one
engine (``jobs.engine``). ``convert`` writes a format without a topology (universal, safetensors,
an HF folder, DCP); ``reshard`` writes one at a topology (DeepSpeed, Megatron, DCP for N loading
ranks), by default the source's own. Which are which, and the options each takes, is the format
table's (``formats.table``). Both are one call: open the reader, make the writer, run."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import ReshardError
from ..formats import table
from ..formats.contract import Reader
from ..formats.deepspeed.reader import DeepSpeedNative
from ..formats.registry import check_options, make_writer, open_reader, reshard_target
from ..storage import verified
from .accounted import patterns, prepare
from .cluster import Cluster
from .engine import Policy, run
from .reports import Report

__all__ = ["CONVERT_FORMATS", "VERIFY", "convert", "reshard"]

CONVERT_FORMATS = tuple(f.name for f in table.convert_targets())  # --format: formats without a topology
VERIFY = ("records", "deep")  # --verify: every record read checked (the default); and module weights vs masters


def _open(ckpt_dir: str | Path, verify: str, **how: Any) -> tuple[Reader, list[str]]:
    """The source, opened and checked (``--verify deep``: also its module weights against its
    masters, ``jobs.deep_check``), and what the report says of the checks."""
    if verify not in VERIFY:
        raise ReshardError(f"verify (--verify) must be one of {', '.join(VERIFY)}, got {verify!r}")
    reader = open_reader(ckpt_dir, **how)
    notes = []
    if verify == "deep":
        from .deep_check import deep_check

        notes.append(str(deep_check(reader)))
    return reader, notes


def convert(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    *,
    fmt: str = "universal",
    workers: int = 1,
    on_replica_mismatch: str = "error",
    overwrite: bool = False,
    max_file_bytes: int = 5 * 2**30,
    progress: Callable[[int, int], None] | bool | None = None,
    checksum: str = "crc32",
    cluster: Cluster | None = None,
    rename: Sequence[str] = (),
    with_optimizer: bool = False,
    dtype: torch.dtype | None = None,
    hf_config: str | Path | None = None,
    early_copies: Any = None,
    names: str | None = None,
    verify_source: bool = True,
    verify: str = "records",
    tp: int | None = None,
    quantize: str | None = None,
    block: tuple[int, int] | None = None,
    drop: Sequence[str] = (),
) -> Report:
    """Convert the checkpoint at ``ckpt_dir`` (any format reshard reads: ``formats.table``) into
    ``out_dir/<tag>``: DeepSpeed's universal layout (``fmt="universal"``, or its alias ``"ucp"``;
    with ``out_dir/latest_universal``),
    HF-style safetensors (``"safetensors"``; ``with_optimizer`` adds the Adam moments in the universal
    layout), a Hugging Face model folder ``from_pretrained`` loads as it stands, written into
    ``out_dir`` itself (``"hf"``: ``config.json`` and tokenizer files carried from beside the source,
    or from ``hf_config``; ``dtype`` default the config's) or a PyTorch DCP checkpoint (``"dcp"``, names changed by the ``rename`` ``FROM=TO``
    regexes). Every file's ``checksum`` (``"crc32"`` or ``"sha256"``) goes into the output's
    manifest, which ``reshard verify`` re-checks. Launched by ``torchrun`` (or with ``cluster``),
    every process writes a share of the files and the commit is collective (``jobs.cluster``).

    ``early_copies``: the model-state files of this conversion already being copied into its
    staging folder (``jobs.early_copies``, started by the command line before torch loads). They
    serve one process converting a DeepSpeed checkpoint to ``"ucp"``, from ``ckpt_dir`` to
    ``out_dir``; for any other conversion they are abandoned first. The caller abandons them if
    this raises.

    ``names``: the parameter names a Megatron source is read under (``"megatron"`` or ``"hf"``;
    default: HF names for safetensors, Megatron's keys for the other formats).

    ``verify_source`` (``--no-verify-source`` turns it off): every byte read from a ``torch.save``
    record, and every file copied verbatim, is checked against its CRC-32 (``storage.verified``);
    the manifest records whether (``source_verified``). ``verify="deep"`` (``--verify deep``) also
    compares module weights with the masters they were cast from (``jobs.deep_check``).

    ``fmt="vllm"``: vLLM's sharded state at TP=``tp`` (default 1) in ``out_dir`` itself, with
    ``config.json`` and the tokenizer files as for ``"hf"`` (``formats.vllm.writer``).

    ``quantize="keep"`` (``"hf"``, ``"safetensors"``, ``"dcp"``, ``"vllm"``): every weight a quantized
    source stores quantized (FP8 block scales, MXFP4) written as it stores it, payload and scales
    byte for byte, never decoded (DCP: entries of their own, with the source's ``quantization_config``).

    ``quantize`` (``"fp8"`` or ``"fp8-ue8m0"``; ``"hf"``, ``"safetensors"``, ``"vllm"``): 2-D linear weights
    written as FP8 E4M3 and a ``weight_scale_inv`` per ``block`` (rows, cols; default an FP8 source's
    own, else 128 x 128), transformers' ``Fp8Quantize`` bit for bit (``formats.safetensors.writer``).
    On ``"vllm"``: an FP8 source's linears kept FP8, payload and scales moved to each TP rank as vLLM
    holds them, never decoded, and linears stored otherwise quantized per rank, each shard's encoding
    the slice of the whole weight's (``formats.vllm.writer``); a TP that cuts a block is refused.

    Every entry of the source is written, reported as not carried (a state the target has no
    place for: ``_extra_state``, RNG, a scheduler) or refused (``UnplacedError``: model weights
    the target has no place for), before any output folder exists; ``drop`` (``--drop``, regexes
    searched in each entry's key) leaves out what it names, recorded in the report and the manifest
    (``jobs.accounted``)."""
    fmt = table.target(fmt, "convert").name
    check_options(fmt, _convert_options(fmt, max_file_bytes=max_file_bytes, rename=rename, with_optimizer=with_optimizer,
                                        dtype=dtype, hf_config=hf_config, early=None, tp=tp, quantize=quantize,
                                        block=block))
    Policy.parse(on_replica_mismatch)
    patterns(drop)
    with verified.verifying(verify_source):
        reader, notes = _open(ckpt_dir, verify, route=fmt, names=names)
        return _convert(reader, out_dir, fmt=fmt, workers=workers, on_replica_mismatch=on_replica_mismatch,
                        overwrite=overwrite, max_file_bytes=max_file_bytes, progress=progress, checksum=checksum,
                        cluster=cluster, rename=rename, with_optimizer=with_optimizer, dtype=dtype,
                        hf_config=hf_config, early_copies=early_copies, notes=notes, tp=tp, quantize=quantize,
                        block=block, drop=drop)


def _convert(reader: Reader, out_dir: str | Path, *, fmt: str, workers: int, on_replica_mismatch: str,
             overwrite: bool, max_file_bytes: int, progress: Any, checksum: str, cluster: Cluster | None,
             rename: Sequence[str], with_optimizer: bool, dtype: torch.dtype | None, hf_config: str | Path | None,
             early_copies: Any, notes: list[str], tp: int | None = None, quantize: str | None = None,
             block: tuple[int, int] | None = None, drop: Sequence[str] = ()) -> Report:
    cluster = cluster or Cluster.from_env()
    early = early_copies
    own = reader.native("deepspeed")
    if early is not None and (not isinstance(own, DeepSpeedNative) or fmt != "universal" or cluster.world > 1
                              or early.tag_dir != own.ck.tag_dir or early.staging.out_dir != Path(out_dir)
                              or early.staging.verify_source != verified.enabled() or patterns(drop)):
        early.abandon()  # of another route, source, output or process count (or one --drop may change): as without
        early = None
    options = _convert_options(fmt, max_file_bytes=max_file_bytes, rename=rename, with_optimizer=with_optimizer,
                               dtype=dtype, hf_config=hf_config, early=early, tp=tp, quantize=quantize, block=block)
    reader, writer = prepare(reader, drop, lambda r: make_writer(fmt, r, **options))
    return run(reader, writer, out_dir, workers=workers, overwrite=overwrite, checksum=checksum, cluster=cluster,
               progress=progress, on_replica_mismatch=on_replica_mismatch,
               staging=early.staging if early is not None else None, notes=notes, drop=drop)


def _convert_options(fmt: str, *, max_file_bytes: int, rename: Sequence[str], with_optimizer: bool,
                     dtype: torch.dtype | None, hf_config: str | Path | None, early: Any,
                     tp: int | None = None, quantize: str | None = None,
                     block: tuple[int, int] | None = None) -> dict[str, Any]:
    """The writer options of a conversion to ``fmt``: what the user chose (refused by the target
    that does not take it), and the defaults it takes (a file size, early copies)."""
    takes = table.row(fmt).options
    return {"rename": tuple(rename) or None, "with_optimizer": with_optimizer or None, "dtype": dtype,
            "hf_config": hf_config, "tp": tp, "quantize": quantize, "block": block, **{k: v for k, v in (("max_file_bytes", max_file_bytes), ("early", early))
                                       if k in takes}}


def reshard(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    *,
    to: str | None = None,
    tp: int | None = None,
    dp: int | None = None,
    pp: int | None = None,
    zero_stage: int | None = None,
    ep: int | None = None,
    etp: int | None = None,
    files: int | None = None,
    layout: Any = None,
    dtype: torch.dtype | None = None,
    workers: int = 1,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | bool | None = None,
    checksum: str = "crc32",
    cluster: Cluster | None = None,
    on_replica_mismatch: str = "error",
    optimizer: str | None = None,
    verify_source: bool = True,
    verify: str = "records",
    drop: Sequence[str] = (),
    hf_config: str | Path | None = None,
    quantize: str | None = None,
    ckpt_format: str | None = None,
    megatron_args: str | Path | None = None,
    vpp: int | None = None,
) -> Report:
    """Write the checkpoint at ``ckpt_dir`` at another topology into ``out_dir/<tag>``, in the
    format ``to`` names, by default the source's own where it is written at a topology (a
    DeepSpeed or Megatron source; DCP with ``files``), else DeepSpeed (a universal checkpoint, an
    HF folder, an Accelerate one); a target that cannot be written from the source is refused
    naming ``to``'s choices (``formats.registry.reshard_target``).

    A DeepSpeed checkpoint (``to="deepspeed"``) at TP=``tp`` x DP=``dp`` (x PP=``pp``) with ZeRO
    ``zero_stage`` and, with experts, EP=``ep`` (each default: the source's), plus
    ``out_dir/latest``, as DeepSpeed 0.19.8 would save it there; or a DCP checkpoint laid out for
    ``files`` loading ranks (``to="dcp"``, the default with ``files``). A TP degree the source
    does not record takes its layout from ``layout`` (a DeepSpeed checkpoint at that degree, a map
    document, or ``"geometry"``). Where the target merges copies of a replicated block (another TP
    degree), drifted copies stop the job unless ``on_replica_mismatch`` says which to keep. Or a
    Megatron-Core ``torch_dist`` checkpoint (``to="megatron"``) at TP x PP (x virtual stages ``vpp``, x DP, x EP,
    x expert TP ``etp``), from a
    Megatron source or an HF one (or DCP / universal in HF names, the model's ``config.json`` in
    the folder ``hf_config``; in Megatron's names, the args, optimizer groups and run state of the Megatron
    checkpoint ``megatron_args``), its optimizer state laid out as ``optimizer`` says
    (``formats.megatron.writer``); ``ckpt_format="torch"``: legacy files, weights only
    (``formats.megatron.legacy_writer``; the default is a Megatron source's format). ``verify_source``, ``verify`` and ``drop`` as for :func:`convert`;
    ``quantize="keep"`` (``to="dcp"``): a quantized source's payloads and scales as entries of their own,
    byte for byte (``formats.dcp.writer``)."""
    given = {"files": files, "tp": tp, "dp": dp, "pp": pp, "zero_stage": zero_stage, "ep": ep, "etp": etp,
             "layout": layout, "dtype": dtype, "optimizer": optimizer, "hf_config": hf_config, "quantize": quantize,
             "ckpt_format": ckpt_format, "megatron_args": megatron_args, "vpp": vpp}
    target = reshard_target(ckpt_dir, to, given)
    check_options(target.name, given)
    patterns(drop)
    if target.needs is not None and given[target.needs] is None:
        raise ReshardError(f"{ckpt_dir}: --to {target.name} takes {table.OPTIONS[target.needs].flag} N "
                           f"({table.OPTIONS[target.needs].help})")
    with verified.verifying(verify_source):
        chosen = target.names_with
        names = chosen[1] if chosen is not None and given[chosen[0]] is not None else None
        reader, notes = _open(ckpt_dir, verify, route=target.name, prefer=names)
        return _reshard(reader, out_dir, to=target.name, options=given, workers=workers, overwrite=overwrite,
                        progress=progress, checksum=checksum, cluster=cluster,
                        on_replica_mismatch=on_replica_mismatch, notes=notes, drop=drop)


def _reshard(reader: Reader, out_dir: str | Path, *, to: str, options: dict[str, Any], workers: int, overwrite: bool,
             progress: Any, checksum: str, cluster: Cluster | None, on_replica_mismatch: str,
             notes: list[str], drop: Sequence[str] = ()) -> Report:
    if to == "deepspeed":  # DeepSpeed's writer takes whole numbers: the source's TP, one stage
        options = dict(options)
        if options["tp"] is None:
            own = reader.format == "deepspeed" and options["ep"] is None
            options["tp"] = reader.topology.get("tp", 1) if own else 1
        options["pp"] = 1 if options["pp"] is None else options["pp"]
    reader, writer = prepare(reader, drop, lambda r: make_writer(to, r, **options))
    return run(reader, writer, out_dir, workers=workers, overwrite=overwrite, checksum=checksum, cluster=cluster,
               progress=progress, on_replica_mismatch=on_replica_mismatch,
               extra_sources=writer.extra_sources, notes=notes, drop=drop)
