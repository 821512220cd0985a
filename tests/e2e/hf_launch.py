"""Launch ``tests/e2e/hf_resume.py`` (an HF Trainer + DeepSpeed resume of an HF fixture) as a real
job and return its report::

    from tests.e2e.hf_launch import resume
    from tests.e2e.hf_universal import make_universal

    report = resume("tests/fixtures/hf/trainer_llama_zero3", world_size=2, out_dir=tmp / "same")
    ucp = make_universal(fixture / "checkpoint-3", tmp / "ucp" / "checkpoint-3")
    report = resume(fixture, checkpoint=ucp, universal=True, world_size=1, per_device_batch=4,
                    out_dir=tmp / "w1")
    report["ok"], [s["loss"] for s in report["losses"]]

World size 1 runs plain ``python`` (the script sets its own ``RANK``/``WORLD_SIZE``), larger ones
``deepspeed --num_gpus W --no_local_rank``. Every launch takes a free master port and deletes
DeepSpeed's CPU all-reduce buffers of that port (``/dev/shm/deepspeed_allreduce_buffer_*_<port>_*``)
afterwards, whatever the outcome. A failing job still returns its report (``ok`` false,
``error``) when it wrote one; :class:`LaunchError` otherwise.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
from ds_launch import cleanup_shm, job_env, launcher_cmd, port_is_free, root_cause, run_job  # noqa: E402

SCRIPT = Path(__file__).resolve().with_name("hf_resume.py")
DEFAULT_TIMEOUT_S = 900


class LaunchError(RuntimeError):
    pass


def free_port(lo: int = 31000, hi: int = 39000) -> int:
    for _ in range(200):
        port = random.randint(lo, hi)
        if port_is_free(port):
            return port
    raise LaunchError("no free port")


def resume(fixture: str | Path, *, out_dir: str | Path, world_size: int = 2, checkpoint: str | Path | None = None,
           per_device_batch: int | None = None, universal: bool = False, max_steps: int | None = None,
           save: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict:
    """Run one resume job; its ``report.json`` (see ``hf_resume.py``) plus ``log`` (the log path).
    A master port taken by another process between :func:`free_port`'s check and the job's bind
    (EADDRINUSE) is retried on a new one, twice."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    args = ["--fixture", str(fixture), "--out", str(out_dir)]
    if checkpoint is not None:
        args += ["--checkpoint", str(checkpoint)]
    if per_device_batch is not None:
        args += ["--per-device-batch", str(per_device_batch)]
    if max_steps is not None:
        args += ["--max-steps", str(max_steps)]
    if universal:
        args.append("--universal")
    if save:
        args.append("--save")
    for attempt in range(3):
        try:
            return _launch(args, out_dir, world_size, timeout_s)
        except LaunchError as e:
            if attempt == 2 or "EADDRINUSE" not in str(e):
                raise
    raise AssertionError("unreachable")


def _launch(args: list[str], out_dir: Path, world_size: int, timeout_s: float) -> dict:
    port = free_port()
    if world_size == 1:
        cmd = [sys.executable, str(SCRIPT), *args, "--master-port", str(port)]
    else:
        cmd = launcher_cmd() + ["--num_gpus", str(world_size), "--no_local_rank", "--master_port", str(port),
                                str(SCRIPT), *args]
    log_path = out_dir / "launch.log"
    env = job_env(REPO / "scripts")
    # DeepSpeed JIT-builds its CPU all-reduce op into ~/.cache/torch_extensions, shared by every
    # virtual environment here; environments taking turns there rebuild it each time
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    try:
        rc = run_job(cmd, cwd=REPO, env=env, log_path=log_path, timeout_s=timeout_s)
    finally:
        cleanup_shm(port)
    report_path = out_dir / "report.json"
    if not report_path.is_file():
        lines = open(log_path, errors="replace").readlines()
        raise LaunchError(f"exit {rc}, no report: {root_cause(lines)} (log: {log_path})")
    report = json.loads(report_path.read_text())
    report["log"] = str(log_path)
    report["returncode"] = rc
    return report
