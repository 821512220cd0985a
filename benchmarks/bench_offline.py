"""Offline resharding (``reshard reshard``) on the ~200M-parameter ZeRO-1 DP=2 checkpoint, to DP=4,
against the peer route: ``ds_to_universal`` plus reading the universal files back at the target
topology. The read-back is counted once; DeepSpeed's ``load_universal`` makes every target rank
read every file, so the real peer cost is higher still.

Also against the machine: one process vs two (``torchrun --nproc_per_node 2``; peak RSS is the
largest process's), both against the floor of copying the same checkpoint with ``cp -r`` and
``sync``. Then the same (ours only) plus ``reshard convert``'s peak RSS on a ~400M-parameter
checkpoint (``make_fixtures.py --bench-400m``, about twice the bytes), to see how they scale."""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import torch

from benchmarks.bench_convert import DATA, _run, cp_sync, ds_to_universal_cmd, ensure_checkpoint
from benchmarks.common import row
from reshard.formats.safe_load import load


def _read_back(ucp: str, dp: int) -> float:
    t = time.perf_counter()
    for f in sorted(__import__("pathlib").Path(ucp).rglob("zero/*/*.pt")):
        obj = load(f, mmap=False)
        tensor = obj["param"] if isinstance(obj, dict) else obj
        if isinstance(tensor, torch.Tensor) and tensor.dim():
            for part in tensor.reshape(-1).chunk(dp):
                part.clone()
    return time.perf_counter() - t


def main(workers: int = 2, dp: int = 4) -> list[str]:
    ckpt = ensure_checkpoint()
    tag = ckpt / (ckpt / "latest").read_text().strip()
    out = DATA / "out-offline"
    shutil.rmtree(out, ignore_errors=True)
    ours, ours_rss = _run([sys.executable, "-m", "reshard.cli", "reshard", str(ckpt), str(out / "reshard"),
                           "--tp", "1", "--dp", str(dp), "--workers", str(workers)])
    conv, conv_rss = _run(ds_to_universal_cmd(tag, out / "ds" / tag.name, workers))
    back = _read_back(str(out / "ds" / tag.name), dp)
    shutil.rmtree(out, ignore_errors=True)
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    two, two_rss = _run([torchrun, "--nproc_per_node", "2", "--master_port", "29533", "-m", "reshard", "reshard",
                         str(ckpt), str(out / "two"), "--tp", "1", "--dp", str(dp), "--workers", "1"])
    shutil.rmtree(out, ignore_errors=True)
    floor = cp_sync(tag, out / "floor")
    return [
        row(f"reshard reshard DP=2 -> DP={dp} vs ds_to_universal + read-back", ours, conv + back,
            note=f"(peer: convert {conv:.1f} s + read back {back:.1f} s)"),
        row("  peak RSS reshard vs ds_to_universal", ours_rss, conv_rss, unit="MiB", note="(ratio = peer/ours)"),
        row("  cp -r + sync of the same checkpoint (the floor)", floor,
            note=f"1 process is {ours / floor:.2f}x the floor (goal <= 1.5x)"),
        row("  2 processes (torchrun, 1 worker each) vs 1 process", two, ours,
            note=f"(2 processes: {two / floor:.2f}x the floor; goal: no slower than 1)"),
        row("  peak RSS per process, 2 processes", two_rss, note="(goal <= 512 MiB)", unit="MiB"),
        *_main_400m(workers, dp),
    ]


def _main_400m(workers: int, dp: int) -> list[str]:
    """The same measurements (ours only) on the ~400M-parameter checkpoint (about twice the bytes),
    plus ``reshard convert``'s peak RSS with bench_convert's command."""
    ckpt = ensure_checkpoint("llama_400m_zero1_dp2", "--bench-400m")
    tag = ckpt / (ckpt / "latest").read_text().strip()
    gib = sum(p.stat().st_size for p in tag.iterdir() if p.is_file()) / 2**30
    out = DATA / "out-offline"
    shutil.rmtree(out, ignore_errors=True)
    one, one_rss = _run([sys.executable, "-m", "reshard.cli", "reshard", str(ckpt), str(out / "reshard"),
                         "--tp", "1", "--dp", str(dp), "--workers", str(workers)])
    shutil.rmtree(out, ignore_errors=True)
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    two, two_rss = _run([torchrun, "--nproc_per_node", "2", "--master_port", "29533", "-m", "reshard", "reshard",
                         str(ckpt), str(out / "two"), "--tp", "1", "--dp", str(dp), "--workers", "1"])
    shutil.rmtree(out, ignore_errors=True)
    conv, conv_rss = _run([sys.executable, "-m", "reshard.cli", "convert", str(ckpt), str(out / "convert"),
                           "--workers", str(workers)])
    shutil.rmtree(out, ignore_errors=True)
    floor = cp_sync(tag, out / "floor")
    return [
        f"~400M checkpoint ({gib:.2f} GiB):",
        row(f"  reshard reshard DP=2 -> DP={dp}, 1 process", one,
            note=f"{one / floor:.2f}x the floor (cp -r + sync {floor:.1f} s)"),
        row("  peak RSS, 1 process", one_rss, unit="MiB"),
        row("  2 processes (torchrun, 1 worker each)", two, note=f"({two / floor:.2f}x the floor)"),
        row("  peak RSS per process, 2 processes", two_rss, note="(goal <= 512 MiB)", unit="MiB"),
        row(f"  reshard convert, {workers} workers", conv),
        row("  peak RSS reshard convert", conv_rss, unit="MiB"),
    ]


if __name__ == "__main__":
    print("\n".join(main()))
