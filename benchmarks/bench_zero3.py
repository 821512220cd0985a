"""Offline resharding of a ZeRO-3 checkpoint (``reshard reshard``) on the ~200M-parameter Llama saved by
DeepSpeed under ZeRO-3 at DP=2 (``make_fixtures.py --bench-zero3-200m``, generated on first use into
bench-data/), to DP=4, against the peer route: ``ds_to_universal`` plus reading the universal files
back as DeepSpeed's ZeRO-3 universal loader does (each parameter's state files loaded whole and cut
into the DP partitions). The read-back is counted once; DeepSpeed's ``load_universal`` makes every
target rank read every file, so the real peer cost is higher still. Each command runs in a fresh
wrapper process, so its peak RSS is its own (the largest process of its tree)."""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import torch

from benchmarks.bench_convert import DATA, _run, cp_sync, ds_to_universal_cmd, ensure_checkpoint, settle
from benchmarks.common import row
from reshard.storage.safe_load import load


def _read_back(ucp: Path, dp: int) -> float:
    """What DeepSpeed's ZeRO-3 universal loader reads: every ``zero/<param>/<state>.pt`` whole,
    flattened, zero-padded to ``dp`` equal partitions, each partition copied out."""
    settle()
    t = time.perf_counter()
    for f in sorted(ucp.rglob("zero/*/*.pt")):
        obj = load(f, mmap=False)
        flat = (obj["param"] if isinstance(obj, dict) else obj).reshape(-1)
        part = -(-flat.numel() // dp)
        padded = torch.zeros(part * dp, dtype=flat.dtype)
        padded[:flat.numel()].copy_(flat)
        for chunk in padded.chunk(dp):
            chunk.clone()
    return time.perf_counter() - t


def main(workers: int = 2, dp: int = 4, repeat: int = 2) -> list[str]:
    ckpt = ensure_checkpoint("llama_200m_zero3_dp2", "--bench-zero3-200m")
    tag = ckpt / (ckpt / "latest").read_text().strip()
    gib = sum(p.stat().st_size for p in tag.iterdir() if p.is_file()) / 2**30
    out = DATA / "out-zero3"
    shutil.rmtree(out, ignore_errors=True)
    ours_cmd = [sys.executable, "-m", "reshard.cli", "reshard", str(ckpt), str(out / "reshard"), "--tp", "1",
                "--dp", str(dp), "--workers", str(workers)]
    ours = conv = back = float("inf")
    ours_rss = conv_rss = 0.0
    for _ in range(repeat):  # best of `repeat`, the tools alternating
        shutil.rmtree(out, ignore_errors=True)
        wall, rss = _run(ours_cmd)
        ours, ours_rss = min(ours, wall), max(ours_rss, rss)
        shutil.rmtree(out, ignore_errors=True)
        wall, rss = _run(ds_to_universal_cmd(tag, out / "ds" / tag.name, workers))
        conv, conv_rss = min(conv, wall), max(conv_rss, rss)
        back = min(back, _read_back(out / "ds" / tag.name, dp))
    shutil.rmtree(out, ignore_errors=True)
    floor = cp_sync(tag, out / "floor")
    shutil.rmtree(out, ignore_errors=True)
    peer = conv + back
    return [
        f"checkpoint: ~200M Llama, ZeRO-3 DP=2 fp32, {gib:.2f} GiB; workers={workers}, best of {repeat}, page cache "
        "flushed before each timed command",
        row(f"reshard reshard ZeRO-3 DP=2 -> DP={dp} vs ds_to_universal + read-back", ours, peer,
            note=f"(goal >= 3x; peer: convert {conv:.1f} s + read back {back:.1f} s)"),
        row("  peak RSS reshard vs ds_to_universal", ours_rss, conv_rss, unit="MiB",
            note="(ratio = peer/ours; goal: reshard <= 512 MiB)"),
        row("  cp -r + sync of the same checkpoint (the floor)", floor,
            note=f"reshard is {ours / floor:.2f}x the floor"),
    ]


if __name__ == "__main__":
    print("\n".join(main()))
