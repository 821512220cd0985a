"""The fuzz suite's generator and runner: damaged copies of the committed fixtures, every command
run on each in-process (``reshard.cli.main``) under a timeout, every outcome classified.

Outcomes of one command on one damaged copy:

* ``refused``: a reshard error naming a file of the checkpoint (``refused, no file named`` when it
  names none: counted, to be fixed);
* ``succeeded-equal``: the output equals the undamaged checkpoint's (archives compared record by
  record, other files byte for byte, the manifest aside; ``inspect``: its printout), or, where a
  file the route only carries (a tokenizer file) was deleted, the undamaged output less that file;
* ``different, refused by --verify deep``: a different output, which the same command refuses
  with the deep check (module weights against their masters);
* ``different, files cannot show``: a different output from damage no file can reveal (a flipped
  byte in safetensors, which has no checksum; two same-sized rank files swapped where no rank is
  recorded and no deep check is possible);
* failures: ``SILENT WRONG OUTPUT``, ``traceback``, ``hang``, ``partial folder left``,
  ``pickle ran``.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import random
import shutil
import signal
import time
import traceback
import zipfile
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from reshard import cli
from reshard.storage import verified
from tests.fuzz.mutations import (
    CANNOT_SHOW,
    FAMILIES,
    UNSEEN,
    Mutation,
    _twin,
    apply,
    candidates,
    copy_folder,
    files_of,
)
from tests.support.paths import DCP, DEEPSPEED, HF, MEGATRON

FAILURES = ("SILENT WRONG OUTPUT", "traceback", "hang", "partial folder left", "pickle ran", "refused, no file named")
CLASSES = ("refused", "succeeded-equal", "different, refused by --verify deep", "different, files cannot show",
           *FAILURES)
TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Command:
    name: str
    argv: tuple[str, ...]  # {src} and {out} are filled in
    deep: bool = True  # takes --verify deep


CONVERT_UCP = Command("convert-ucp", ("convert", "{src}", "{out}", "--format", "ucp"))
CONVERT_ST = Command("convert-safetensors", ("convert", "{src}", "{out}", "--format", "safetensors"))
INSPECT = Command("inspect", ("inspect", "{src}"), deep=False)
# Megatron models with no HF mapping yet (shared experts, expert bias, mixed layers) in Megatron's names
CONVERT_ST_MEGATRON = Command("convert-safetensors", ("convert", "{src}", "{out}", "--format", "safetensors",
                                                      "--names", "megatron"))


@dataclass(frozen=True)
class Source:
    name: str
    kind: str
    path: Path  # what the commands are pointed at
    commands: tuple[Command, ...]


def _reshard(*flags: str, out: str = "{out}") -> Command:
    return Command("reshard", ("reshard", "{src}", out, *flags))


def sources(cache: Path) -> list[Source]:
    """The committed fixtures the suite damages, and the commands each is run with. The universal
    fixture is reshard's own conversion of a DeepSpeed one (made once into ``cache``)."""
    ds = [(n, DEEPSPEED / n) for n in ("llama_zero1_dp2", "llama_zero1_dp2_bf16", "llama_tp2_dp2", "llama_zero3_dp2",
                                       "moe_ep2", "mixtral_autoep_ep2", "pipe_pp2_dp2",
                                       # with the TP maps they record (recorded_map): AutoTP's, under ZeRO-3
                                       "llama_tp2", "qwen2_tp2", "llama_zero3_tp2_dp2",
                                       # AutoEP folded over AutoTP (ZeRO-1 and ZeRO-3), under PP, with a buffer
                                       "mixtral_autoep_ep2_tp2", "mixtral_autoep_ep2_tp2_zero3",
                                       "mixtral_autoep_ep2_pp2", "deepseek_v3_autoep_ep2",
                                       # classic MoE saved at TP 2 through an mpu; frozen parameters (ZeRO-1, 3)
                                       "moe_ep2_tp2", "llama_frozen_zero1_dp2", "llama_frozen_zero3_dp2")]
    out = [Source(n, "deepspeed", p, (CONVERT_UCP, CONVERT_ST, _reshard(), INSPECT)) for n, p in ds]
    out.append(Source("trainer_llama_zero2", "trainer", HF / "trainer_llama_zero2" / "checkpoint-3",
                      (CONVERT_UCP, CONVERT_ST, _reshard("--dp", "1", out="{out}/checkpoint-3"), INSPECT)))
    out.append(Source("llama_fsdp2_ws2", "dcp", DCP / "llama_fsdp2_ws2",
                      (CONVERT_UCP, CONVERT_ST, _reshard("--files", "2"), INSPECT)))
    out.append(Source("universal", "universal", _universal(cache),
                      (CONVERT_UCP, CONVERT_ST, _reshard("--tp", "1", "--dp", "2"), INSPECT)))
    out += [Source(n, "safetensors", HF / n, (CONVERT_UCP, CONVERT_ST, _reshard("--tp", "1", "--dp", "2"), INSPECT))
            for n in ("pretrained_llama_sharded", "pretrained_qwen2_tied")]
    # quantized folders (FP8 block scales, float32 and UE8M0; MXFP4), decoded on every route
    out += [Source(n, "quantized", HF / n, (CONVERT_UCP, CONVERT_ST, _reshard("--tp", "1", "--dp", "2"), INSPECT))
            for n in ("fp8_qwen2", "fp8_qwen2_ue8m0", "fp8_qwen2_sharded", "mxfp4_gpt_oss")]
    # the same kept quantized in a DCP (payload and scale entries of their own, --quantize keep): decoded, or laid
    # out again as stored (reshard --files 3)
    out += [Source(f"{n}_dcp", "quantized-dcp", _kept_dcp(cache, n),
                   (CONVERT_UCP, CONVERT_ST, _reshard("--files", "3"), INSPECT)) for n in ("fp8_qwen2", "mxfp4_gpt_oss")]
    if (Path(cli.__file__).parent / "formats" / "megatron").is_dir() and MEGATRON.is_dir():  # once its reader lands
        out += [Source(p.name, "megatron", p, (CONVERT_UCP, _megatron_st(p), INSPECT))
                for p in sorted(MEGATRON.iterdir()) if p.is_dir()]
    return out


def _megatron_st(fixture: Path) -> Command:
    recipe = fixture / "fixture.json"
    # (and multi-token-prediction layers, whose mtp.* keys have no HF names: the HF route refuses them by name)
    unmapped = recipe.is_file() and any(a in recipe.read_text() for a in ("--moe-shared-expert-intermediate-size",
                                                                           "--mtp-num-layers"))
    return CONVERT_ST_MEGATRON if unmapped else CONVERT_ST


def _universal(cache: Path) -> Path:
    folder = cache / "universal"
    if not (folder / "latest_universal").is_file():
        shutil.rmtree(folder, ignore_errors=True)
        with _quiet():
            assert cli.main(["convert", str(DEEPSPEED / "llama_zero1_dp2"), str(folder)]) == 0
    return folder


def _kept_dcp(cache: Path, name: str) -> Path:
    """HF folder ``name`` as ``reshard reshard --to dcp --files 2 --quantize keep`` writes it (made once into
    ``cache``): its payloads and scales entries of their own, in 2 files."""
    folder = cache / f"kept-{name}"
    if not (folder / name / ".metadata").is_file():
        shutil.rmtree(folder, ignore_errors=True)
        with _quiet():
            assert cli.main(["reshard", str(HF / name), str(folder), "--to", "dcp", "--files", "2",
                             "--quantize", "keep"]) == 0
    return folder / name


@contextlib.contextmanager
def _quiet():
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


# -- generating -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    index: int
    source: Source
    mutation: Mutation
    lazy: bool  # large-record path: every record checked as read, none when the file is opened


def generate(seed: int, budget: int, srcs: list[Source], families: tuple[str, ...] = FAMILIES) -> list[Case]:
    """``budget`` damaged checkpoints, round robin over the sources (those some of ``families``
    applies to), each a family applicable to it and a file, drawn from ``seed``: the same list for
    the same arguments."""
    rng = random.Random(seed)
    applicable = {s.name: {f: c for f in families if (c := candidates(s.path, f))} for s in srcs}
    srcs = [s for s in srcs if applicable[s.name]]
    cases = []
    for i in range(budget):
        s = srcs[i % len(srcs)]
        family = rng.choice(sorted(applicable[s.name]))
        file = rng.choice(applicable[s.name][family])
        other = _twin(file, files_of(s.path)) if family == "swap" else None
        cases.append(Case(i, s, Mutation(family, file, rng.randrange(2**32), other or ""), lazy=bool(i % 2)))
    return cases


# -- running ----------------------------------------------------------------------------------------


class _Hang(BaseException):
    pass


@contextlib.contextmanager
def _deadline(seconds: float):
    def fire(*_):
        raise _Hang()

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@dataclass
class Run:
    code: int | None
    stdout: str
    stderr: str
    error: str = ""  # a traceback's last lines, or "hang"


def run_command(argv: list[str], timeout_s: float = TIMEOUT_S) -> Run:
    out, err = io.StringIO(), io.StringIO()
    try:
        with _deadline(timeout_s), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            parser = cli.build_parser()
            args = parser.parse_args(argv)
            if args.cmd == "convert":  # as the command does: model-state copies started before the job
                cli._start_early_copies(args)
            code = cli.main(parser=parser, args=args)
    except _Hang:
        return Run(None, out.getvalue(), err.getvalue(), "hang")
    except BaseException:  # noqa: BLE001 -- anything but a reshard error is what the suite looks for
        return Run(None, out.getvalue(), err.getvalue(), traceback.format_exc(limit=-4))
    return Run(code, out.getvalue(), err.getvalue())


def _argv(cmd: Command, src: Path, out: Path, deep: bool = False) -> list[str]:
    argv = [a.format(src=src, out=out) for a in cmd.argv]
    return argv + ["--verify", "deep"] if deep else argv


def output_digest(out: Path, src: Path, run: Run, cmd: Command) -> dict[str, str]:
    """What an output is, for comparison: every file (archives record by record), or for
    ``inspect`` its printout with the source's path taken out."""
    if cmd is INSPECT or cmd.name == "inspect":
        return {"stdout": run.stdout.replace(str(src), "<SRC>")}
    digest = {}
    for p in sorted(out.rglob("*")):
        if not p.is_file() or p.name == "reshard-manifest.json":
            continue
        rel = p.relative_to(out).as_posix()
        if p.suffix in (".pt", ".pth", ".bin") and zipfile.is_zipfile(p):
            with zipfile.ZipFile(p) as z:
                for n in z.namelist():
                    digest[f"{rel}:{n.split('/', 1)[-1]}"] = hashlib.sha1(z.read(n)).hexdigest()
        else:
            digest[rel] = hashlib.sha1(p.read_bytes()).hexdigest()
    return digest


@dataclass
class Outcome:
    case: Case
    command: str
    cls: str
    detail: str


class Runner:
    """Runs cases in ``work``; the undamaged outputs are computed once per source and command."""

    def __init__(self, work: Path, timeout_s: float = TIMEOUT_S) -> None:
        self.work, self.timeout_s = work, timeout_s
        self._refs: dict[tuple[str, str], dict[str, str]] = {}

    def reference(self, source: Source, cmd: Command) -> dict[str, str]:
        key = (source.name, cmd.name)
        if key not in self._refs:
            root = self.work / f"ref-{source.name}"
            src = root / "src"
            if not src.exists():
                copy_folder(source.path, src)
            out = root / f"out-{cmd.name}"
            shutil.rmtree(out, ignore_errors=True)
            run = run_command(_argv(cmd, src, out), self.timeout_s)
            if run.code != 0:
                raise AssertionError(f"{source.name} {cmd.name} fails undamaged: {run.stderr}{run.error}")
            self._refs[key] = output_digest(out, src, run, cmd)
        return self._refs[key]

    def run(self, case: Case) -> list[Outcome]:
        root = self.work / f"case-{case.index}"
        shutil.rmtree(root, ignore_errors=True)
        src, scratch = root / "src", root / "scratch"
        copy_folder(case.source.path, src)
        scratch.mkdir()
        what = apply(src, case.mutation, case.source.path, scratch)
        eager = verified.EAGER_BYTES
        verified.EAGER_BYTES = 0 if case.lazy else eager
        try:
            return [self._one(case, cmd, src, root / f"out-{cmd.name}", scratch, what) for cmd in case.source.commands]
        finally:
            verified.EAGER_BYTES = eager
            shutil.rmtree(root, ignore_errors=True)

    def _one(self, case: Case, cmd: Command, src: Path, out: Path, scratch: Path, what: str) -> Outcome:
        ref = self.reference(case.source, cmd)
        run = run_command(_argv(cmd, src, out), self.timeout_s)
        detail = f"{what} | {cmd.name}: "
        cls = self._classify(case, cmd, src, out, scratch, run, ref, UNSEEN in what)
        detail += (run.error.strip().splitlines() or [""])[-1] if run.error else run.stderr.strip()[-300:]
        return Outcome(case, cmd.name, cls, detail)

    def _classify(self, case: Case, cmd: Command, src: Path, out: Path, scratch: Path, run: Run,
                  ref: dict[str, str], unseen: bool) -> str:
        if (scratch / "PICKLE-RAN").exists():
            return "pickle ran"
        if run.error == "hang":
            return "hang"
        if run.error:
            return "traceback"
        left = [p for p in out.parent.rglob(".reshard-partial-*")] if out.parent.exists() else []
        if left or (run.code != 0 and out.exists()):  # a refusal leaves no folder at all, not even an empty one
            return "partial folder left"
        if run.code != 0:
            return "refused" if str(src) in run.stderr or str(scratch) in run.stderr else "refused, no file named"
        got = output_digest(out, src, run, cmd)
        if got == ref or _carried_less(case.mutation, got, ref):
            return "succeeded-equal"
        if cmd.deep:
            deep_out = out.with_name(out.name + "-deep")
            again = run_command(_argv(cmd, src, deep_out, deep=True), self.timeout_s)
            if again.code == 2:
                return "different, refused by --verify deep"
        return "different, files cannot show" if unseen or case.mutation.family in CANNOT_SHOW + ("swap",) else \
            "SILENT WRONG OUTPUT"


def _carried_less(m: Mutation, got: dict[str, str], ref: dict[str, str]) -> bool:
    """A deleted file the route only carries (a tokenizer or config file beside the weights, not
    an archive): the output is the undamaged one's less that file, as the source now is."""
    name = Path(m.file).name
    if m.family != "delete" or name.endswith((".pt", ".pth", ".bin", ".distcp", ".safetensors")):
        return False
    return got == {k: v for k, v in ref.items() if Path(k).name != name}


def run_cases(cases: Iterable[Case], work: Path, progress: Callable[[Outcome], None] | None = None,
              starting: Callable[[Case], None] | None = None) -> list[Outcome]:
    runner = Runner(work)
    outcomes = []
    for case in cases:
        if starting:
            starting(case)
        for o in runner.run(case):
            outcomes.append(o)
            if progress:
                progress(o)
    return outcomes


def table(outcomes: list[Outcome]) -> str:
    """The classification: outcomes by class and command, then failures listed."""
    commands = sorted({o.command for o in outcomes})
    counts = Counter((o.cls, o.command) for o in outcomes)
    width = max(len(c) for c in CLASSES) + 2
    lines = ["class".ljust(width) + "".join(c.rjust(21) for c in commands) + "total".rjust(8)]
    for cls in CLASSES:
        row = [counts[(cls, c)] for c in commands]
        lines.append(cls.ljust(width) + "".join(str(n).rjust(21) for n in row) + str(sum(row)).rjust(8))
    cases = {o.case.index for o in outcomes}
    lines.append(f"{len(cases)} damaged checkpoints, {len(outcomes)} runs")
    by_family = Counter((o.case.mutation.family, o.cls) for o in outcomes)
    lines.append("")
    lines.append("by mutation family: " + "; ".join(
        f"{fam}: " + ", ".join(f"{cls} {n}" for (f, cls), n in sorted(by_family.items()) if f == fam)
        for fam in sorted({f for f, _ in by_family})))
    for cls in ("different, refused by --verify deep", "different, files cannot show"):
        found = [o for o in outcomes if o.cls == cls]
        if found:
            lines.append("")
            lines.append(f"{cls}:")
            lines += [f"  case {o.case.index} ({o.case.source.name}): {o.detail}" for o in found]
    bad = [o for o in outcomes if o.cls in FAILURES]
    if bad:
        lines.append("")
        lines.append("failures:")
        lines += [f"  [{o.cls}] case {o.case.index} ({o.case.source.name}, seed {o.case.mutation.seed}, "
                  f"{'lazy' if o.case.lazy else 'eager'}): {o.detail}" for o in bad]
    return "\n".join(lines)


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t
