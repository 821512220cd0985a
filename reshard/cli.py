"""The ``reshard`` command: a thin shell over the library. Errors reshard raises for bad input
print as one line naming the fault and exit with status 2."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .errors import ReshardError


def _load_maps(path: str) -> dict:
    from .ir.param_map import ParamMap
    from .ir.serial import maps_from_document

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
    from .planner import DefaultCost, plan_model

    src, tgt = _load_maps(args.source), _load_maps(args.target)
    if len(src) == 1 and len(tgt) == 1:
        tgt = {next(iter(src)): next(iter(tgt.values()))}
    mp = plan_model(src, tgt, cost=DefaultCost(args.ranks_per_node), allow_inexact_scale=args.allow_inexact_scale)
    if args.json:
        json.dump(mp.to_dict(), sys.stdout)
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
    pl = sub.add_parser("plan", help="plan the move between two map documents")
    pl.add_argument("source")
    pl.add_argument("target")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.add_argument("--ranks-per-node", type=int, default=None)
    pl.add_argument("--element-size", type=int, default=2)
    pl.add_argument("--allow-inexact-scale", action="store_true")
    pl.set_defaults(fn=_cmd_plan)
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
