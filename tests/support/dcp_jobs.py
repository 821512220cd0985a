"""Launch FSDP2 (optionally FSDP x TP) jobs that save or load a PyTorch DCP checkpoint
(``scripts/_fixture_dcp.py`` under ``torchrun --standalone``, gloo on CPU) and return their reports.

    from tests.support.dcp_jobs import FIXTURES, run_fsdp_job

    # load the 2-rank fixture at 3 ranks, take one step on the fixed batch
    rep = run_fsdp_job("load", 3, FIXTURES / "llama_fsdp2_ws2", steps=1)
    rep["digests"]["lm_head.weight"]["exp_avg"]["sha256"]   # of the state just loaded
    rep["tensors"]["lm_head.weight"]["exp_avg"]             # the full fp32 tensor itself
    rep["adam_step"], rep["losses"], rep["param_groups"]
    # train 3 steps on a 2x2 FSDP x TP mesh and save
    rep = run_fsdp_job("save", 4, tmp / "ckpt", mesh="2x2", steps=3)

The report is rank 0's ``report.json`` (see ``_fixture_dcp.py``), plus ``tensors`` (when
``save_tensors``), ``launch_seconds`` and ``report_dir`` (None when it was temporary). The
model, data and optimizer are the DeepSpeed Llama fixtures' (``scripts/make_fixtures.py``), so a
DCP checkpoint converted from one of them continues the same training here. Depends on torch
(and, inside the job, transformers) only.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from tests.support.paths import REPO  # noqa: E402 -- before the scripts' folder joins sys.path

if str(REPO / "scripts") not in sys.path:
    sys.path.insert(0, str(REPO / "scripts"))
from ds_launch import job_env, root_cause, run_job  # noqa: E402
from make_fixtures import DCP_SCRIPT, dcp_job_args, torchrun_cmd  # noqa: E402

FIXTURES = REPO / "tests" / "fixtures" / "dcp"
DEFAULT_TIMEOUT_S = 300


class DcpJobError(RuntimeError):
    """A launch failed or timed out; the message carries the root cause and the log tail."""


def _mesh_arg(mesh: str | tuple[int, int] | None) -> str | None:
    if mesh is None:
        return None
    if isinstance(mesh, str):
        return mesh
    dp, tp = mesh
    return f"{int(dp)}x{int(tp)}"


def run_fsdp_job(mode: str, world_size: int, dcp_dir: str | Path, report_dir: str | Path | None = None,
                 mesh: str | tuple[int, int] | None = None, steps: int = 1, timeout: float = DEFAULT_TIMEOUT_S,
                 *, model: str = "tiny", save_tensors: bool = True, digests: str = "full",
                 allow_partial_load: bool = False, batch_dp: int | None = None) -> dict:
    """Run ``_fixture_dcp.py mode`` on ``world_size`` CPU ranks and return its report.

    ``mode``: "save" (train ``steps`` steps, then ``dcp.save`` into ``dcp_dir``) or "load"
    (``dcp.load`` ``dcp_dir`` into a fresh FSDP2 model + AdamW, report that state, then train
    ``steps`` steps; 0 is allowed). ``mesh``: None for a 1-D FSDP2 mesh, else ``"DPxTP"`` or
    ``(dp, tp)``. ``report_dir``: where ``report.json`` / ``tensors.pt`` / ``launch.log`` stay;
    None for a temporary folder removed before returning (``tensors`` are read first).
    ``allow_partial_load``: load with ``DefaultLoadPlanner(allow_partial_load=True)`` (keys the
    checkpoint lacks keep their fresh values: the step counter is then 1, from the zero-lr step
    ``get_state_dict`` takes to create the Adam state). ``batch_dp``: the global batch is
    ``micro_batch * batch_dp`` rows (default 2, DeepSpeed's fixtures'), split over the DP ranks
    when they divide it. Raises :class:`DcpJobError` on failure."""
    if mode not in ("save", "load"):
        raise ValueError(f"mode must be 'save' or 'load', not {mode!r}")
    temp = report_dir is None
    rdir = Path(tempfile.mkdtemp(prefix="reshard-dcp-job-")) if temp else Path(report_dir)
    try:
        rdir.mkdir(parents=True, exist_ok=True)
        log_path = rdir / "launch.log"
        for stale in ("report.json", "tensors.pt"):  # never return a previous job's report
            (rdir / stale).unlink(missing_ok=True)
        args = dcp_job_args(mode, Path(dcp_dir).resolve(), rdir.resolve(), mesh=_mesh_arg(mesh), steps=steps,
                            model=model, digests=digests, save_tensors=save_tensors,
                            allow_partial_load=allow_partial_load, batch_dp=batch_dp)
        cmd = torchrun_cmd(world_size, DCP_SCRIPT, args)
        t0 = time.time()
        try:
            rc = run_job(cmd, cwd=REPO, env=job_env(REPO), log_path=log_path, timeout_s=timeout)
        except TimeoutError:
            raise DcpJobError(f"{mode} job ({world_size} ranks) timed out after {timeout}s; log tail:\n"
                              f"{_tail(log_path)}") from None
        seconds = time.time() - t0
        if rc != 0 or not (rdir / "report.json").is_file():
            lines = log_path.read_text(errors="replace").splitlines()
            raise DcpJobError(f"{mode} job ({world_size} ranks, mesh {mesh}) exited with {rc} after "
                              f"{seconds:.1f}s: {root_cause(lines)}\nlog tail:\n{_tail(log_path)}")
        report = json.loads((rdir / "report.json").read_text())
        if save_tensors:
            import torch

            report["tensors"] = torch.load(rdir / "tensors.pt", weights_only=True)
        report["launch_seconds"] = seconds
        report["report_dir"] = None if temp else str(rdir)
        return report
    finally:
        if temp:
            shutil.rmtree(rdir, ignore_errors=True)


def _tail(path: Path, n: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"
