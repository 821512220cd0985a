"""Run DeepSpeed 0.19.8's own ``ds_to_universal`` on a fixture (the parity oracle)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.paths import DEEPSPEED

FIXTURES = DEEPSPEED


def tag_dir(name: str) -> Path:
    root = FIXTURES / name
    return root / (root / "latest").read_text().strip()


def ds_to_universal(name: str, out_root: Path) -> Path:
    """Convert fixture ``name`` into ``out_root/<tag>`` with DeepSpeed; returns that folder."""
    return _ds_to_universal(tag_dir(name), out_root, name)


def ds_to_universal_folder(ckpt: Path, out_root: Path) -> Path:
    """DeepSpeed's ``ds_to_universal`` of the checkpoint at ``ckpt`` (a tag folder, or its parent
    with ``latest``) into ``out_root/<tag>``, with ``out_root/latest_universal``; returns the tag folder."""
    latest = ckpt / "latest"
    tag = ckpt / latest.read_text().strip() if latest.is_file() else ckpt
    out = _ds_to_universal(tag, out_root, str(ckpt))
    (out_root / "latest_universal").write_text(out.name)
    return out


def _ds_to_universal(tag: Path, out_root: Path, name: str) -> Path:
    out = out_root / tag.name
    cmd = [sys.executable, "-W", "ignore", "-m", "deepspeed.checkpoint.ds_to_universal",
           "--input_folder", str(tag), "--output_folder", str(out), "--inject_missing_state",
           "--num_extract_workers", "1", "--num_merge_workers", "1"]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if res.returncode != 0:
        raise RuntimeError(f"ds_to_universal failed on {name}:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
    return out
