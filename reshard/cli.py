"""The ``reshard`` command: a thin shell over the library. Errors reshard raises for bad input
print as one line naming the fault and exit with status 2."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .errors import ReshardError
from .formats.output import CHECKSUMS


def _load_maps(path: str) -> dict:
    from .ir.param_map import ParamMap, maps_from_document

    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
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
            raise type(e)(f"{args.maps}: parameter {name!r}: {e}") from None
        if args.verbose:
            print(f"{name}: {m.summary()}")
    print(f"{len(maps)} map(s) valid")
    return 0


def _cmd_plan(args) -> int:
    from .plan_format import model_plan_to_dict
    from .planner import DefaultCost, plan_model

    if args.target is None or args.tp is not None or args.dp is not None:
        from .inspect import run_plan_topology

        return run_plan_topology(args)
    if args.png:
        from .viz import require_matplotlib

        require_matplotlib()
    src, tgt = _load_maps(args.source), _load_maps(args.target)
    if len(src) == 1 and len(tgt) == 1:
        tgt = {next(iter(src)): next(iter(tgt.values()))}
    mp = plan_model(src, tgt, cost=DefaultCost(args.ranks_per_node), allow_inexact_scale=args.allow_inexact_scale)
    if args.png:
        from .inspect import write_plan_png

        write_plan_png(mp, src, tgt, args.png, args.element_size, f"plan: {Path(args.source).name} → "
                       f"{Path(args.target).name}")
    if args.json:
        json.dump(model_plan_to_dict(mp), sys.stdout)
        print()
        return 0
    st = mp.stats(element_size=args.element_size)
    print(f"{len(mp.params)} parameter(s), {st.segments} segments")
    print(f"bytes local {st.local_bytes}, remote {st.remote_bytes} (element size {args.element_size})")
    for r in sorted(set(st.sent) | set(st.received)):
        print(f"  rank {r}: sends {st.sent.get(r, 0)}, receives {st.received.get(r, 0)}")
    if st.busiest_link:
        (a, b), n = st.busiest_link
        print(f"busiest link: {a} -> {b}, {n} bytes")
    return 0


def _cmd_inspect(args) -> int:
    from .inspect import run_inspect

    return run_inspect(args)


def _cmd_convert(args) -> int:
    from .convert import convert, summary

    report = convert(args.ckpt_dir, args.out_dir, fmt=args.format, workers=args.workers,
                     on_replica_mismatch=args.on_replica_mismatch, overwrite=args.overwrite, checksum=args.checksum,
                     max_file_bytes=int(args.max_file_gb * 2**30))
    print(summary(report))
    return 0


def _cmd_reshard(args) -> int:
    from .offline import reshard, summary

    report = reshard(args.ckpt_dir, args.out_dir, tp=args.tp, dp=args.dp, pp=args.pp, zero_stage=args.zero_stage,
                     layout=args.layout, workers=args.workers, overwrite=args.overwrite,
                     checksum=args.checksum)
    print(summary(report))
    return 0


def _cmd_verify(args) -> int:
    from .formats.output import verify

    doc = verify(args.out_dir)
    print(f"{args.out_dir}: {len(doc['files'])} files match the manifest")
    return 0


def _cmd_demo(args) -> int:
    from .demo import main

    main()
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="reshard", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="validate a map document (JSON)")
    c.add_argument("maps")
    c.add_argument("-v", "--verbose", action="store_true")
    c.set_defaults(fn=_cmd_check)
    ins = sub.add_parser("inspect", help="show how every parameter is sharded: table, --json, --png picture")
    ins.add_argument("target", help="a map document (JSON), a DeepSpeed checkpoint folder or a universal checkpoint "
                     "folder")
    ins.add_argument("--param", help="show only this parameter (and draw it with --png; default: the first)")
    ins.add_argument("--png", metavar="FILE", help="draw the parameter's F, coloured by rank (needs matplotlib)")
    ins.add_argument("--json", action="store_true", help="print the figures as JSON")
    ins.add_argument("--element-size", type=int, default=4, help="bytes per element (default 4: fp32)")
    ins.add_argument("--composed", action="store_true",
                     help="DeepSpeed: show the TP maps composed with the ZeRO split, over global ranks")
    ins.set_defaults(fn=_cmd_inspect)
    pl = sub.add_parser("plan", help="plan the move between two map documents, or from a source to TP=T (--tp)")
    pl.add_argument("source", help="a map document, or (with --tp) a DeepSpeed checkpoint folder")
    pl.add_argument("target", nargs="?", help="the target map document (or give --tp)")
    pl.add_argument("--tp", type=int, default=None, help="target TP degree: the source's layouts rebuilt at TP=T")
    pl.add_argument("--dp", type=int, default=None, help="target DP degree with --tp (default: the source's)")
    pl.add_argument("--vocab-divisible-by", type=int, default=None, metavar="N",
                    help="with --tp: re-pad padded vocabularies to a multiple of N*T rows")
    pl.add_argument("--png", metavar="FILE", help="draw bytes moved as a source x target rank heat map")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON (with --tp: its figures)")
    pl.add_argument("--ranks-per-node", type=int, default=None)
    pl.add_argument("--element-size", type=int, default=2)
    pl.add_argument("--allow-inexact-scale", action="store_true")
    pl.set_defaults(fn=_cmd_plan)
    cv = sub.add_parser("convert", help="DeepSpeed checkpoint -> universal checkpoint (or safetensors)")
    cv.add_argument("ckpt_dir", help="a tag folder, or its parent holding a 'latest' file")
    cv.add_argument("out_dir", help="output parent folder: OUT_DIR/<tag> and OUT_DIR/latest_universal")
    cv.add_argument("--format", choices=["ucp", "safetensors"], default="ucp")
    cv.add_argument("--workers", type=int, default=1)
    cv.add_argument("--on-replica-mismatch", default="error", metavar="{error,rank:N,mean}",
                    help="what to do when ranks hold different copies of a replicated block (default: fail)")
    cv.add_argument("--overwrite", action="store_true", help="replace an existing OUT_DIR/<tag>")
    cv.add_argument("--max-file-gb", type=float, default=5.0, help="safetensors file size limit")
    cv.add_argument("--checksum", choices=CHECKSUMS, default="crc32", help="checksum of each file in the manifest")
    cv.set_defaults(fn=_cmd_convert)
    rs = sub.add_parser("reshard", help="DeepSpeed ZeRO-1/2 checkpoint -> the same at another TP x DP (x PP) "
                        "topology, loadable by engine.load_checkpoint")
    rs.add_argument("ckpt_dir", help="a tag folder, or its parent holding a 'latest' file")
    rs.add_argument("out_dir", help="output parent folder: OUT_DIR/<tag> and OUT_DIR/latest")
    rs.add_argument("--tp", type=int, required=True, help="target TP degree")
    rs.add_argument("--dp", type=int, default=None, help="target DP degree (default: the source's)")
    rs.add_argument("--pp", type=int, default=1,
                    help="target pipeline stages of a deepspeed.pipe checkpoint: its own count, or 1 to merge them")
    rs.add_argument("--zero-stage", type=int, default=None, help="target ZeRO stage, 1 or 2 (default: the source's)")
    rs.add_argument("--layout", default=None, metavar="CKPT|MAPS.json|geometry",
                    help="target TP layout when TP changes to a degree other than 1")
    rs.add_argument("--workers", type=int, default=1)
    rs.add_argument("--overwrite", action="store_true", help="replace an existing OUT_DIR/<tag>")
    rs.add_argument("--checksum", choices=CHECKSUMS, default="crc32", help="checksum of each file in the manifest")
    rs.set_defaults(fn=_cmd_reshard)
    vf = sub.add_parser("verify", help="check a reshard output folder against its checksum manifest")
    vf.add_argument("out_dir")
    vf.set_defaults(fn=_cmd_verify)
    d = sub.add_parser("demo", help="derive and plan the seed's layouts")
    d.set_defaults(fn=_cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except ReshardError as e:
        print(f"reshard: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
