"""Helpers for launching real DeepSpeed jobs on this machine's CPUs, shared by the fixture
generator (``make_fixtures.py``) and the end-to-end tests (``tests/e2e/launch.py``).

DeepSpeed's CPU all-reduce leaves shared-memory buffers named after the master port
(``/dev/shm/deepspeed_allreduce_buffer_*_<port>_*``, ~66 MiB per rank) after every run: launchers
pick ports with none left over and delete them when the job ends, whatever its outcome."""

from __future__ import annotations

import glob
import os
import re
import signal
import socket
import subprocess
import sys
import time
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


def job_env(*pythonpath: str | Path) -> dict[str, str]:
    """The environment of a launched job: one OpenMP thread per rank, fixed hash seed, nothing
    fetched from the Hugging Face hub, ``pythonpath`` entries first on ``PYTHONPATH``."""
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([str(p) for p in pythonpath] + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("PYTHONHASHSEED", "0")
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    return env


def run_job(cmd: list[str], *, cwd: str | Path, env: dict[str, str], log_path: str | Path, timeout_s: float) -> int:
    """Run a launcher command in its own session, output to ``log_path``; its exit status.
    Raises :class:`TimeoutError` past ``timeout_s``. Whatever happens, the launcher and every
    rank are gone when this returns, so nothing recreates shared-memory buffers afterwards."""
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=logf, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"timed out after {timeout_s}s") from None
        finally:
            kill_group(proc)  # a no-op when everything exited


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def kill_group(proc: subprocess.Popen) -> None:
    """Terminate the launcher and every rank (they share the session started for the launcher),
    and wait until none is left."""
    pgid = proc.pid
    for sig, grace_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 15.0)):
        proc.poll()  # reap the launcher, if it is done, so it does not count as alive
        if not _group_alive(pgid):
            break
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            proc.poll()
            if not _group_alive(pgid):
                break
            time.sleep(0.1)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:  # pragma: no cover
        pass

