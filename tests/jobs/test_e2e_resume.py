"""End to end: resume converted checkpoints with DeepSpeed 0.19.8's own ``load_universal``.

The ``llama_tp2_dp2`` fixture (TP=2 x DP=2, ZeRO-1) is converted twice -- by reshard and by
DeepSpeed's ``ds_to_universal`` -- and each result is resumed in real gloo jobs at TP=2 x DP=1 and
at TP=1 x DP=2 (``tests/e2e/launch.py``), taking two training steps. Both routes must give the same
losses (exact float equality) and the same digests of the fp32 master weights, Adam moments and
module weights, right after the load and after the steps. The digests are per parameter, over the
logical (unsharded) tensor: a sha256 of its bytes plus an exactly rounded weighted sum
(``tests/e2e/digest.py``). A negative control perturbs one Adam moment by one ulp and one weight
by 1e-3 in a copy of reshard's output and shows the digests catch both. An oracle independent of
both converters: DeepSpeed's native loader, resuming the source checkpoint at its own topology,
holds the very state both conversions load to.

Every load here runs in a job shared with the e2e tests of ``tests/formats/deepspeed/test_zero12_reshard.py``, one job per
world size, each checkpoint loaded into a fresh engine (``tests/e2e/plan.py``; the session fixture
``e2e`` of ``tests/conftest.py``): two jobs in all, ~30-60 s each on 2 CPU cores.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

from reshard.storage.safe_load import load  # noqa: E402
from tests.e2e.digest import differences, digest  # noqa: E402
from tests.e2e.plan import (  # noqa: E402
    E2E,
    EXP_AVG_PERTURB,
    FP32_PERTURB,
    LLAMA,
    NEGATIVE_TOPOLOGY,
    SOURCE_TOPOLOGY,
    STEPS,
    UCP_TOPOLOGIES,
)
from tests.support.dsconv import FIXTURES  # noqa: E402

pytestmark = pytest.mark.e2e

FIXTURE = LLAMA
TOPOLOGIES = UCP_TOPOLOGIES  # (tp, dp) targets, 2 processes each
ROUTES = ("reshard", "ds_to_universal")


@pytest.fixture(scope="module")
def fixture_meta() -> dict:
    return json.loads((FIXTURES / FIXTURE / "fixture.json").read_text())


@pytest.fixture(scope="module")
def routes(e2e: E2E) -> dict[str, Path]:
    """route -> load_dir (the folder holding ``latest_universal`` and the tag folder)."""
    ours, theirs = e2e.reshard_ucp(), e2e.ds_ucp(FIXTURE)
    for load_dir in (ours, theirs):
        assert (load_dir / "latest_universal").read_text().strip() == "global_step3"
    return {"reshard": ours, "ds_to_universal": theirs}


@pytest.fixture(scope="module")
def resumed(e2e: E2E):
    """resumed(kind, tp, dp) -> report of resuming FIXTURE's ``kind`` checkpoint at TP=tp x DP=dp:
    a route of ROUTES, ``perturbed`` or ``source`` (see ``plan.Load``); the jobs run once per session."""

    def get(kind: str, tp: int, dp: int) -> dict:
        return e2e.report(kind, FIXTURE, tp, dp)

    return get


def file_digests(load_dir: Path) -> dict:
    """{param: {state: digest}} straight from a universal checkpoint's ``zero/<param>/<state>.pt``."""
    tag = (load_dir / "latest_universal").read_text().strip()
    out = {}
    for folder in sorted(p for p in (load_dir / tag / "zero").iterdir() if p.is_dir()):
        out[folder.name] = {state: digest(folder.name, load(folder / f"{state}.pt", mmap=False)["param"])
                            for state in ("fp32", "exp_avg", "exp_avg_sq")}
    return out


def _sane(report: dict, tp: int, dp: int) -> None:
    assert report["topology"] == {"tp": tp, "dp": dp, "world_size": tp * dp, "zero_stage": 1, "universal": True}
    assert report["tag"] is None and report["load_path"].startswith(report["load_dir"] + "/global_step3/"), \
        "DeepSpeed should have found the tag through latest_universal"
    assert len(report["losses"]) == STEPS and all(math.isfinite(x) for x in report["losses"])
    assert report["ranks_agree"], "ranks computed different digests"
    assert report["tp_peers_same_loss"]
    assert report["replica_mismatches"] == []
    assert report["global_steps_after_load"] == 3 and report["global_steps_after_steps"] == 3 + STEPS
    assert report["optimizer_step_after_load"] == [3.0]
    assert report["optimizer_step_after_steps"] == [3.0 + STEPS]
    assert report["shm_removed"], "expected DeepSpeed's shared-memory all-reduce buffers to be cleaned up"


@pytest.mark.parametrize("tp,dp", TOPOLOGIES, ids=[f"tp{t}dp{d}" for t, d in TOPOLOGIES])
def test_reshard_and_ds_to_universal_resume_identically(tp, dp, resumed, fixture_meta):
    ours, theirs = resumed("reshard", tp, dp), resumed("ds_to_universal", tp, dp)
    for route, r in (("reshard", ours), ("ds_to_universal", theirs)):
        print(f"TP={tp} x DP={dp} {route}: losses per DP rank {r['losses_per_dp_rank']}, digests after load "
              f"{r['digest_summary']['after_load'][:16]}, after steps {r['digest_summary']['after_steps'][:16]}, "
              f"job {r['wall_seconds']:.1f}s")
    _sane(ours, tp, dp)
    _sane(theirs, tp, dp)
    assert ours["losses_per_rank"] == theirs["losses_per_rank"]  # exact float equality
    assert ours["losses"] == theirs["losses"]
    for phase in ("after_load", "after_steps"):
        diff = differences(theirs["digests"][phase], ours["digests"][phase])
        assert diff == [], f"{phase}: reshard vs ds_to_universal differ in {diff}"
        assert ours["digests"][phase] == theirs["digests"][phase]  # wsum too, bit for bit
    # It resumed (rather than restarted): the first step's loss on each data-parallel slice is below
    # the last loss the fixture recorded on the same rows.
    fixture_last = {r["dp_rank"]: fixture_meta["losses_per_rank"][str(r["rank"])][-1]
                    for r in fixture_meta["topology"]["ranks"]}
    for d, losses in ours["losses_per_dp_rank"].items():
        assert losses[0] < fixture_last[int(d)], (d, losses, fixture_last)


@pytest.mark.parametrize("tp,dp", TOPOLOGIES, ids=[f"tp{t}dp{d}" for t, d in TOPOLOGIES])
def test_loaded_state_is_the_converted_state(tp, dp, resumed, routes):
    """What DeepSpeed holds right after the load is exactly what the universal files say, and the
    module weights equal the fp32 master (fp32 training)."""
    for route in ROUTES:
        loaded = resumed(route, tp, dp)["digests"]["after_load"]
        on_disk = file_digests(routes[route])
        assert set(loaded) == set(on_disk)
        for name, states in on_disk.items():
            for state, d in states.items():
                assert loaded[name][state] == d, f"{route} {name} {state}"
            assert loaded[name]["module"] == loaded[name]["fp32"], f"{route} {name}"


def test_digests_do_not_depend_on_the_topology(resumed):
    """The same state loaded at TP=2 x DP=1 and at TP=1 x DP=2 gives the same digests, so the
    digest really is over the logical tensor and not the shard layout."""
    a, b = (resumed("reshard", tp, dp) for tp, dp in TOPOLOGIES)
    assert a["digests"]["after_load"] == b["digests"]["after_load"]
    assert a["digest_summary"]["after_load"] == b["digest_summary"]["after_load"]


def test_negative_control_digests_catch_small_changes(e2e: E2E, resumed):
    """A copy of reshard's output with EXP_AVG_PERTURB and FP32_PERTURB applied
    (``plan.perturb``), resumed in the same job as the unchanged one."""
    tp, dp = NEGATIVE_TOPOLOGY
    baseline = resumed("reshard", tp, dp)
    load_dir = e2e.perturbed_ucp()
    report = resumed("perturbed", tp, dp)
    _sane(report, tp, dp)

    # Right after the load exactly the perturbed entries differ, in both sha256 and weighted sum
    # (module follows fp32), and they hold exactly the perturbed file contents.
    diff = differences(baseline["digests"]["after_load"], report["digests"]["after_load"])
    changed = {(n, k) for n, k, _ in diff}
    assert changed == {(EXP_AVG_PERTURB[0], "exp_avg"), (FP32_PERTURB[0], "fp32"), (FP32_PERTURB[0], "module")}, diff
    assert all(delta != 0 and math.isfinite(delta) for _, _, delta in diff), diff
    on_disk = file_digests(load_dir)
    assert report["digests"]["after_load"][EXP_AVG_PERTURB[0]]["exp_avg"] == on_disk[EXP_AVG_PERTURB[0]]["exp_avg"]
    assert report["digests"]["after_load"][FP32_PERTURB[0]]["fp32"] == on_disk[FP32_PERTURB[0]]["fp32"]
    # The weighted sum moved by about weight * 1e-3 for the weight change.
    (delta,) = [d for n, k, d in diff if (n, k) == (FP32_PERTURB[0], "fp32")]
    assert 0.99e-3 <= abs(delta) <= 2.01e-3, delta

    # ... and the run that follows differs too.
    after = differences(baseline["digests"]["after_steps"], report["digests"]["after_steps"])
    assert (EXP_AVG_PERTURB[0], "exp_avg") in {(n, k) for n, k, _ in after}
    assert report["digest_summary"]["after_steps"] != baseline["digest_summary"]["after_steps"]


@pytest.mark.slow  # a 4-rank job of its own
def test_native_resume_of_the_source_holds_the_same_state(resumed):
    """Oracle independent of both converters: DeepSpeed's native loader, resuming the *source*
    checkpoint at its own topology (TP=2 x DP=2), holds exactly the state both converted
    checkpoints load to."""
    native = resumed("source", *SOURCE_TOPOLOGY)
    assert native["topology"]["universal"] is False and native["load_path"].endswith("mp_rank_00_model_states.pt")
    assert native["global_steps_after_load"] == 3 and native["optimizer_step_after_load"] == [3.0]
    assert native["ranks_agree"] and native["replica_mismatches"] == []
    for tp, dp in TOPOLOGIES:
        ours = resumed("reshard", tp, dp)
        assert differences(native["digests"]["after_load"], ours["digests"]["after_load"]) == []
        assert ours["digests"]["after_load"] == native["digests"]["after_load"]
    # Same DP size, same rows: the first step (forward on the loaded weights) agrees to rounding.
    ours = resumed("reshard", 1, 2)
    for d, losses in native["losses_per_dp_rank"].items():
        assert abs(losses[0] - ours["losses_per_dp_rank"][d][0]) < 1e-5
