"""``reshard.WeightSync``: trainer shards into an inference engine's tensors, every step.

The process tests share one 6-rank gloo job (``sync_job``: FSDP2 trainer, vLLM-style TP engine in
plain torch, no mocks); the others run a whole push of many ranks in this process
(``sync_program.simulate``: the same plans, rounds and programs, messages as copies).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard import layouts as L
from reshard.execute.sync_program import simulate
from reshard.layouts.inference import Placed, engine_shapes, placed
from reshard.plan.planner import plan_model
from tests.support import sync_job as J
from tests.support.spawn import run_ranks

JOB_TIMEOUT_S = 240  # the whole job; about 40 s here


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict:
    job = run_ranks(J.worker, J.WORLD, tmp_path_factory.mktemp("sync"), JOB_TIMEOUT_S, "phase")
    return {"phases": job.pop("records"), **job}


def _phase(job, name: str, ranks) -> dict[int, dict]:
    recs = job["phases"].get(name, {})
    missing = [r for r in ranks if r not in recs]
    assert not missing, f"ranks {missing} did not finish {name} (hung {job['hung']}, exit codes {job['exitcodes']})"
    crashed = {r: recs[r]["crashed"] for r in ranks if "crashed" in recs[r]}
    assert not crashed, f"{name} crashed: {crashed}"
    return recs


def _expected_bytes(tp: int, ranks: list[int], trainer: list[int]) -> tuple[dict[int, int], dict[int, int]]:
    """What each rank must send and receive: the global plan's remote bytes at 2 bytes an element."""
    src, shapes = J.source_maps(trainer)
    tg = J.targets(shapes, tp, ranks)
    stats = plan_model(src, {n: t.map for n, t in tg.items()}).stats(2)
    return stats.sent, stats.received


def _assert_engine_exact(checks: list[dict], r: int) -> None:
    for k, c in enumerate(checks):
        assert c["errors"] == [], f"rank {r} step {k}: engine tensors differ from bf16 slices: {c['errors']}"
        # float64 TP forward vs HF's on the same bf16 weights: summation order and HF's fp32
        # norm/softmax only; against the previous step's weights the logits differ visibly
        assert c["logits_diff"] < 1e-6, f"rank {r} step {k}: logits differ by {c['logits_diff']}"
        if "logits_diff_previous" in c:
            assert c["logits_diff_previous"] > 1e-3, f"rank {r} step {k}: weights did not change?"


def test_disjoint_trainer_to_tp2_engine_is_exact_every_step(job):
    recs = _phase(job, "disjoint", range(J.WORLD))
    for r in J.ENGINE:
        assert len(recs[r]["checks"]) == J.STEPS
        _assert_engine_exact(recs[r]["checks"], r)
        assert recs[r]["in_place"], f"rank {r}: engine tensors were replaced, not filled"


def test_disjoint_wire_carries_bf16_bytes_of_the_plan(job):
    recs = _phase(job, "disjoint", range(J.WORLD))
    sent, received = _expected_bytes(2, J.ENGINE, J.TRAINER)
    for r, rec in recs.items():
        for push in rec["pushes"]:
            assert push["stats"]["sent_bytes"] == sent.get(r, 0), f"rank {r}"
            assert push["stats"]["received_bytes"] == received.get(r, 0), f"rank {r}"
    assert sum(received.values()) > 0 and all(recs[r]["pushes"][0]["stats"]["packed_bytes"] > 0 for r in J.TRAINER)


def test_steps_after_the_first_allocate_and_plan_nothing(job):
    for name, ranks in (("disjoint", range(J.WORLD)), ("colocated", J.COLO)):
        recs = _phase(job, name, ranks)
        for r in ranks:
            rec = recs[r]
            assert rec["construct_planner_calls"] > 0, f"{name} rank {r}: the constructor planned nothing?"
            first, *later = rec["pushes"]
            assert first["planner_calls"] == 0, f"{name} rank {r}: the first push planned"
            for k, push in enumerate(later, 2):
                assert push["planner_calls"] == 0, f"{name} rank {r} push {k} planned"
                assert push["allocs"] == [] and push["alloc_bytes"] == 0, f"{name} rank {r} push {k}: {push}"
                assert push["workspace"] == first["workspace"], f"{name} rank {r} push {k}: workspace grew"


def test_colocated_trainer_and_tp4_engine_on_a_sub_group(job):
    recs = _phase(job, "colocated", range(J.WORLD))
    assert recs[0].get("skipped") and recs[1].get("skipped")
    sent, received = _expected_bytes(4, J.COLO, J.COLO)
    local = 0
    for r in J.COLO:
        _assert_engine_exact(recs[r]["checks"], r)
        st_ = recs[r]["pushes"][-1]["stats"]
        assert st_["received_bytes"] == received.get(r, 0) and st_["sent_bytes"] == sent.get(r, 0), f"rank {r}"
        local += st_["local_bytes"]
    assert local > 0  # what a rank holds in both layouts is a local cast-copy


def test_changed_dtype_or_shape_is_refused_on_every_rank(job):
    recs = _phase(job, "refusal", range(J.WORLD))
    for key, needles in (("dtype", ["rank 1", "model.layers.1.self_attn.q_proj.weight", "torch.bfloat16"]),
                         ("shape", ["rank 5", "model.layers.0.self_attn.qkv_proj.weight", "[33, 32]"])):
        msgs = set()
        for r, rec in recs.items():
            got = rec[key]
            assert got["raised"] == "ShardError", f"{key}: rank {r} raised {got['raised']}: {got.get('message')}"
            for s in needles:
                assert s in got["message"], f"{key}: rank {r}: {s!r} not in {got['message']!r}"
            msgs.add(got["message"])
        assert len(msgs) == 1, f"{key}: ranks raised different messages"
    for r, rec in recs.items():
        assert rec["after"]["raised"] is None, f"rank {r}: the sync did not survive a refusal: {rec['after']}"
    for r in J.ENGINE:
        assert recs[r]["check"]["errors"] == []


def test_bounded_rounds_fill_the_same_bits_and_disagreeing_plans_are_refused_everywhere(job):
    recs = _phase(job, "refusal", range(J.WORLD))
    msgs = set()
    for r, rec in recs.items():
        assert rec["bounded_same"], f"rank {r}: bounded rounds gave other bits"
        assert rec["bounded_rounds"] > 3 and rec["bounded_staging"] <= 4096 + 64, f"rank {r}: {rec}"
        got = rec["disagree"]
        assert got["raised"] == "PlanError" and "disagree on what moves between them" in got["message"], got
        msgs.add(got["message"])
    (msg,) = msgs
    assert "ranks 3 and 4" in msg and "ranks 3 and 5" in msg and msg.count("ranks 3 and 4") == 1


def test_a_rank_killed_mid_push_makes_every_other_rank_raise(job):
    recs = job["phases"].get("kill", {})
    survivors = [r for r in range(J.WORLD) if r != J.VICTIM]
    assert job["exitcodes"][J.VICTIM] == -9, job["exitcodes"]
    for r in survivors:
        assert r in recs, f"rank {r} did not finish the kill phase (hung {job['hung']})"
        rec = recs[r]
        assert rec["raised"] == "TransferError", f"rank {r}: {rec}"
        # a liveness bound (a hang would wait for the job's timeout), not a speed claim
        assert rec["seconds"] < J.PG_TIMEOUT_S + 30, f"rank {r} took {rec['seconds']:.1f} s"
        assert rec["again"]["raised"] == "TransferError" and "earlier push failed" in rec["again"]["message"]


def test_job_exited_cleanly(job):
    assert job["hung"] == []
    assert [c for r, c in enumerate(job["exitcodes"]) if r != J.VICTIM] == [0] * (J.WORLD - 1)


# -- a whole push in one process --------------------------------------------------------------------


def _run(src, tg, full, dtype=torch.bfloat16, limit=None, src_dtype=torch.float32):
    ranks = sorted({r for m in src.values() for r in m.ranks})
    sources = {r: {n: src[n].extract(full[n].to(src_dtype), r) for n in src if r in src[n].shards} for r in ranks}
    engine_ranks = sorted({r for t in tg.values() for r in t.shapes})
    into = {r: {n: torch.full(s, 5.0, dtype=dtype) for n, s in engine_shapes(tg, r).items()} for r in engine_ranks}
    progs = simulate(src, tg, dtype, sources, into, limit)
    for n, t in tg.items():
        for r in t.shapes:
            want = t.map.extract(full[n].to(src_dtype), r).reshape(-1).to(dtype)  # F * scale, then cast
            got = into[r][t.into].reshape(-1)[t.offsets[r]:t.offsets[r] + want.numel()]
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (n, r)
    return progs


@settings(max_examples=25, deadline=None)
@given(tp=st.sampled_from([1, 2, 4]), fsdp=st.integers(1, 4), limit=st.sampled_from([None, 64, 1000]),
       seed=st.integers(0, 1000))
def test_simulated_push_fsdp_to_vllm_is_exact_bits(tp, fsdp, limit, seed):
    """FSDP2 (``fully_shard``'s dim-0 chunks over ``fsdp`` ranks, uneven) into vLLM TP (on the next
    ranks), fp32 masters cast to bf16 on the way, bounded rounds or one."""
    from torch.distributed.tensor import Shard

    from reshard.execute.sources import dtensor_map

    _, shapes = J.source_maps(list(range(fsdp)))
    src = {n: dtensor_map(s, list(range(fsdp)), [Shard(0)]) for n, s in shapes.items()}
    tg = J.targets(shapes, tp, list(range(fsdp, fsdp + tp)))
    g = torch.Generator().manual_seed(seed)
    full = {n: torch.randn(s, generator=g) * 3 for n, s in shapes.items()}
    progs = _run(src, tg, full, limit=limit)
    if limit is not None:
        assert all(len(p.rounds) >= 1 for p in progs.values())


def test_prescaled_sources_are_scaled_then_cast():
    """A bias every source rank holds divided by 4 (scale 1/4) into a replicated target: the sender
    multiplies by 4 in fp32, then casts; and the reverse (a prescaled target)."""
    full = {"b": torch.randn(4096, generator=torch.Generator().manual_seed(3)) / 3}
    for s, t in ((L.prescaled_bias((4096,), 4), L.replicated((4096,), [4, 5])),
                 (L.replicated((4096,), 4), L.prescaled_bias((4096,), 2, ranks=[4, 5]))):
        progs = _run({"b": s}, {"b": placed(t, "b")}, full)
        assert sum(p.packed_bytes for p in progs.values()) > 0


def test_colocated_simulation_is_mostly_local_and_exact():
    _, shapes = J.source_maps([0, 1, 2, 3])
    from torch.distributed.tensor import Shard

    from reshard.execute.sources import dtensor_map

    src = {n: dtensor_map(s, [0, 1, 2, 3], [Shard(0)]) for n, s in shapes.items()}
    tg = J.targets(shapes, 4, [0, 1, 2, 3])
    full = {n: torch.randn(s) for n, s in shapes.items()}
    progs = _run(src, tg, full)
    assert all(p.local_bytes > 0 for p in progs.values())


def test_same_dtype_sources_are_sent_without_packing():
    """bf16 sources into bf16 targets, contiguous on both sides: straight from the source shard
    into the engine tensor (no staging at all); with fp32 sources every send is a cast."""
    shape = (1024, 1024)  # blocks of 512 KiB: large runs travel alone
    src = {"w": L.split(shape, 0, [512, 512])}
    tg = {"w": placed(L.split(shape, 0, [256] * 4, ranks=[2, 3, 4, 5]), "w")}
    full = {"w": torch.randn(shape)}
    same = _run(src, tg, full, src_dtype=torch.bfloat16)
    assert sum(p.packed_bytes + p.unpacked_bytes for p in same.values()) == 0
    cast = _run(src, tg, full)
    assert sum(p.packed_bytes for p in cast.values()) == sum(p.sent_bytes for p in cast.values()) > 0
    assert sum(p.unpacked_bytes for p in cast.values()) == 0


def test_placed_rejects_a_part_outside_its_engine_tensor():
    from reshard.errors import MapError

    m = L.split((4, 3), 0, [2, 2])
    with pytest.raises(MapError, match="does not fit"):
        Placed(m, "x", {0: (2, 3), 1: (2, 3)}, {0: 0, 1: 1})
