"""Offline resharding (``reshard reshard``) on the ~200M-parameter ZeRO-1 DP=2 checkpoint, to DP=4,
against the peer route: ``ds_to_universal`` plus reading the universal files back at the target
topology. The read-back is counted once; DeepSpeed's ``load_universal`` makes every target rank
read every file, so the real peer cost is higher still.

Also against the machine: one process vs two (``torchrun --nproc_per_node 2``; peak RSS is the
largest process's) and ``reshard convert``, all against the floor of copying the same checkpoint
with ``cp -r`` and ``sync`` (and with an fsync of the copied files only), best of 2 with the
commands alternating; two processes both under ``torchrun`` and under a launcher that only sets
the environment (``benchmarks/launch_plain.py``, as a scheduler's ``srun`` does), with files cut into
stripes that both processes write (the default) and kept whole. Then the same on
a ~400M-parameter checkpoint (``make_fixtures.py
--bench-400m``, about twice the bytes), where start-up weighs half as much."""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import torch

from benchmarks.bench_convert import (
    DATA,
    _run,
    cp_sync,
    ds_to_universal_cmd,
    ensure_checkpoint,
    startup,
    verify_cost,
    verify_rows,
)
from benchmarks.common import row
from reshard.storage.safe_load import load


def _read_back(ucp: str, dp: int) -> float:
    t = time.perf_counter()
    for f in sorted(__import__("pathlib").Path(ucp).rglob("zero/*/*.pt")):
        obj = load(f, mmap=False)
        tensor = obj["param"] if isinstance(obj, dict) else obj
        if isinstance(tensor, torch.Tensor) and tensor.dim():
            for part in tensor.reshape(-1).chunk(dp):
                part.clone()
    return time.perf_counter() - t


def _one(ckpt: Path, out: Path, dp: int, workers: int) -> list[str]:
    """``reshard reshard`` in one process."""
    return [sys.executable, "-m", "reshard.cli", "reshard", str(ckpt), str(out), "--tp", "1", "--dp", str(dp),
            "--workers", str(workers)]


def _ours(ckpt: Path, dp: int, workers: int, repeat: int) -> dict[str, tuple[float, float]]:
    """Best of ``repeat`` (wall, peak RSS) for one process, two processes, ``reshard convert`` and
    the two copy floors, the commands alternating so that they share the machine's state."""
    tag = ckpt / (ckpt / "latest").read_text().strip()
    out = DATA / "out-offline"
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    cmds = {
        "one": _one(ckpt, out / "x", dp, workers),
        "two": [torchrun, "--nproc_per_node", "2", "--master_port", "29533", "-m", "reshard", "reshard", str(ckpt),
                str(out / "x"), "--tp", "1", "--dp", str(dp), "--workers", "1"],
        "plain": [sys.executable, str(Path(__file__).with_name("launch_plain.py")), "2", "29534", "--", sys.executable,
                  "-m", "reshard", "reshard", str(ckpt), str(out / "x"), "--tp", "1", "--dp", str(dp), "--workers", "1"],
        "convert": [sys.executable, "-m", "reshard.cli", "convert", str(ckpt), str(out / "x"), "--workers", str(workers)],
    }
    # the same two processes with each file kept whole (one stripe per file, as before stripes)
    cmds["whole"] = ["env", f"RESHARD_STRIPE_BYTES={1 << 40}", *cmds["plain"]]
    # what torchrun itself costs: its agent starting two workers that do nothing
    cmds["torchrun_only"] = [torchrun, "--nproc_per_node", "2", "--master_port", "29535", "--no-python", "true"]
    best: dict[str, tuple[float, float]] = {}
    for _ in range(repeat):
        for key, cmd in cmds.items():
            shutil.rmtree(out, ignore_errors=True)
            wall, rss = _run(cmd)
            old = best.get(key, (float("inf"), 0.0))
            best[key] = (min(old[0], wall), max(old[1], rss))
        shutil.rmtree(out, ignore_errors=True)
        for key, files_only in (("floor", False), ("ffloor", True)):
            took = cp_sync(tag, out / "floor", files_only=files_only)
            best[key] = (min(best.get(key, (float("inf"), 0.0))[0], took), 0.0)
    shutil.rmtree(out, ignore_errors=True)
    return best


def _rows(b: dict[str, tuple[float, float]], start: float) -> list[str]:
    one, two, conv, floor, ffloor = (b[k][0] for k in ("one", "two", "convert", "floor", "ffloor"))
    return [
        row("  cp -r + sync of the same checkpoint (the floor)", floor,
            note=f"1 process is {one / floor:.2f}x the floor (goal <= 1.5x), {(one - start) / floor:.2f}x less start-up"),
        row("  cp -r + fsync of the copied files only", ffloor,
            note=f"1 process is {one / ffloor:.2f}x it, {(one - start) / ffloor:.2f}x less start-up"),
        row("  2 processes (torchrun, 1 worker each) vs 1 process", two, one,
            note=f"(ratio = 1 process / 2; 2 processes: {two / floor:.2f}x the floor; goal: no slower than 1)"),
        row("  torchrun alone: its agent starting 2 workers that run `true`", b["torchrun_only"][0],
            note=f"(2 processes under torchrun less it: {one / (two - b['torchrun_only'][0]):.1f}x 1 process)"),
        row("  2 processes, plain launcher (env vars, as srun) vs 1 process", b["plain"][0], one,
            note="(no launcher start-up: the processes start at once)"),
        row("  same, each file written whole by one process (no stripes)", b["whole"][0], b["plain"][0],
            note="(ratio = striped / whole)"),
        row("  peak RSS, 1 process / per process of 2", b["one"][1], b["two"][1], unit="MiB", note="(goal <= 512 MiB)"),
        row("  reshard convert vs the floor", conv, note=f"{conv / floor:.2f}x cp+sync, {conv / ffloor:.2f}x cp+fsync "
            f"(goal <= 1.15x); {(conv - start) / floor:.2f}x / {(conv - start) / ffloor:.2f}x less start-up"),
        row("  peak RSS reshard convert", b["convert"][1], unit="MiB"),
    ]


def main(workers: int = 2, dp: int = 4, repeat: int = 2) -> list[str]:
    ckpt = ensure_checkpoint()
    tag = ckpt / (ckpt / "latest").read_text().strip()
    out = DATA / "out-offline"
    shutil.rmtree(out, ignore_errors=True)
    b = _ours(ckpt, dp, workers, repeat)
    pairs = 5
    cost = verify_cost(_one(ckpt, out / "x", dp, workers), out / "x", pairs)
    conv, conv_rss = _run(ds_to_universal_cmd(tag, out / "ds" / tag.name, workers))
    back = _read_back(str(out / "ds" / tag.name), dp)
    shutil.rmtree(out, ignore_errors=True)
    start = startup("reshard", "--tp", "1")
    ours, ours_rss = b["one"]
    big = ensure_checkpoint("llama_400m_zero1_dp2", "--bench-400m")
    gib = sum(p.stat().st_size for p in (big / (big / "latest").read_text().strip()).iterdir() if p.is_file()) / 2**30
    return [
        f"best of {repeat}, the commands alternating; start-up (python + the command's modules, torch) {start:.2f} s",
        row(f"reshard reshard DP=2 -> DP={dp} vs ds_to_universal + read-back", ours, conv + back,
            note=f"(peer: convert {conv:.1f} s + read back {back:.1f} s)"),
        row("  peak RSS reshard vs ds_to_universal", ours_rss, conv_rss, unit="MiB", note="(ratio = peer/ours)"),
        *_rows(b, start),
        *verify_rows("reshard, 1 process", cost, pairs),
        f"~400M checkpoint ({gib:.2f} GiB), DP=2 -> DP={dp}:",
        *_rows(_ours(big, dp, workers, repeat), start),
    ]


if __name__ == "__main__":
    print("\n".join(main()))
