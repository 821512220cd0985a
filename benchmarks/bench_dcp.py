"""DCP -> safetensors on a ~200M-parameter Llama DCP checkpoint written by FSDP2 at world size 2
(fp32 weights and Adam state; generated on first use into bench-data/, not committed): reshard vs
torch's own route, ``dcp_to_torch_save`` then ``safetensors.torch.save_file``, in the same run;
wall time and peak RSS, each command in a fresh process, the page cache flushed before each."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from benchmarks.bench_convert import DATA, ROOT, _drop_out, _run
from benchmarks.common import row

NAME, FLAG = "llama_200m_dcp_ws2", "--bench-dcp-200m"

_PEER = """
import sys, torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
src, tmp, out = sys.argv[1:]
dcp_to_torch_save(src, tmp)
sd = torch.load(tmp, weights_only=True)
save_file({k: v.contiguous() for k, v in sd["model"].items()}, out)
"""


def ensure_checkpoint() -> Path:
    ckpt = DATA / NAME
    if not (ckpt / ".metadata").is_file():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_fixtures.py"), FLAG, str(DATA)],
                       check=True, cwd=ROOT)
    return ckpt


def main(workers: int = 2, repeat: int = 2) -> list[str]:
    ckpt = ensure_checkpoint()
    out = DATA / "out-dcp"
    _drop_out(out)
    out.mkdir(parents=True)
    ours_cmd = [sys.executable, "-m", "reshard.cli", "convert", str(ckpt), str(out / "reshard"),
                "--format", "safetensors", "--workers", str(workers)]
    peer_cmd = [sys.executable, "-c", _PEER, str(ckpt), str(out / "peer.pt"), str(out / "peer.safetensors")]
    in_bytes = sum(p.stat().st_size for p in ckpt.iterdir() if p.is_file())
    ours = peer = float("inf")
    ours_rss = peer_rss = 0.0
    for _ in range(repeat):  # best of `repeat`, the tools alternating
        _drop_out(out / "reshard")
        wall, rss = _run(ours_cmd)
        ours, ours_rss = min(ours, wall), max(ours_rss, rss)
        for p in (out / "peer.pt", out / "peer.safetensors"):
            p.unlink(missing_ok=True)
        wall, rss = _run(peer_cmd)
        peer, peer_rss = min(peer, wall), max(peer_rss, rss)
    out_bytes = sum(p.stat().st_size for p in (out / "reshard").rglob("*.safetensors"))
    _drop_out(out)
    return [
        f"DCP checkpoint: {in_bytes / 2**30:.2f} GiB in (weights + Adam state), {out_bytes / 2**30:.2f} GiB of "
        f"safetensors out, workers={workers}, best of {repeat}",
        row("DCP -> safetensors: reshard vs dcp_to_torch_save + save_file (wall)", ours, peer, note="(goal >= 2x)"),
        row("  peak RSS reshard vs torch's route", ours_rss, peer_rss, unit="MiB",
            note="(ratio = peer/ours; goal: reshard <= 512 MiB)"),
    ]


if __name__ == "__main__":
    print("\n".join(main()))
