"""Launch ``tests/e2e/resume_train.py`` / ``resume_pipe.py`` as real DeepSpeed jobs (gloo on CPU)
and return their reports.

Main entry points::

    from tests.e2e.launch import model_spec_from_fixture, resume, resume_load, resume_many

    spec = model_spec_from_fixture("tests/fixtures/deepspeed/llama_tp2_dp2")
    report = resume("/tmp/ucp", model_spec=spec, tp=2, dp=1, zero_stage=1, universal=True)
    report["losses"], report["digests"]["after_load"]["lm_head.weight"]["exp_avg"]

    # several checkpoints in one job (one process start, one process group, one port):
    reports = resume_many([resume_load("ours", "/tmp/ucp", model_spec=spec, tp=2, dp=1, universal=True),
                           resume_load("theirs", "/tmp/ds", model_spec=spec, tp=2, dp=1, universal=True)],
                          world_size=2)
    reports["ours"]["losses"] == reports["theirs"]["losses"]

``load_dir`` is the folder that holds ``latest_universal`` (``universal=True``) or ``latest``
(``universal=False``, DeepSpeed's native loader) next to the tag folder; pass ``tag=`` to name the
tag folder instead. Every launch gets its own free master port, and DeepSpeed's CPU all-reduce
shared-memory buffers for that port (``/dev/shm/deepspeed_allreduce_buffer_*_<port>_*``, ~66 MiB
per rank, left behind by every run) are deleted afterwards, whether the job succeeded or not.
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
from ds_launch import cleanup_shm, job_env, launcher_cmd, port_is_free, root_cause, run_job  # noqa: E402

RESUME_SCRIPT = Path(__file__).resolve().with_name("resume_train.py")
RESUME_PIPE_SCRIPT = Path(__file__).resolve().with_name("resume_pipe.py")
RESUME_MOE_SCRIPT = Path(__file__).resolve().with_name("resume_moe.py")
DEFAULT_TIMEOUT_S = 600
PER_LOAD_TIMEOUT_S = 150  # added to DEFAULT_TIMEOUT_S per load after the first


class LaunchError(RuntimeError):
    pass


# --------------------------------------------------------------------------------------------
# Specs
# --------------------------------------------------------------------------------------------


def model_spec_from_fixture(fixture_dir: str | Path) -> dict:
    """The model + data recipe of a committed fixture (``<fixture_dir>/fixture.json``)."""
    fx = json.loads((Path(fixture_dir) / "fixture.json").read_text())
    return {
        "model_type": fx["model_type"],
        "model_config": fx["model_config"],
        "patches": fx.get("patches", []),
        "seed": fx["seed"],
        "seq_len": fx["data"]["seq_len"],
        "micro_batch": fx["data"]["micro_batch"],
        "ds_config": fx["ds_config"],
    }


def target_ds_config(base: dict, *, tp: int, zero_stage: int, universal: bool, micro_batch: int) -> dict:
    """``base`` adjusted to the target topology: AutoTP size ``tp``, ZeRO ``zero_stage``, and
    ``checkpoint.load_universal`` set to ``universal``."""
    cfg = copy.deepcopy(base)
    cfg.pop("train_batch_size", None)  # DeepSpeed derives it from micro batch * GAS * DP
    cfg["train_micro_batch_size_per_gpu"] = micro_batch
    cfg.setdefault("gradient_accumulation_steps", 1)
    cfg.setdefault("zero_optimization", {})["stage"] = zero_stage
    cfg["tensor_parallel"] = {**cfg.get("tensor_parallel", {}), "autotp_size": tp}
    cfg["checkpoint"] = {**cfg.get("checkpoint", {}), "load_universal": bool(universal)}
    return cfg


# --------------------------------------------------------------------------------------------
# Ports and shared memory
# --------------------------------------------------------------------------------------------


def free_port(lo: int = 20000, hi: int = 45000) -> int:
    """A TCP port nobody listens on and no leftover DeepSpeed buffer names (random, so that
    concurrent test sessions do not walk the same sequence)."""
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(1000):
        port = rng.randrange(lo, hi)
        if port_is_free(port):
            return port
    raise LaunchError("no free port found")


# --------------------------------------------------------------------------------------------
# Launching
# --------------------------------------------------------------------------------------------


def launch(script: str | Path, spec: dict, *, world_size: int, workdir: str | Path, port: int | None = None,
           timeout_s: int = DEFAULT_TIMEOUT_S) -> dict:
    """Run ``script --spec <workdir>/spec.json`` on ``world_size`` CPU ranks through the
    ``deepspeed`` launcher; returns ``{"seconds": wall time, "port": port, "shm_removed": [names of
    the shared-memory buffers deleted afterwards]}``. Output goes to ``<workdir>/launch.log``.
    Raises :class:`LaunchError` (with the log tail) on failure or timeout. The launched
    processes run in their own session, killed as a group on timeout/interrupt, and the port's
    shared-memory buffers are removed in every case. A port
    taken by another process between :func:`free_port`'s check and the launcher's bind (EADDRINUSE)
    is retried on a new free port, twice, when ``port`` was not given."""
    for attempt in range(3):
        try:
            return _launch(script, spec, world_size=world_size, workdir=workdir, port=port or free_port(),
                           timeout_s=timeout_s)
        except LaunchError as e:
            if port is not None or attempt == 2 or "EADDRINUSE" not in str(e):
                raise
    raise AssertionError("unreachable")


def _launch(script: str | Path, spec: dict, *, world_size: int, workdir: str | Path, port: int,
            timeout_s: int) -> dict:
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    log_path = workdir / "launch.log"
    cmd = launcher_cmd() + ["--num_gpus", str(world_size), "--no_local_rank", "--master_port", str(port),
                             str(script), "--spec", str(spec_path)]
    t0 = time.time()
    result = {"seconds": None, "port": port, "shm_removed": []}
    try:
        try:
            rc = run_job(cmd, cwd=REPO, env=job_env(REPO), log_path=log_path, timeout_s=timeout_s)
        except TimeoutError:
            raise LaunchError(f"launch on port {port} timed out after {timeout_s}s; log tail:\n"
                              f"{_tail(log_path)}") from None
        if rc != 0:
            lines = log_path.read_text(errors="replace").splitlines()
            raise LaunchError(f"launch on port {port} exited with {rc} after {time.time() - t0:.1f}s: {root_cause(lines)}\n"
                              f"log tail:\n{_tail(log_path)}")
        result["seconds"] = time.time() - t0
        return result
    finally:
        result["shm_removed"] = cleanup_shm(port)


def _tail(path: Path, n: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


_HYPER = ("lr", "betas", "eps", "weight_decay")  # what a recorded group sets beside the ds_config's optimizer


def recorded_groups(load_dir: str | Path, tag: str | None = None) -> list[dict]:
    """The optimizer parameter groups a ZeRO-1/2 checkpoint's files record, as the job that wrote
    them built its optimizer: each group's parameter names in the files' order (``param_shapes``
    of the model states) and its Adam settings (``base_optimizer_state``'s param groups of DP rank
    0's optimizer file), e.g. Megatron's weight-decay and no-decay groups. For
    :func:`resume_load`'s ``param_groups``."""
    from reshard.storage.safe_load import load

    root = Path(load_dir)
    folder = root / (tag or (root / "latest").read_text().strip())
    shapes = load(folder / "mp_rank_00_model_states.pt")["param_shapes"]
    shapes = shapes if isinstance(shapes, list) else [shapes]
    optim = load(folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
    hyper = optim["base_optimizer_state"]["param_groups"]
    if len(hyper) != len(shapes):
        raise ValueError(f"{folder}: {len(shapes)} param_shapes groups, {len(hyper)} optimizer groups")
    return [{**{k: (list(g[k]) if k == "betas" else g[k]) for k in _HYPER if k in g}, "params": list(names)}
            for names, g in zip(shapes, hyper)]


def resume_load(name: str, load_dir: str | Path, *, model_spec: dict, tp: int, dp: int, universal: bool,
                zero_stage: int = 1, steps: int = 2, tag: str | None = None,
                save_dir: str | Path | None = None, param_groups: list[dict] | None = None) -> dict:
    """One entry of :func:`resume_many`: resume the checkpoint in ``load_dir`` at TP=``tp`` x
    DP=``dp`` and take ``steps`` training steps; its report is keyed by ``name``. With
    ``save_dir``, DeepSpeed saves what it loaded there natively (``save_checkpoint``, same tag)
    right after the load, before the steps. ``param_groups``: the optimizer groups to build
    (:func:`recorded_groups`), else the model's parameters as one group.

    ``model_spec``: see :func:`model_spec_from_fixture` (its ``ds_config`` is the base config,
    adjusted here by :func:`target_ds_config`)."""
    load = {k: v for k, v in model_spec.items() if k != "ds_config"}
    load.update(
        name=name,
        ds_config=target_ds_config(model_spec["ds_config"], tp=tp, zero_stage=zero_stage, universal=universal,
                                   micro_batch=int(model_spec["micro_batch"])),
        load_dir=str(Path(load_dir).resolve()),
        tag=tag,
        steps=int(steps),
        expect={"tp": tp, "dp": dp},
        save_dir=None if save_dir is None else str(Path(save_dir).resolve()),
        param_groups=param_groups,
    )
    return load


def check_tp_order(tps: list[int]) -> None:
    """DeepSpeed creates its tensor-parallel groups (and a device mesh whose data-parallel group
    later engines use) with the first engine that asks for TP > 1 and keeps them for the life of
    the process. So in one job, loads at TP=1 must all come first, and at most one TP size above 1
    may follow."""
    above = [t for t in tps if t > 1]
    if len(set(above)) > 1 or any(t == 1 for t in tps[len(tps) - len(above):]):
        raise ValueError(f"one job cannot run TP sizes {tps} in this order: TP=1 loads first, "
                         "then at most one TP size above 1")


def resume_many(loads: list[dict], *, world_size: int, port: int | None = None,
                workdir: str | Path | None = None, timeout_s: int | None = None) -> dict[str, dict]:
    """Resume each of ``loads`` (from :func:`resume_load`) in turn, in one job of ``world_size``
    ranks, each into a fresh engine; returns ``{name: rank 0's report}`` (see ``resume_train.py``):
    ``losses`` (per step, mean over DP ranks), ``losses_per_rank``, ``digests``
    (``{"after_load"|"after_steps": {param: {"fp32"|"exp_avg"|"exp_avg_sq"|"module": digest}}}``),
    ``digest_summary``, ``global_steps_after_load``, ``optimizer_step_after_load``,
    ``ranks_agree``, ``replica_mismatches``, ... plus ``wall_seconds`` (that load's time inside the
    job), ``job_seconds``, ``port`` and ``shm_removed`` (the job's).

    ``workdir``: where the spec, log and report go (a temporary folder, removed afterwards, when
    None). Raises :class:`LaunchError` when the job fails or a load ran at another topology."""
    names = [load["name"] for load in loads]
    if len(set(names)) != len(names):
        raise ValueError(f"load names must be unique: {names}")
    for load in loads:
        if load["expect"]["tp"] * load["expect"]["dp"] != world_size:
            raise ValueError(f"{load['name']}: TP x DP = {load['expect']} does not fit {world_size} ranks")
    check_tp_order([load["expect"]["tp"] for load in loads])
    reports, ran = _run_loads(RESUME_SCRIPT, loads, world_size=world_size, port=port, workdir=workdir,
                              timeout_s=timeout_s)
    for load in loads:
        report = reports[load["name"]]
        topo, want = report["topology"], load["expect"]
        if (topo["tp"], topo["dp"]) != (want["tp"], want["dp"]):
            raise LaunchError(f"{load['name']}: asked for TP={want['tp']} x DP={want['dp']}, "
                              f"DeepSpeed ran TP={topo['tp']} x DP={topo['dp']}")
        report.update(wall_seconds=report["seconds"], job_seconds=ran["seconds"], port=ran["port"],
                      shm_removed=ran["shm_removed"])
    return reports


def resume(load_dir: str | Path, *, model_spec: dict, tp: int, dp: int, zero_stage: int, universal: bool,
           steps: int = 2, port: int | None = None, tag: str | None = None, workdir: str | Path | None = None,
           timeout_s: int = DEFAULT_TIMEOUT_S) -> dict:
    """Resume one checkpoint in its own job of ``tp * dp`` ranks: :func:`resume_many` of a single
    :func:`resume_load`; returns its report."""
    load = resume_load("resume", load_dir, model_spec=model_spec, tp=tp, dp=dp, universal=universal,
                       zero_stage=zero_stage, steps=steps, tag=tag)
    return resume_many([load], world_size=tp * dp, port=port, workdir=workdir, timeout_s=timeout_s)["resume"]


def resume_pipe_many(loads: list[dict], *, world_size: int, port: int | None = None,
                     workdir: str | Path | None = None, timeout_s: int | None = None) -> dict[str, dict]:
    """Run ``resume_pipe.py`` over ``loads`` (see its docstring) in one job of ``world_size``
    ranks; returns ``{name: {"losses", "stages", "dp"}}`` plus the job's ``port`` and
    ``shm_removed`` in each."""
    reports, ran = _run_loads(RESUME_PIPE_SCRIPT, loads, world_size=world_size, port=port, workdir=workdir,
                              timeout_s=timeout_s)
    for report in reports.values():
        report.update(port=ran["port"], shm_removed=ran["shm_removed"])
    return reports


def resume_moe_many(loads: list[dict], *, world_size: int, port: int | None = None,
                    workdir: str | Path | None = None, timeout_s: int | None = None) -> dict[str, dict]:
    """Run ``resume_moe.py`` (classic ``deepspeed.moe.layer.MoE`` models; see its docstring for a
    load's keys) over ``loads`` in one job of ``world_size`` ranks; returns ``{name: rank 0's
    report}`` plus the job's ``port`` and ``shm_removed`` in each."""
    reports, ran = _run_loads(RESUME_MOE_SCRIPT, loads, world_size=world_size, port=port, workdir=workdir,
                              timeout_s=timeout_s)
    for report in reports.values():
        report.update(port=ran["port"], shm_removed=ran["shm_removed"])
    return reports


def _run_loads(script: Path, loads: list[dict], *, world_size: int, port: int | None,
               workdir: str | Path | None, timeout_s: int | None) -> tuple[dict[str, dict], dict]:
    """Launch ``script`` over ``loads``; (rank 0's ``{name: report}``, :func:`launch`'s result)."""
    timeout_s = timeout_s or DEFAULT_TIMEOUT_S + PER_LOAD_TIMEOUT_S * (len(loads) - 1)
    own = workdir is None
    work = Path(tempfile.mkdtemp(prefix="reshard-e2e-")) if own else Path(workdir)
    try:
        report_path = work / "report.json"
        spec = {"loads": loads, "report_path": str(report_path)}
        ran = launch(script, spec, world_size=world_size, workdir=work, port=port, timeout_s=timeout_s)
        reports = json.loads(report_path.read_text())["loads"] if report_path.is_file() else {}
        missing = [load["name"] for load in loads if load["name"] not in reports]
        if missing:
            raise LaunchError(f"rank 0 reported nothing for {missing}; "
                              f"log tail:\n{_tail(work / 'launch.log')}")
        return reports, ran
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)


def assert_autoep_resume_parity(fixture: str, ucp: Path, work: Path, *, ep: int, world: int, expert: str) -> None:
    """One real job: DeepSpeed resumes ``ucp`` (its own ``ds_to_universal`` of AutoEP ``fixture``)
    at EP ``ep`` x ``world`` ranks and saves it natively, then resumes reshard's output of the
    fixture there and saves that natively too. The files (but ds_config) equal DeepSpeed's native
    save of the universal, but the expert group's name: reshard's is DeepSpeed's engine's at the
    target EP (``ep_size_<ep>``), which DeepSpeed's native load keeps (its save of what it loaded
    from reshard's files is those files, name included), where its universal load keeps the
    source's; steps, layouts, layout-free digests and losses agree."""
    from reshard.jobs.convert import reshard
    from reshard.storage.safe_load import load
    from tests.support.compare import diff_files
    from tests.support.dsconv import FIXTURES

    (ucp.parent / "latest_universal").write_text(ucp.name)
    spec = model_spec_from_fixture(FIXTURES / fixture)
    spec["ds_config"]["expert_parallel"]["autoep_size"] = ep
    ours = reshard(FIXTURES / fixture, work / "ours", tp=1, dp=world, ep=ep).out_dir
    native, resaved = work / "native", work / "resaved"
    loads = [resume_load("deepspeed", ucp.parent, model_spec=spec, tp=1, dp=world, universal=True, save_dir=native),
             resume_load("reshard", ours.parent, model_spec=spec, tp=1, dp=world, universal=False, save_dir=resaved)]
    reports = resume_many(loads, world_size=world, workdir=work / "job")
    theirs, mine = reports["deepspeed"], reports["reshard"]
    diff_files(ours, resaved / ours.name)
    source = load(next((FIXTURES / fixture).rglob("zero_pp_rank_0_mp_rank_00_optim_states.pt")))
    src_name = source["optimizer_state_dict"]["base_optimizer_state"]["param_groups"][1]["name"]
    ours_name = load(ours / "zero_pp_rank_0_mp_rank_00_optim_states.pt")[
        "optimizer_state_dict"]["base_optimizer_state"]["param_groups"][1]["name"]
    assert ours_name == f"ep_size_{ep}"
    diff_files(ours, native / ours.name, group_names={ours_name: src_name})
    assert mine["global_steps_after_load"] == theirs["global_steps_after_load"] == 3
    assert mine["optimizer_step_after_load"] == theirs["optimizer_step_after_load"] == [3.0]
    assert mine["ranks_agree"] and theirs["ranks_agree"]
    assert mine["layouts"][expert] == "autoep"
    assert mine["digests"] == theirs["digests"], f"EP {ep} x world {world}"
    assert mine["losses"] == theirs["losses"], f"EP {ep} x world {world}"
