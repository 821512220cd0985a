"""``python -m tests.fuzz [--seed S] [--budget N] [--work DIR] [--cases I,J] [--families F,G] [--sources A,B]``: the large fuzz run (``make fuzz``),
printing the classification table; exits 1 if any run failed (silent wrong output, traceback,
hang, partial folder left, pickle ran, a refusal naming no file)."""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

from tests.fuzz.harness import FAILURES, generate, run_cases, sources, table
from tests.fuzz.mutations import FAMILIES


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m tests.fuzz")
    p.add_argument("--seed", type=int, default=20261201)
    p.add_argument("--budget", type=int, default=520, help="damaged checkpoints (default 520)")
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    p.add_argument("--memory-gb", type=float, default=8.0,
                   help="address-space limit of the run (default 8): an input that makes reshard allocate without "
                   "bound fails as a MemoryError traceback instead of taking the machine's memory")
    p.add_argument("--trace", action="store_true", help="print each case as it starts")
    p.add_argument("--cases", default=None, metavar="I,J,...",
                   help="run only these cases of the seed's list (a failure's case numbers, to re-check a fix)")
    p.add_argument("--families", default=None, metavar="F,G,...",
                   help=f"only these mutation families (of {', '.join(FAMILIES)}); the sources they apply to")
    p.add_argument("--sources", default=None, metavar="A,B,...",
                   help="only these fixtures (by name, e.g. fp8_qwen2,mxfp4_gpt_oss)")
    args = p.parse_args()
    families = tuple(args.families.split(",")) if args.families else FAMILIES
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        p.error(f"unknown families {unknown}")
    if args.memory_gb > 0:
        limit, hard = int(args.memory_gb * 2**30), resource.getrlimit(resource.RLIMIT_AS)[1]
        resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    with tempfile.TemporaryDirectory(prefix="reshard-fuzz-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        srcs = sources(work)
        if args.sources:
            wanted_src = set(args.sources.split(","))
            if wanted_src - {s.name for s in srcs}:
                p.error(f"unknown sources {sorted(wanted_src - {s.name for s in srcs})}")
            srcs = [s for s in srcs if s.name in wanted_src]
        cases = generate(args.seed, args.budget, srcs, families)
        if args.cases:
            wanted = {int(i) for i in args.cases.split(",")}
            cases = [c for c in cases if c.index in wanted]
        done = [0]

        def progress(o) -> None:
            done[0] += 1
            if o.cls in FAILURES:
                print(f"  [{o.cls}] case {o.case.index} {o.case.source.name}: {o.detail[:300]}", flush=True)
            elif done[0] % 200 == 0:
                print(f"  {done[0]} runs, {time.perf_counter() - t:.0f} s", flush=True)

        def starting(c) -> None:
            print(f"  case {c.index} {c.source.name} {c.mutation.family} {c.mutation.file}", flush=True)

        outcomes = run_cases(cases, work, progress, starting if args.trace else None)
        print(f"seed {args.seed}, budget {args.budget}, {time.perf_counter() - t:.0f} s")
        print(table(outcomes))
    return 1 if any(o.cls in FAILURES for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
