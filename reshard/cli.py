"""The ``reshard`` command: a thin shell over the library. Each handler parses nothing itself and
decides nothing itself: it opens the input, calls the library and prints what it returns. Errors
reshard raises for bad input print as one line naming the fault and exit with status 2."""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import sys
from collections import Counter
from pathlib import Path

from .errors import ReshardError, in_context
from .formats import table
from .jobs.cluster import DEFAULT_TIMEOUT_S
from .present.usage import convert_description, reshard_description, synopsis
from .storage.staging import CHECKSUMS

DESCRIPTION = """\
Move distributed-training checkpoints between formats and parallel topologies exactly, through an
affine map of every parameter (docs/spec.md).

""" + synopsis()

VERIFY = ("records", "deep")  # --verify (jobs.convert.VERIFY, without importing torch here)
ELEMENT_SIZE = 4  # bytes per element in the figures of plan: fp32, what optimizer state is


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _block(text: str) -> tuple[int, int]:
    """``--block RxC``: two positive integers."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(x.strip().isdigit() and int(x) > 0 for x in parts):
        raise argparse.ArgumentTypeError(f"must be ROWSxCOLS, two positive integers (128x128), got {text!r}")
    return int(parts[0]), int(parts[1])


def _load_maps(path: str) -> dict:
    """The maps of a JSON map document (one map, named after the file, or a document of many)."""
    from .ir.param_map import ParamMap, maps_from_document

    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ReshardError(f"{path}: cannot read a JSON map document ({e})") from None
    if isinstance(doc, dict) and "params" in doc:
        return maps_from_document(doc)
    return {Path(path).stem: ParamMap.from_dict(doc)}


def _cmd_check(args) -> int:
    maps = _load_maps(args.maps)
    for name, m in maps.items():
        try:
            m.check()
        except ReshardError as e:
            raise in_context(e, f"{args.maps}: parameter {name!r}") from None
        if args.verbose:
            print(f"{name}: {m.summary()}")
    print(f"{len(maps)} map(s) valid")
    return 0


def _all_ranks(src, view: str) -> range:
    """Every rank of the topology, holding some of the shown parameters or not."""
    if view == "tp":
        return range(src.tp)
    if view == "composed":
        return range(src.tp * src.dp)
    return range(0)


def _cmd_inspect(args) -> int:
    from .present.describe import format_inspect, inspect_document, regrouped, summarize
    from .present.inspected import open_source, select

    if args.png:
        from .present.viz import require_matplotlib

        require_matplotlib()
    src = open_source(args.target)
    names = select(src, args.param)
    view = {"maps": "maps", "universal": "universal", "deepspeed": "tp", "dcp": "storage"}[src.kind]
    if args.composed:
        if src.kind != "deepspeed":
            raise ReshardError("--composed needs a DeepSpeed checkpoint (it composes the TP maps with the ZeRO split)")
        view = "composed"
        src.show_state("fp32")  # the ZeRO split is of the fp32 masters (and Adam's moments), whatever the weights' dtype
    maps = {n: src.composed_map(n) if view == "composed" else src.maps[n] for n in names}
    summaries = [summarize(n, m) for n, m in maps.items()]
    ranks = sorted({r for m in maps.values() for r in m.ranks} | set(_all_ranks(src, view)))
    if not args.png:  # a picture colours the map's own keys
        summaries, ranks = regrouped(src, summaries, ranks)
    zero = {n: src.zero_fragments(n) for n in names} if src.kind == "deepspeed" else None
    if args.json:
        json.dump(inspect_document(src, view, summaries, ranks, args.element_size, zero), sys.stdout)
        print()
    else:
        print("\n".join(format_inspect(src, view, summaries, ranks, args.element_size, zero)))
    if args.png:
        from .present.viz import draw_map

        name = names[0]
        topology = src.description + {"tp": " · TP map", "composed": " · TP∘ZeRO composed"}.get(view, "")
        rank_names = None
        if view == "composed":
            rank_names = {g: f"rank {g} (dp {g // src.tp}, tp {g % src.tp})" for g in range(src.tp * src.dp)}
        scale = next((s for s, (payload, _) in src.scales.items() if payload == name), None)
        draw_map(maps[name], args.png, name=name, topology=topology, rank_names=rank_names,
                 beside=(scale, src.maps[scale]) if scale is not None else None)  # its block scales' map
        if not args.json:
            print(f"wrote {args.png} ({name})")
    return 0


def _cmd_plan(args) -> int:
    if args.png:
        from .present.viz import require_matplotlib

        require_matplotlib()
    if args.to is not None:
        return _plan_between(args)
    return _plan_to_topology(args)


def _plan_between(args) -> int:
    """``reshard plan SOURCE --to TARGET``: two map documents, or anything ``open_source`` reads
    whose maps are on ranks of one job (a DCP folder: its storage ranks)."""
    from .plan.planner import DefaultCost, plan_model
    from .plan.values import model_plan_to_dict
    from .present.describe import stats_lines, write_plan_png
    from .present.inspected import open_source

    source = open_source(args.source)
    src, tgt = source.maps, open_source(args.to).maps
    if len(src) == 1 and len(tgt) == 1:  # one map each: the same parameter, whatever the files' names
        tgt = {next(iter(src)): next(iter(tgt.values()))}
    mp = plan_model(src, tgt, cost=DefaultCost(args.ranks_per_node), allow_inexact_scale=args.allow_inexact_scale)
    if args.png:
        write_plan_png(mp, src, tgt, args.png, args.element_size,
                       f"plan: {Path(args.source).name} → {Path(args.to).name}")
    if args.json:
        json.dump(model_plan_to_dict(mp), sys.stdout)
        print()
    else:
        if source.scales:  # a kept quantized DCP: its scale entries planned beside their payloads
            print(_planned_scales_line(source, mp, args.element_size))
        print("\n".join(stats_lines(mp, args.element_size)))
    return 0


def _planned_scales_line(src, mp, element_size: int) -> str:
    """The block scales a plan moves beside their payloads, as stored (entries of their own)."""
    moved = {n: sum(s.numel for s in mp.params[n].segments) for n in src.scales if n in mp.params}
    payloads = sum(sum(s.numel for s in mp.params[p].segments) for p, _ in src.scales.values() if p in mp.params)
    return (f"block scales: {len(moved)} tensors planned beside their payloads, as stored: "
            f"{sum(moved.values())} scale elements with {payloads} payload elements")


def _plan_to_topology(args) -> int:
    """``reshard plan SOURCE --tp T [--dp D]``: the source's layouts rebuilt at the target."""
    from .errors import PlanError
    from .plan.retarget import plan_topology
    from .present.describe import plan_document, stats_lines, write_plan_png
    from .present.inspected import hf_plan_targets, open_source

    src = open_source(args.source)
    if src.kind == "dcp":
        raise PlanError(f"{src.path}: a DCP checkpoint's chunks are boxes on storage ranks, which do not say how "
                        "a TP layout fuses parameters; plan to a map document with --to, or lay it out for N "
                        "loading ranks with 'reshard reshard --files N'")
    if src.kind == "universal":
        raise PlanError(f"{src.path}: a universal checkpoint holds F on one rank, which does not say how "
                        "parameters split over TP ranks; plan from the DeepSpeed checkpoint or a map document")
    tplan = plan_topology(src.maps, args.tp, args.dp, source_dp=src.dp if src.kind == "deepspeed" else 1,
                          vocab_divisible_by=args.vocab_divisible_by, ranks_per_node=args.ranks_per_node,
                          allow_inexact_scale=args.allow_inexact_scale, where=src.path,
                          given=hf_plan_targets(src, args.tp))
    if args.json:
        json.dump(plan_document(src, tplan, args.element_size), sys.stdout)
        print()
    else:
        print(f"source: {src.path} ({src.description})")
        print(f"target: TP={tplan.tp} DP={tplan.dp}"
              + (f" (rank = dp_rank * {tplan.tp} + tp_rank)" if tplan.dp > 1 else ""))
        counts = Counter(fam.text for fam in tplan.families.values())
        print("layouts: " + "; ".join(f"{v}× {k}" for k, v in counts.most_common()))
        if src.scales:
            print(_scales_line(src, tplan.target_maps))
        print("\n".join(stats_lines(tplan.plan, args.element_size)))
    if args.png:
        title = (f"plan: {Path(src.path).name} (TP={tplan.source_tp} DP={tplan.source_dp}) → "
                 f"TP={tplan.tp} DP={tplan.dp}")
        write_plan_png(tplan.plan, tplan.source_maps, tplan.target_maps, args.png, args.element_size, title)
        if not args.json:
            print(f"wrote {args.png}")
    return 0


def _scales_line(src, targets) -> str:
    """The block scales beside their payloads at the target: which a TP boundary cuts (a block held
    by every rank it touches, ``ir.blocks.cut_blocks``)."""
    from .ir.blocks import cut_blocks

    cut = [s for s, (payload, block) in src.scales.items() if any(cut_blocks(targets[payload], block).values())]
    return (f"block scales: {len(src.scales)} tensors, each map the payload's coarsened by its block; "
            + (f"{len(cut)} cut by a TP boundary, each such block held by every rank it touches: "
               + ", ".join(cut[:4]) + (f" and {len(cut) - 4} more" if len(cut) > 4 else "")
               if cut else "no TP boundary cuts a block"))


@contextlib.contextmanager
def _cluster(args):
    """This process's place in a ``torchrun`` launch (alone without one), ended afterwards."""
    from .jobs.cluster import Cluster

    cluster = Cluster.from_env(args.timeout)
    try:
        yield cluster
    finally:
        cluster.close()


def _report(report) -> None:
    """Every process of a launch finishes with the same report; one prints it, and its notes."""
    if int(os.environ.get("RANK", "0") or 0) == 0:
        print(report)
        for note in report.notes:
            print(f"  note: {note}")


def _start_early_copies(args) -> None:
    """One process converting to the universal layout: start copying the checkpoint's model-state
    files now, while the command's modules (torch) load (``reshard.jobs.early_copies``)."""
    if args.format != "universal" or os.environ.get("WORLD_SIZE", "1") != "1":
        return
    from .jobs.early_copies import EarlyCopies

    args.early_copies = EarlyCopies.start(args.ckpt_dir, args.out_dir, overwrite=args.overwrite,
                                          checksum=args.checksum, verify_source=args.verify_source)


def _dtype(args):
    if getattr(args, "dtype", None) is None:
        return None
    import torch

    return getattr(torch, table.DTYPES[args.dtype])


def _cmd_convert(args) -> int:
    from .jobs.convert import convert

    early = args.early_copies
    try:
        with _cluster(args) as cluster:
            report = convert(args.ckpt_dir, args.out_dir, fmt=args.format, workers=args.workers,
                             on_replica_mismatch=args.on_replica_mismatch, overwrite=args.overwrite,
                             checksum=args.checksum, max_file_bytes=int(args.max_file_gb * 2**30), cluster=cluster,
                             rename=args.rename, with_optimizer=args.with_optimizer, dtype=_dtype(args),
                             hf_config=args.hf_config, early_copies=early, names=args.names,
                             verify_source=args.verify_source, verify=args.verify, tp=args.tp,
                             quantize=args.quantize, block=args.block,
                             drop=args.drop)
    except BaseException:
        if early is not None:
            early.abandon()
        raise
    _report(report)
    return 0


def _cmd_reshard(args) -> int:
    from .jobs.convert import reshard

    with _cluster(args) as cluster:
        report = reshard(args.ckpt_dir, args.out_dir, to=args.to, tp=args.tp, dp=args.dp, pp=args.pp, vpp=args.vpp,
                         zero_stage=args.zero_stage, ep=args.ep, etp=args.etp, files=args.files, layout=args.layout,
                         dtype=_dtype(args), workers=args.workers, overwrite=args.overwrite, checksum=args.checksum,
                         cluster=cluster, on_replica_mismatch=args.on_replica_mismatch, optimizer=args.optimizer,
                         verify_source=args.verify_source, verify=args.verify, drop=args.drop,
                         hf_config=args.hf_config, quantize=args.quantize, ckpt_format=args.ckpt_format,
                         megatron_args=args.megatron_args)
    _report(report)
    return 0


def _cmd_verify(args) -> int:
    """An output folder (it holds a reshard manifest): every file against the manifest. A source
    checkpoint (no manifest): the reader's checks, every record's CRC-32 and the deep check."""
    from .storage.staging import MANIFEST, manifest_folder, verify

    p = Path(args.out_dir)
    if manifest_folder(p) is not None or (p.is_dir() and any((c / MANIFEST).is_file() for c in p.iterdir())):
        doc = verify(p)
        print(f"{args.out_dir}: {len(doc['files'])} files match the manifest")
        return 0
    from .jobs.source_check import check_source

    print("\n".join(check_source(p).lines()))
    return 0


def _cmd_demo(args) -> int:
    from .present.demo import main

    main()
    return 0


def _figures(p: argparse.ArgumentParser, stored: bool = False) -> None:
    """Options shared by the commands that print figures of maps and plans (``stored``: byte counts
    default to each tensor's element size as the source stores it)."""
    p.add_argument("--json", action="store_true", help="print the figures as one JSON document (docs/spec.md §10)")
    default = "each tensor's as stored; 4, fp32, where the source records no dtype" if stored else f"{ELEMENT_SIZE}: fp32"
    p.add_argument("--element-size", type=_positive, default=None if stored else ELEMENT_SIZE, metavar="BYTES",
                   help=f"bytes per element in byte counts (default {default})")


def _output(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drop", action="append", default=[], metavar="REGEX",
                   help="leave out the source's tensors and entries whose names match REGEX (re.search), such as "
                   "weights the target has no place for, which are refused otherwise; recorded in the report and the "
                   "manifest (repeatable)")
    p.add_argument("--workers", type=_positive, default=1, help="files written in parallel (default 1)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output tag folder")
    p.add_argument("--checksum", choices=CHECKSUMS, default="crc32",
                   help="checksum of each file in the output manifest (default crc32)")
    p.add_argument("--no-verify-source", dest="verify_source", action="store_false",
                   help="do not check the source's records against their CRC-32s as they are read, nor the files "
                   "copied verbatim (the report says so; the manifest records source_verified: false)")
    p.add_argument("--verify", choices=VERIFY, default="records",
                   help="records (default): every record read is checked against its CRC-32; deep: also the module "
                   "weights against the fp32 masters they were cast from, where the source holds both")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help="under torchrun: how long a process waits for the others before the job fails "
                   f"(default {DEFAULT_TIMEOUT_S:g})")


def _format_name(text: str) -> str:
    """A format's name for one of its aliases (``ucp``: ``universal``); any other text as it is,
    for argparse's ``choices`` to refuse."""
    try:
        return table.row(text).name
    except ReshardError:
        return text


def _format_options(p: argparse.ArgumentParser, command: str) -> None:
    """The flags of the options ``command``'s target formats take (``formats.table.OPTIONS``),
    each saying which targets take it."""
    rows = table.convert_targets() if command == "convert" else table.reshard_targets()
    flag = "--format" if command == "convert" else "--to"
    for key in dict.fromkeys(k for f in rows for k in (f.convert if command == "convert" else f.reshard) or ()):
        option = table.OPTIONS[key]
        if not option.flag:
            continue
        takers = [f.name for f in rows if key in ((f.convert if command == "convert" else f.reshard) or ())]
        how = dict(option.argparse)
        if how.get("type") in ("positive", "block"):
            how["type"] = _positive if how["type"] == "positive" else _block
        how.setdefault("default", False if how.get("action") == "store_true" else None)
        p.add_argument(option.flag, **how, help=f"{flag} {'|'.join(takers)}: {option.help}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="reshard", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    # ``imports``: the modules a command's handler uses, which ``run`` loads before calling it
    c = sub.add_parser("check", help="validate a map document (JSON)")
    c.add_argument("maps", help="a JSON map document: one map, or {\"version\": 1, \"params\": {name: map}}")
    c.add_argument("-v", "--verbose", action="store_true", help="print a one-line summary of every map")
    c.set_defaults(fn=_cmd_check, imports=("reshard.ir.param_map",))

    ins = sub.add_parser("inspect", help="show how every parameter is sharded: table, --json, --png picture")
    ins.add_argument("target", help="a map document (JSON) or a checkpoint: "
                     + ", ".join(f.name for f in table.sources()))
    ins.add_argument("--param", help="show only this parameter: its name, a unique suffix or a unique part of it "
                     "(with --png the drawn one; default the first)")
    ins.add_argument("--png", metavar="FILE", help="draw the parameter's F, coloured by rank (needs matplotlib)")
    ins.add_argument("--composed", action="store_true",
                     help="DeepSpeed: show the TP maps composed with the ZeRO split, over global ranks")
    _figures(ins, stored=True)
    ins.set_defaults(fn=_cmd_inspect, imports=("reshard.present.describe", "reshard.present.inspected"))

    pl = sub.add_parser("plan", help="plan a move without moving data: to a topology (--tp) or a map document (--to)",
                        description="Plan a move without moving data. Either --tp (the source's layouts rebuilt "
                        "at TP=T, replicated over --dp ranks) or --to (a target map document).")
    pl.add_argument("source", help="a map document or (with --tp) a DeepSpeed checkpoint folder")
    mode = pl.add_mutually_exclusive_group(required=True)
    mode.add_argument("--tp", type=_positive, help="target TP degree: the source's layouts rebuilt at TP=T")
    mode.add_argument("--to", metavar="TARGET.json", help="the target map document")
    pl.add_argument("--dp", type=_positive, default=None, help="with --tp: target DP degree (default: the source's)")
    pl.add_argument("--vocab-divisible-by", type=_positive, default=None, metavar="N",
                    help="with --tp: re-pad padded vocabularies to a multiple of N*T rows")
    pl.add_argument("--png", metavar="FILE", help="draw bytes moved as a source x target rank heat map")
    pl.add_argument("--ranks-per-node", type=_positive, default=None, metavar="K",
                    help="prefer senders on the receiver's node (K consecutive ranks per node)")
    pl.add_argument("--allow-inexact-scale", action="store_true",
                    help="accept rescaling by factors that are not powers of two (they round)")
    _figures(pl)
    pl.set_defaults(fn=_cmd_plan, imports=("reshard.present.describe", "reshard.present.inspected", "reshard.plan.planner",
                                         "reshard.plan.retarget"))

    cv = sub.add_parser("convert", help="SRC -> a format without a topology: "
                        + ", ".join(f.name for f in table.convert_targets()),
                        description=convert_description(), formatter_class=argparse.RawDescriptionHelpFormatter)
    cv.add_argument("ckpt_dir", metavar="SRC", help="any checkpoint reshard reads (a folder, or a DeepSpeed tag's "
                    "parent holding 'latest')")
    cv.add_argument("out_dir", metavar="OUT", help="output parent folder: OUT/<tag> (and OUT/latest_universal for "
                    "universal); --format hf: OUT itself")
    cv.add_argument("--format", type=_format_name, choices=[f.name for f in table.convert_targets()],
                    default="universal", help="the target format (default universal; 'ucp' is universal's alias)")
    _format_options(cv, "convert")
    cv.add_argument("--names", choices=("megatron", "hf"), default=None,
                    help="a Megatron source: its own keys or Hugging Face names (default: hf for safetensors and "
                    "hf, megatron otherwise)")
    cv.add_argument("--on-replica-mismatch", default="error", metavar="{error,rank:N,mean}",
                    help="what to do when ranks hold different copies of a replicated block (default: fail)")
    _output(cv)
    cv.set_defaults(fn=_cmd_convert, imports=("reshard.jobs.convert",), early_copies=None)

    rs = sub.add_parser("reshard", help="SRC -> the same model at another topology: "
                        + ", ".join(f.name for f in table.reshard_targets()) + " (default: the source's own format)",
                        description=reshard_description(), formatter_class=argparse.RawDescriptionHelpFormatter)
    rs.add_argument("ckpt_dir", metavar="SRC", help="any checkpoint reshard reads (a folder, or a DeepSpeed tag's "
                    "parent holding 'latest')")
    rs.add_argument("out_dir", metavar="OUT", help="output parent folder: OUT/<tag> (and OUT/latest for DeepSpeed)")
    rs.add_argument("--to", type=_format_name, choices=[f.name for f in table.reshard_targets()], default=None,
                    help="the target format (default: the source's own where it is written at a topology, dcp with "
                    f"--files, else {table.DEFAULT_TARGET})")
    _format_options(rs, "reshard")
    rs.add_argument("--on-replica-mismatch", default="error", metavar="{error,rank:N,mean}",
                    help="where the target merges copies of a replicated block (another TP degree) and they differ: "
                    "fail (default), or take rank N's copy, or their mean")
    _output(rs)
    rs.set_defaults(fn=_cmd_reshard, imports=("reshard.jobs.convert",))

    vf = sub.add_parser("verify", help="check a reshard output folder against its checksum manifest, or a source "
                        "checkpoint: reader checks, every record's CRC-32, the deep check")
    vf.add_argument("out_dir", metavar="PATH", help="an output tag folder holding reshard-manifest.json, or a source "
                    "checkpoint folder (any format reshard reads)")
    vf.set_defaults(fn=_cmd_verify, imports=("reshard.storage.staging",))
    d = sub.add_parser("demo", help="a tour: derive layouts, plan, reshard and convert a committed fixture")
    d.set_defaults(fn=_cmd_demo, imports=("reshard.present.demo",))
    return p


def main(argv: list[str] | None = None, *, parser: argparse.ArgumentParser | None = None,
         args: argparse.Namespace | None = None) -> int:
    parser = parser or build_parser()
    if args is None:
        args = parser.parse_args(None if argv is None else [str(a) for a in argv])
    if args.cmd == "plan" and args.to is not None and (args.dp is not None or args.vocab_divisible_by is not None):
        parser.error("--dp and --vocab-divisible-by go with --tp, not --to")
    try:
        return args.fn(args)
    except ReshardError as e:
        print(f"reshard: error: {e}", file=sys.stderr)
        return 2


def run() -> None:
    """The ``reshard`` command's entry point. The process ends with ``os._exit`` once the job is
    done (its output committed and made durable, its process group closed): tearing down the
    interpreter would spend ~0.4 s destroying torch's objects one by one, and under a launcher
    (``WORLD_SIZE`` > 1) torch 2.13's gloo can abort ("terminate called without an active
    exception") while the interpreter shuts down, which would turn a finished, committed job into
    a failed launch.

    The command's modules (torch with them) are imported with the cyclic garbage collector off
    (from the package's import on: ``reshard/__init__.py``), and what they made is then frozen
    (``gc.freeze``): about a million objects, none of them garbage, that full collections during
    the import (~60 ms of start-up) and during the job (~0.3 s of CPU per 3 GB) would otherwise
    walk again and again. Collection then runs less often: a command allocates many small
    acyclic objects (plans, pickled records)."""
    gc.disable()
    parser = build_parser()
    args = parser.parse_args()
    if args.cmd == "convert":
        _start_early_copies(args)  # before torch loads, which the imports below do
    for module in args.imports:
        importlib.import_module(module)
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    gc.enable()
    code = main(parser=parser, args=args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
