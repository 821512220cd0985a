"""Phase 1 converter on a ~200M-parameter Llama ZeRO-1 DP=2 fp32 checkpoint written by DeepSpeed
(generated on first use into bench-data/, not committed): reshard vs ``ds_to_universal`` with the
same worker count, in the same run; wall time, peak RSS, and the I/O floor (reading every input
byte once plus writing every output byte once)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import row

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "bench-data"


def ensure_checkpoint(name: str = "llama_200m_zero1_dp2", flag: str = "--bench-200m") -> Path:
    ckpt = DATA / name  # make_fixtures.py writes OUT_DIR/<fixture name>/
    if not (ckpt / "latest").is_file():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_fixtures.py"), flag, str(DATA)],
                       check=True, cwd=ROOT)
    return ckpt


# A fresh wrapper process per command, so its children's peak RSS is this command's alone
# (the largest process of the tree: ds_to_universal's worker pool included).
_WRAP = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); u = resource.getrusage("
         "resource.RUSAGE_CHILDREN); print('PEAK_KIB', u.ru_maxrss, 'CPU_S', u.ru_utime + u.ru_stime); "
         "sys.exit(r.returncode)")


def settle() -> None:
    """Flush what earlier runs left dirty in the page cache, so each timed command starts from
    the same state instead of paying for its predecessor's writeback."""
    os.sync()
    time.sleep(1.0)


def _run(cmd: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of a command."""
    wall, peak, _ = _measure(cmd)
    return wall, peak


def _measure(cmd: list[str]) -> tuple[float, float, float]:
    """Wall seconds, peak RSS (MiB) and CPU seconds (user + system, the command's process tree)."""
    settle()
    t = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", _WRAP, *cmd], capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONWARNINGS="ignore"))
    wall = time.perf_counter() - t
    if res.returncode:
        raise RuntimeError(f"{cmd} failed:\n{res.stderr[-3000:]}")
    peak, _, cpu = res.stdout.rsplit("PEAK_KIB", 1)[1].split()[:3]
    return wall, int(peak) / 1024, float(cpu)


def verify_cost(cmd: list[str], out: Path, pairs: int = 5) -> tuple[tuple[float, float], tuple[float, float]]:
    """``((wall, cpu), (wall, cpu))``, the best of ``pairs`` for ``cmd`` with verified reads (the
    default) and with ``--no-verify-source``, the two alternating. A difference of a few percent
    is within one run's disk noise here (write-back of the previous output), hence more pairs than
    the other rows and CPU seconds beside wall time: the CPU the checks add is what they cost."""
    best = {True: [float("inf")] * 2, False: [float("inf")] * 2}
    for _ in range(pairs):
        for verified in (True, False):
            _drop_out(out)
            wall, _, cpu = _measure(cmd if verified else [*cmd, "--no-verify-source"])
            best[verified] = [min(best[verified][0], wall), min(best[verified][1], cpu)]
    _drop_out(out)
    return (best[True][0], best[True][1]), (best[False][0], best[False][1])


def verify_rows(label: str, cost: tuple[tuple[float, float], tuple[float, float]], pairs: int) -> list[str]:
    (wall, cpu), (wall0, cpu0) = cost
    return [
        row(f"  {label}: --no-verify-source vs verified reads (wall)", wall0, wall,
            note=f"(verified reads cost {100 * (wall / wall0 - 1):+.1f} %, best of {pairs} pairs; goal <= 5 %)"),
        row(f"  {label}: the same, CPU seconds (user + system)", cpu0, cpu,
            note=f"(verified reads cost {100 * (cpu / cpu0 - 1):+.1f} % CPU)"),
    ]


def _drop_out(p: Path) -> None:
    shutil.rmtree(p, ignore_errors=True)


def _io_floor(inputs: list[Path], out_bytes: int, scratch: Path) -> float:
    settle()
    t = time.perf_counter()
    for p in inputs:
        with open(p, "rb") as f:
            while f.read(1 << 24):
                pass
    block = b"\0" * (1 << 24)
    with open(scratch, "wb") as f:
        left = out_bytes
        while left > 0:
            f.write(block[: min(left, len(block))])
            left -= len(block)
        f.flush()
        os.fsync(f.fileno())
    scratch.unlink()
    return time.perf_counter() - t


def cp_sync(src: Path, dst: Path, *, files_only: bool = False) -> float:
    """The copy floor: ``cp -r`` of the checkpoint folder, then ``sync`` (the same bytes read and
    written, made durable, no work on them). With ``files_only``, ``sync`` flushes only the copied
    files (an fsync each, as reshard's commit does) instead of every file system: on a shared
    machine a global ``sync`` also pays for other processes' dirty pages."""
    shutil.rmtree(dst, ignore_errors=True)
    dst.parent.mkdir(parents=True, exist_ok=True)
    settle()
    t = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    if files_only:
        subprocess.run(["sync", *sorted(str(p) for p in dst.rglob("*") if p.is_file())], check=True)
    else:
        subprocess.run(["sync"], check=True)
    took = time.perf_counter() - t
    shutil.rmtree(dst, ignore_errors=True)
    return took


def startup(*command: str) -> float:
    """What the ``reshard`` command (default ``convert``) pays to start: Python and the command's
    modules, torch with them, timed on a folder that does not exist (the command then stops with
    its error); best of 3."""
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        res = subprocess.run([sys.executable, "-m", "reshard.cli", *(command or ("convert",)), str(DATA / "missing"),
                              str(DATA / "missing-out")], capture_output=True)
        if res.returncode != 2:
            raise RuntimeError(f"start-up probe: expected the command's error, got {res.returncode}")
        best = min(best, time.perf_counter() - t)
    return best


def ds_to_universal_cmd(tag: Path, out: Path, workers: int) -> list[str]:
    """The peer: DeepSpeed's converter with ``workers`` extract and merge workers."""
    return [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag),
            "--output_folder", str(out), "--inject_missing_state",
            "--num_extract_workers", str(workers), "--num_merge_workers", str(workers)]


def main(workers: int = 2, repeat: int = 2, pairs: int = 5) -> list[str]:
    ckpt = ensure_checkpoint()
    tag = ckpt / (ckpt / "latest").read_text().strip()
    out = DATA / "out"
    _drop_out(out)
    ours_cmd = [sys.executable, "-m", "reshard.cli", "convert", str(ckpt), str(out / "reshard"),
                "--workers", str(workers)]
    ds_cmd = ds_to_universal_cmd(tag, out / "ds" / tag.name, workers)
    inputs = [p for p in tag.iterdir() if p.is_file()]
    in_bytes = sum(p.stat().st_size for p in inputs)
    ours = peer = floor = copy = fcopy = float("inf")
    ours_rss = peer_rss = 0.0
    for _ in range(repeat):  # best of `repeat`, the tools alternating
        _drop_out(out / "reshard")
        wall, rss = _run(ours_cmd)
        ours, ours_rss = min(ours, wall), max(ours_rss, rss)
        out_bytes = sum(p.stat().st_size for p in (out / "reshard").rglob("*") if p.is_file())
        _drop_out(out / "reshard")
        floor = min(floor, _io_floor(inputs, out_bytes, out / "floor.bin"))
        copy = min(copy, cp_sync(tag, out / "copy"))
        fcopy = min(fcopy, cp_sync(tag, out / "copy", files_only=True))
        _drop_out(out / "ds")
        wall, rss = _run(ds_cmd)
        peer, peer_rss = min(peer, wall), max(peer_rss, rss)
    cost = verify_cost(ours_cmd, out / "reshard", pairs)
    _drop_out(out)
    start = startup()
    return [
        f"checkpoint: {in_bytes / 2**30:.2f} GiB in, {out_bytes / 2**30:.2f} GiB out, workers={workers}, "
        f"best of {repeat}, page cache flushed before each timed command",
        row("convert: reshard vs ds_to_universal (wall)", ours, peer, note="(goal >= 3x)"),
        row("  peak RSS reshard vs ds_to_universal", ours_rss, peer_rss, unit="MiB", note="(ratio = peer/ours)"),
        *verify_rows("convert", cost, pairs),
        row("  I/O floor (read inputs once + write outputs once)", floor,
            note=f"reshard is {ours / floor:.2f}x the floor (goal within 2x)"),
        row("  copy floor: cp -r + sync of the checkpoint", copy,
            note=f"reshard is {ours / copy:.2f}x the copy (goal <= 1.15x)"),
        row("  copy floor, fsync of the copied files only", fcopy, note=f"reshard is {ours / fcopy:.2f}x it"),
        row("  start-up (python + the command's modules, torch)", start,
            note=f"reshard less start-up is {(ours - start) / copy:.2f}x / {(ours - start) / fcopy:.2f}x the copies"),
    ]


if __name__ == "__main__":
    print("\n".join(main()))
