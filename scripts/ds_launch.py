"""Helpers for launching real DeepSpeed jobs on this machine's CPUs, shared by the fixture
generator (``make_fixtures.py``) and the end-to-end tests (``tests/e2e/launch.py``).

DeepSpeed's CPU all-reduce leaves shared-memory buffers named after the master port
(``/dev/shm/deepspeed_allreduce_buffer_*_<port>_*``, ~66 MiB per rank) after every run: launchers
pick ports with none left over and delete them when the job ends, whatever its outcome."""

from __future__ import annotations

import glob
import os
import re
import socket
import sys
from pathlib import Path

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "deepspeed_allreduce_buffer_"


def shm_files(port: int) -> list[str]:
    return glob.glob(str(SHM_DIR / f"{SHM_PREFIX}*_{port}_*"))


def cleanup_shm(port: int) -> list[str]:
    """Delete DeepSpeed's CPU all-reduce shared-memory buffers left for ``port``."""
    removed = []
    for path in shm_files(port):
        try:
            os.unlink(path)
            removed.append(os.path.basename(path))
        except FileNotFoundError:
            pass
    return removed


def port_is_free(port: int) -> bool:
    """Nobody listens on ``port`` and no DeepSpeed buffers are named after it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return not shm_files(port)


def launcher_cmd() -> list[str]:
    """The ``deepspeed`` launcher of this interpreter's environment."""
    ds = Path(sys.executable).parent / "deepspeed"
    if ds.exists():
        return [sys.executable, str(ds)]
    return [sys.executable, "-m", "deepspeed.launcher.runner"]


def root_cause(lines: list[str]) -> str:
    """The most telling exception line of a failed launch (not the peers' 'connection closed')."""
    errors = [ln.strip() for ln in lines
              if re.match(r"^(\[rank\d+\]: )?[A-Za-z_.]*(Error|Exception)\b", ln.strip())]
    primary = [e for e in errors if "Connection closed by peer" not in e and "ProcessGroup" not in e]
    chosen = primary or errors
    return chosen[0] if chosen else "(no exception line in the log)"
