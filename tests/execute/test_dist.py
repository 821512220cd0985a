"""``reshard.execute.live.transfer`` in real gloo jobs: 4 spawned processes, no mocks.

One job runs every case in turn (spawning is the expensive part on a small machine). Each rank
plans locally, cuts its source shards from a full tensor drawn from a shared seed, calls
``transfer`` and compares its result bit for bit with ``target.extract(F, rank)``; it writes one
JSON line per case, and the tests below assert on those lines in the parent. A join timeout and
``kill`` bound the job, so a hang fails the tests instead of stalling them.
"""

from __future__ import annotations

import json
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from reshard import ParamMap
from reshard import layouts as L
from reshard.errors import PlanError, ShardError
from reshard.execute.schedule import MIN_DIRECT_BYTES, Item, messages, schedule
from reshard.ir import View, prod, row_major_strides
from reshard.ir.apply import view_of
from reshard.plan.planner import ModelPlan, plan, plan_for_rank, plan_model
from reshard.plan.values import Segment
from tests.support.irgen import (
    flat_map,
    fragment,
    grid_map,
    padded_vocab_map,
    random_tensor,
    replicated_map,
    segmented_map,
)
from tests.support.spawn import run_ranks

WORLD = 4
JOB_TIMEOUT_S = 120  # the whole job; normally ~10 s
PG_TIMEOUT_S = 30  # a stuck collective inside a worker errors out after this
ERROR_WITHIN_S = 10  # a bad shard must be reported this fast on every rank


# -- layouts (built identically in every process) ------------------------------------------------


def _tp2xdp2(m: ParamMap) -> ParamMap:
    """A TP=2 map on ranks 0, 1 replicated over DP=2: global rank = dp * 2 + tp."""
    return L.replicate_over(m, {0: [0, 2], 1: [1, 3]})


def llama_maps(tp: int, *, layers: int = 2, hidden: int = 16, kv: int = 8, inter: int = 24,
               vocab: int = 40) -> dict[str, ParamMap]:
    """A toy Llama over TP ranks 0..tp-1: fused QKV and gate/up as sub-parameters, o_proj and
    down split on columns, replicated norms, vocabulary-split embedding and head."""
    maps = {"embed.weight": L.vocab_parallel((vocab, hidden), L.even_sizes(vocab, tp)),
            "norm.weight": L.replicated((hidden,), tp),
            "lm_head.weight": L.split((vocab, hidden), 0, L.even_sizes(vocab, tp)),
            "token_ids": L.split((vocab,), 0, L.even_sizes(vocab, tp))}
    qkv = [hidden, kv, kv]
    for i in range(layers):
        p = f"layers.{i}."
        maps[p + "attn.qkv.weight"] = L.sub_params((sum(qkv), hidden), qkv, [L.even_sizes(s, tp) for s in qkv])
        maps[p + "attn.o_proj.weight"] = L.split((hidden, hidden), 1, L.even_sizes(hidden, tp))
        maps[p + "mlp.gate_up.weight"] = L.sub_params((2 * inter, hidden), [inter, inter],
                                                      [L.even_sizes(inter, tp)] * 2)
        maps[p + "mlp.down.weight"] = L.split((hidden, inter), 1, L.even_sizes(inter, tp))
        maps[p + "input_norm.weight"] = L.replicated((hidden,), tp)
    return maps


def llama_dtype(name: str) -> torch.dtype:
    """Mixed element sizes in one call (8, 4, 2 bytes and an integer tensor)."""
    if name == "token_ids":
        return torch.int64
    if name.startswith("embed"):
        return torch.float64
    return torch.float32 if "norm" in name else torch.bfloat16


def llama_pair() -> tuple[dict[str, ParamMap], dict[str, ParamMap]]:
    return llama_maps(4), {n: _tp2xdp2(m) for n, m in llama_maps(2).items()}


BIGCODE = (48, 16)  # 32 query rows, then one 8-row key and one 8-row value head
YUAN = (16, 32)  # o_proj: 8 heads of 4 columns
ZERO_SHAPES = [(10, 6), (7,), (5, 3), (1,)]


# -- per-rank helpers --------------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype.is_floating_point:
        return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def _fulls(maps: dict[str, ParamMap], dtype_of, seed: int) -> dict[str, torch.Tensor]:
    return {n: random_tensor(maps[n].valid_shape, dtype_of(n), seed + i) for i, n in enumerate(sorted(maps))}


def _compare(name: str, got, want: torch.Tensor | None) -> list[str]:
    if want is None:
        return [] if got is None else [f"{name}: got a shard, expected none"]
    if got is None:
        return [f"{name}: got nothing, expected {list(want.shape)}"]
    if got.dtype != want.dtype or got.shape != want.shape:
        return [f"{name}: got {got.dtype} {list(got.shape)}, expected {want.dtype} {list(want.shape)}"]
    if not torch.equal(_bits(got), _bits(want)):
        return [f"{name}: data differs"]
    return []


def _run_model(rank: int, src: dict[str, ParamMap], tgt: dict[str, ParamMap], dtype_of, *, seed: int,
               scale_power: int = 1, group=None, per_rank: bool = False, **kw) -> dict:
    """Transfer a ModelPlan (the whole world's, or with ``per_rank`` this rank's alone); report
    mismatches and byte counts against the global plan's."""
    mplan = plan_for_rank(src, tgt, rank) if per_rank else plan_model(src, tgt)
    fulls = _fulls(src, dtype_of, seed)
    local = {n: m.extract(fulls[n], rank, scale_power) for n, m in src.items() if rank in m.shards}
    stats: dict = {}
    out = dist_transfer(mplan, local, group, scale_power=scale_power, stats=stats, **kw)
    errors = [] if set(out) == {n for n, m in tgt.items() if rank in m.shards} else [f"keys {sorted(out)}"]
    for n, m in tgt.items():
        want = m.extract(fulls[n], rank, scale_power) if rank in m.shards else None
        errors += _compare(n, out.get(n), want)
    es = {n: torch.empty((), dtype=dtype_of(n)).element_size() for n in src}
    ps = plan_model(src, tgt).stats(es)
    return {"errors": errors, "stats": stats, "plan_sent": ps.sent.get(rank, 0),
            "plan_received": ps.received.get(rank, 0), "plan_remote": ps.remote_bytes}


def _run_single(rank: int, src: ParamMap, tgt: ParamMap, dtype: torch.dtype, *, seed: int, **kw) -> dict:
    p = plan(src, tgt)
    full = random_tensor(src.valid_shape, dtype, seed)
    stats: dict = {}
    out = dist_transfer(p, src.extract(full, rank) if rank in src.shards else None, stats=stats, **kw)
    want = tgt.extract(full, rank) if rank in tgt.shards else None
    ps = p.stats(full.element_size())
    return {"errors": _compare("param", out, want), "stats": stats, "plan_sent": ps.sent.get(rank, 0),
            "plan_received": ps.received.get(rank, 0), "plan_remote": ps.remote_bytes}


def dist_transfer(*args, **kw):
    from reshard.execute.live import transfer

    return transfer(*args, **kw)


def _expect_error(fn) -> dict:
    """Run a call that must fail; report the exception type and message."""
    t = time.perf_counter()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the type is the result
        return {"raised": type(e).__name__, "message": str(e), "seconds": time.perf_counter() - t}
    return {"raised": None, "seconds": time.perf_counter() - t}


# -- cases ---------------------------------------------------------------------------------------


def case_llama(rank: int) -> dict:
    src, tgt = llama_pair()
    return _run_model(rank, src, tgt, llama_dtype, seed=1)


def case_llama_rounds(rank: int) -> dict:
    src, tgt = llama_pair()
    return _run_model(rank, src, tgt, llama_dtype, seed=2, max_inflight_bytes=200)


def case_workspace(rank: int) -> dict:
    """Two calls share one Workspace: the second reuses the first's staging memory."""
    from reshard.execute.live import Workspace

    src, tgt = llama_pair()
    ws = Workspace()
    first = _run_model(rank, src, tgt, llama_dtype, seed=14, workspace=ws)
    size = ws.nbytes
    second = _run_model(rank, src, tgt, llama_dtype, seed=15, workspace=ws)
    return {**second, "errors": first["errors"] + second["errors"], "ws_after_first": size,
            "ws_after_second": ws.nbytes}


def case_bigcode(rank: int) -> dict:
    return _run_single(rank, L.bigcode_mqa(BIGCODE, 4, n_embd=32), L.bigcode_mqa(BIGCODE, 2, n_embd=32),
                       torch.bfloat16, seed=3)


def case_yuan(rank: int) -> dict:
    return _run_single(rank, L.shared_qk_o_proj(YUAN, 2, num_heads=8), L.shared_qk_o_proj(YUAN, 4, num_heads=8),
                       torch.float32, seed=4)


def _zero(dp: int) -> dict[str, ParamMap]:
    return {f"p{i}": m for i, m in enumerate(L.zero12_group(ZERO_SHAPES, dp, shard="fragment"))}


def case_zero(rank: int) -> dict:
    return _run_model(rank, _zero(2), _zero(4), lambda n: torch.float32, seed=5)


def _two_to_four() -> tuple[dict[str, ParamMap], dict[str, ParamMap]]:
    src = {"grid": L.split((12, 10), 1, [3, 7]), "vocab": L.padded_vocab((30, 8), 2)}
    tgt = {"grid": grid_map((12, 10), {0: [5, 7], 1: [4, 6]}), "vocab": L.padded_vocab((30, 8), 4)}
    return src, tgt


def case_two_to_four(rank: int) -> dict:
    src, tgt = _two_to_four()
    return _run_model(rank, src, tgt, lambda n: torch.float32, seed=6)


def _scaled_pair() -> tuple[dict[str, ParamMap], dict[str, ParamMap]]:
    src = {"o_proj.bias": L.shared_qk_o_proj_bias((24,), 2), "conv.bias": L.prescaled_bias((12,), 4)}
    tgt = {"o_proj.bias": L.shared_qk_o_proj_bias((24,), 4), "conv.bias": L.split((12,), 0, [3, 3, 3, 3])}
    return src, tgt


def case_scaled(rank: int) -> dict:
    src, tgt = _scaled_pair()
    return _run_model(rank, src, tgt, lambda n: torch.float32, seed=7, scale_power=-1)


def case_irregular(rank: int) -> dict:
    """Hand-built maps (tests/irgen): uneven grids, flat ranges across rows, scaled replicated
    segments, partial replication, fragmented pieces, padded vocabularies."""
    src = {"a": grid_map((7, 9), {0: [3, 4], 1: [5, 4]}),
           "b": segmented_map((6, 10), 1, [(4, False), (6, True)], 4, scale_replicated=0.5),
           "c": replicated_map((5, 3), 3),
           "d": padded_vocab_map(13, 4, 4)}
    tgt = {"a": flat_map((7, 9), [0, 10, 40, 41, 63]),
           "b": grid_map((6, 10), {1: [1, 2, 3, 4]}),
           "c": fragment(grid_map((5, 3), {0: [2, 3]}), [1]),
           "d": padded_vocab_map(13, 4, 2)}
    return _run_model(rank, src, tgt, lambda n: torch.float64, seed=16)


def case_group(rank: int) -> dict:
    """Plan ranks are ranks of the group: plan ranks 0, 1, 2 are global ranks 1, 2, 3."""
    import torch.distributed as dist

    group = dist.new_group([1, 2, 3])  # every rank takes part in creating it
    if rank == 0:
        return {"errors": [], "stats": {}, "plan_sent": 0, "plan_received": 0, "plan_remote": 0, "skipped": True}
    src = {"w": L.split((9, 4), 0, [4, 5])}
    tgt = {"w": L.split((9, 4), 0, [3, 3, 3])}
    return _run_model(rank - 1, src, tgt, lambda n: torch.float32, seed=8, group=group)


def case_bad_shape(rank: int) -> dict:
    src, tgt = llama_pair()
    mplan = plan_model(src, tgt)
    fulls = _fulls(src, llama_dtype, 9)
    local = {n: m.extract(fulls[n], rank) for n, m in src.items()}
    if rank == 2:  # the planted fault: one shard transposed on one rank
        local["layers.1.attn.o_proj.weight"] = local["layers.1.attn.o_proj.weight"].t().contiguous()
    return _expect_error(lambda: dist_transfer(mplan, local))


def case_bad_dtype(rank: int) -> dict:
    src, tgt = L.bigcode_mqa(BIGCODE, 4, n_embd=32), L.bigcode_mqa(BIGCODE, 2, n_embd=32)
    full = random_tensor(BIGCODE, torch.float32, 10)
    shard = src.extract(full, rank)
    if rank == 1:
        shard = shard.double()
    return _expect_error(lambda: dist_transfer(plan(src, tgt), shard))


def case_missing(rank: int) -> dict:
    src, tgt = L.bigcode_mqa(BIGCODE, 4, n_embd=32), L.bigcode_mqa(BIGCODE, 2, n_embd=32)
    full = random_tensor(BIGCODE, torch.float32, 11)
    shard = None if rank == 3 else src.extract(full, rank)
    return _expect_error(lambda: dist_transfer(plan(src, tgt), shard))


def case_plans_differ(rank: int) -> dict:
    src, tgt = L.bigcode_mqa(BIGCODE, 4, n_embd=32), L.bigcode_mqa(BIGCODE, 2, n_embd=32)
    full = random_tensor(BIGCODE, torch.float32, 12)
    limit = 64 if rank == 0 else None
    return _expect_error(lambda: dist_transfer(plan(src, tgt), src.extract(full, rank), max_inflight_bytes=limit))


def case_per_rank(rank: int) -> dict:
    """Each rank plans only what it sends and receives (``plan_for_rank``) and moves that."""
    src, tgt = llama_pair()
    return _run_model(rank, src, tgt, llama_dtype, seed=21, per_rank=True)


def case_per_rank_rounds(rank: int) -> dict:
    src, tgt = llama_pair()
    return _run_model(rank, src, tgt, llama_dtype, seed=22, per_rank=True, max_inflight_bytes=256)


def case_per_rank_disagree(rank: int) -> dict:
    """Rank 3 plans towards another target for the head (rows 10.. instead of 20..): what it
    expects from ranks 1 and 2 differs from what they plan to send."""
    src, tgt = llama_pair()
    if rank == 3:
        tgt = {**tgt, "lm_head.weight": _tp2xdp2(L.split((40, 16), 0, [10, 30]))}
    fulls = _fulls(src, llama_dtype, 23)
    local = {n: m.extract(fulls[n], rank) for n, m in src.items() if rank in m.shards}
    return _expect_error(lambda: dist_transfer(plan_for_rank(src, tgt, rank), local))


def case_per_rank_foreign(rank: int) -> dict:
    """Rank 1 is handed rank 0's plan."""
    src, tgt = llama_pair()
    fulls = _fulls(src, llama_dtype, 24)
    local = {n: m.extract(fulls[n], rank) for n, m in src.items() if rank in m.shards}
    return _expect_error(lambda: dist_transfer(plan_for_rank(src, tgt, 0 if rank == 1 else rank), local))


def _uniform(num_experts: int, ep: int) -> dict:
    local = num_experts // ep
    return {"version": 1, "num_experts": num_experts, "ep_size": ep,
            "ranks": [{"rank": e, "experts": list(range(e * local, (e + 1) * local))} for e in range(ep)]}


def _expert_maps(ep: int) -> dict[str, ParamMap]:
    """AutoEP expert parameters at EP ``ep`` over 4 ranks, each EP rank's experts cut by ZeRO over
    its expert-data-parallel group (EDP = 4 / ep; EP rank of global rank d is d % ep), as
    ``formats/deepspeed/layout.py`` composes them; plus one dense parameter flat over all 4."""
    from reshard.layouts.topology import Topology

    edp = WORLD // ep
    shapes = {"w1": (8, 6, 5), "w2": (8, 5, 6), "w3": (8, 6, 5)}
    out = {}
    for name, shape in shapes.items():
        m = L.autoep_placement(_uniform(8, ep), shape)
        zero = L.zero12_group([m.shard(0).shape], edp, shard="fragment")[0]
        comp = L.compose_zero(m, dict.fromkeys(m.ranks, zero), Topology(1, edp, ep))
        out[name] = comp.with_ranks({k * ep + e: e + k * ep for e in m.ranks for k in range(edp)})
    out["dense"] = L.zero12_group([(7, 3)], WORLD, shard="fragment")[0]
    return out


def case_experts(rank: int) -> dict:
    """Expert parameters (placement composed with EDP ZeRO) from EP 4 to EP 2 x EDP 2: the
    live transfer takes them as any other map."""
    return _run_model(rank, _expert_maps(4), _expert_maps(2), lambda n: torch.float32, seed=25)


def case_int_scaled(rank: int) -> dict:
    src, tgt = L.replicated((6,), 4), L.prescaled_bias((6,), 4)
    return _expect_error(lambda: dist_transfer(plan(src, tgt), torch.arange(6)))


def case_limit_too_small(rank: int) -> dict:
    src, tgt = L.bigcode_mqa(BIGCODE, 4, n_embd=32), L.bigcode_mqa(BIGCODE, 2, n_embd=32)
    full = random_tensor(BIGCODE, torch.float32, 17)
    return _expect_error(lambda: dist_transfer(plan(src, tgt), src.extract(full, rank), max_inflight_bytes=2))


def case_ranks_outside_group(rank: int) -> dict:
    src, tgt = L.split((12, 4), 0, [2] * 6), L.split((12, 4), 0, [3] * 4)  # source ranks 4, 5 do not exist
    full = random_tensor((12, 4), torch.float32, 18)
    return _expect_error(lambda: dist_transfer(plan(src, tgt), src.extract(full, rank)))


def case_shards_not_a_dict(rank: int) -> dict:
    src, tgt = llama_pair()
    fulls = _fulls(src, llama_dtype, 19)
    local = {n: m.extract(fulls[n], rank) for n, m in src.items()}
    passed = list(local.values()) if rank == 1 else local  # the planted fault: a list on one rank
    return _expect_error(lambda: dist_transfer(plan_model(src, tgt), passed))


def case_after_errors(rank: int) -> dict:
    """The group stays usable after every rank raised."""
    src, tgt = llama_pair()
    return _run_model(rank, src, tgt, llama_dtype, seed=13, max_inflight_bytes=4096)


def _direct_pair(n: int = 1024, bias: int = 1 << 18) -> tuple[dict[str, ParamMap], dict[str, ParamMap]]:
    """Parameters large enough for messages that skip staging: rows -> columns (received straight
    into the target, packed by the sender), columns -> rows (sent straight from the source,
    unpacked by the receiver), fused sub-parameters (runs contiguous on both sides), a
    pre-scaled bias received by ranks that hold none (scaled: always unpacked), and a small
    parameter that rides in the packed message."""
    src = {"rows": L.split((n, n), 0, [n // 4] * 4), "cols": L.split((n, n), 1, [n // 4] * 4),
           "fused": L.sub_params((2 * n, n // 2), [n, n], [[n // 4] * 4] * 2),
           "bias": L.prescaled_bias((bias,), 2), "small": L.split((64, 8), 0, [16] * 4)}
    tgt = {"rows": _tp2xdp2(L.split((n, n), 1, [n // 2] * 2)), "cols": L.split((n, n), 0, [n // 4] * 4),
           "fused": _tp2xdp2(L.sub_params((2 * n, n // 2), [n, n], [[n // 2] * 2] * 2)),
           "bias": L.split((bias,), 0, [bias // 4] * 4), "small": _tp2xdp2(L.split((64, 8), 1, [4, 4]))}
    return src, tgt


def direct_dtype(name: str) -> torch.dtype:
    return torch.bfloat16 if name == "fused" else torch.float32


def case_direct(rank: int) -> dict:
    src, tgt = _direct_pair()
    return _run_model(rank, src, tgt, direct_dtype, seed=20, scale_power=-1)


DIRECT_LIMIT = 300_000  # rounds that cut the large runs at element boundaries


def case_direct_rounds(rank: int) -> dict:
    src, tgt = _direct_pair()
    return _run_model(rank, src, tgt, direct_dtype, seed=21, scale_power=-1, max_inflight_bytes=DIRECT_LIMIT)


def _run_out(rank: int, src, tgt, dtype_of, *, seed: int, skip: str) -> dict:
    """Like ``_run_model``, into ``out`` tensors prefilled with garbage (all but ``skip``)."""
    mplan = plan_model(src, tgt)
    fulls = _fulls(src, dtype_of, seed)
    local = {n: m.extract(fulls[n], rank) for n, m in src.items() if rank in m.shards}
    given = {n: torch.full(m.shard(rank).shape, 7, dtype=dtype_of(n)) for n, m in tgt.items()
             if rank in m.shards and n != skip}
    stats: dict = {}
    out = dist_transfer(mplan, local, stats=stats, out=given)
    errors = [f"{n}: not the given tensor" for n in given if out.get(n) is not given[n]]
    for n, m in tgt.items():
        errors += _compare(n, out.get(n), m.extract(fulls[n], rank) if rank in m.shards else None)
    es = {n: torch.empty((), dtype=dtype_of(n)).element_size() for n in src}
    ps = plan_model(src, tgt).stats(es)
    return {"errors": errors, "stats": stats, "plan_sent": ps.sent.get(rank, 0),
            "plan_received": ps.received.get(rank, 0), "plan_remote": ps.remote_bytes}


def case_out(rank: int) -> dict:
    src, tgt = _direct_pair()
    return _run_out(rank, src, tgt, direct_dtype, seed=22, skip="small")


def case_out_padded(rank: int) -> dict:
    """Padding of the given tensors is zeroed; ranks 2 and 3 hold no source (dtype from out)."""
    src, tgt = _two_to_four()
    return _run_out(rank, src, tgt, lambda n: torch.float32, seed=23, skip="")


def case_bad_out_shape(rank: int) -> dict:
    src, tgt = _direct_pair()
    fulls = _fulls(src, direct_dtype, 24)
    local = {n: m.extract(fulls[n], rank) for n, m in src.items() if rank in m.shards}
    given = {"cols": torch.empty(512, 512) if rank == 2 else torch.empty(256, 1024)}
    return _expect_error(lambda: dist_transfer(plan_model(src, tgt), local, out=given))


def case_bad_out_dtype(rank: int) -> dict:
    """Rank 3 holds no source shard; its ``out`` alone disagrees on the dtype."""
    src, tgt = _two_to_four()
    fulls = _fulls(src, lambda n: torch.float32, 25)
    local = {n: m.extract(fulls[n], rank) for n, m in src.items() if rank in m.shards}
    given = {"grid": torch.empty(tgt["grid"].shard(rank).shape, dtype=torch.float64 if rank == 3 else torch.float32)}
    return _expect_error(lambda: dist_transfer(plan_model(src, tgt), local, out=given))


CASES = [case_llama, case_llama_rounds, case_workspace, case_bigcode, case_yuan, case_zero, case_two_to_four, case_scaled,
         case_irregular, case_group, case_bad_shape, case_bad_dtype, case_missing, case_plans_differ, case_int_scaled,
         case_limit_too_small, case_ranks_outside_group, case_shards_not_a_dict, case_after_errors, case_direct,
         case_direct_rounds, case_out, case_out_padded, case_bad_out_shape, case_bad_out_dtype, case_per_rank,
         case_per_rank_rounds, case_per_rank_disagree, case_per_rank_foreign, case_experts]


def _worker(rank: int, workdir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=PG_TIMEOUT_S))
    with open(Path(workdir) / f"rank{rank}.jsonl", "w") as log:
        for case in CASES:
            try:
                rec = case(rank)
            except Exception:  # noqa: BLE001 - reported to the parent, which fails the test
                rec = {"crashed": traceback.format_exc()}
            log.write(json.dumps({"case": case.__name__, **rec}) + "\n")
            log.flush()
    dist.destroy_process_group()


# -- the job and its assertions ------------------------------------------------------------------


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict:
    job = run_ranks(_worker, WORLD, tmp_path_factory.mktemp("dist"), JOB_TIMEOUT_S, "case")
    return {"cases": job.pop("records"), **job}


def _records(job: dict, case) -> dict[int, dict]:
    recs = job["cases"].get(case.__name__, {})
    missing = [r for r in range(WORLD) if r not in recs]
    assert not missing, f"ranks {missing} did not finish {case.__name__} (hung: {job['hung']}, exit codes {job['exitcodes']})"
    crashed = {r: rec["crashed"] for r, rec in recs.items() if "crashed" in rec}
    assert not crashed, f"{case.__name__} crashed: {crashed}"
    return recs


def _assert_exact(job: dict, case) -> dict[int, dict]:
    recs = _records(job, case)
    for r, rec in recs.items():
        assert rec["errors"] == [], f"rank {r}: {rec['errors']}"
        st = rec["stats"]
        if rec.get("skipped"):
            continue
        assert st["sent_bytes"] == rec["plan_sent"], f"rank {r} sent {st['sent_bytes']}, plan {rec['plan_sent']}"
        assert st["received_bytes"] == rec["plan_received"], f"rank {r}"
    wire = sum(rec["stats"].get("sent_bytes", 0) for rec in recs.values())
    remote = {rec["plan_remote"] for rec in recs.values() if not rec.get("skipped")}
    assert remote == {wire}, f"{wire} bytes on the wire, plan remote {remote}"
    return recs


def test_llama_tp4_to_tp2_dp2_model_plan_in_one_call(job):
    recs = _assert_exact(job, case_llama)
    assert all(rec["stats"]["rounds"] == 1 for rec in recs.values())
    # one message per peer: rank 1 (TP2 rank 1) gets TP4 shards 2 and 3, from two peers
    assert recs[1]["stats"]["messages_received"] == 2
    assert recs[0]["stats"]["messages_received"] == 1
    # TP4 ranks 1 and 2 send the same bytes to both replicas of their TP2 shard: packed once
    for r in (1, 2):
        assert recs[r]["stats"]["messages_sent"] == 2
        assert 2 * recs[r]["stats"]["packed_bytes"] == recs[r]["stats"]["sent_bytes"] > 0
    for r in (0, 3):
        assert recs[r]["stats"]["packed_bytes"] == recs[r]["stats"]["sent_bytes"] > 0


def test_max_inflight_bytes_forces_rounds_and_bounds_staging(job):
    recs = _assert_exact(job, case_llama_rounds)
    assert len({rec["stats"]["rounds"] for rec in recs.values()}) == 1
    assert recs[0]["stats"]["rounds"] > 5
    assert all(rec["stats"]["peak_staged_bytes"] <= 200 for rec in recs.values())


def test_workspace_is_reused_across_calls(job):
    recs = _assert_exact(job, case_workspace)
    for rec in recs.values():
        assert rec["ws_after_first"] == rec["ws_after_second"] >= rec["stats"]["peak_staged_bytes"] > 0


def test_bigcode_mqa_tp4_to_tp2(job):
    _assert_exact(job, case_bigcode)


def test_yuan_o_proj_tp2_to_tp4(job):
    recs = _assert_exact(job, case_yuan)
    assert recs[2]["stats"]["sent_bytes"] == 0 and recs[2]["stats"]["received_bytes"] > 0


def test_zero_flat_dp2_to_dp4(job):
    _assert_exact(job, case_zero)


def test_two_sources_to_four_targets_with_padding(job):
    recs = _assert_exact(job, case_two_to_four)
    assert recs[3]["stats"]["sent_bytes"] == 0 and recs[2]["stats"]["sent_bytes"] == 0


def test_prescaled_bias_with_scale_power_minus_one(job):
    _assert_exact(job, case_scaled)


def test_irregular_layouts(job):
    _assert_exact(job, case_irregular)


def test_plan_ranks_are_group_ranks(job):
    recs = _assert_exact(job, case_group)
    assert recs[0].get("skipped")


def _assert_all_raise(job, case, error: type, *needles: str) -> list[str]:
    recs = _records(job, case)
    msgs = []
    for r, rec in recs.items():
        assert rec["raised"] == error.__name__, f"rank {r}: raised {rec['raised']}: {rec.get('message')}"
        assert rec["seconds"] < ERROR_WITHIN_S, f"rank {r} took {rec['seconds']:.1f} s to raise"
        for s in needles:
            assert s in rec["message"], f"rank {r}: {s!r} not in {rec['message']!r}"
        msgs.append(rec["message"])
    assert len(set(msgs)) == 1, "ranks raised different messages"
    return msgs


def test_planted_shape_mismatch_raises_on_every_rank(job):
    (msg, *_) = _assert_all_raise(job, case_bad_shape, ShardError, "rank 2", "layers.1.attn.o_proj.weight",
                                  "[4, 16]", "[16, 4]")
    assert "rank 0" not in msg and "rank 1 " not in msg


def test_dtype_disagreement_raises_on_every_rank(job):
    _assert_all_raise(job, case_bad_dtype, ShardError, "[1] hold torch.float64", "dtype")


def test_missing_shard_raises_on_every_rank(job):
    _assert_all_raise(job, case_missing, ShardError, "rank 3 passed no source shard")


def test_different_options_raise_plan_error_on_every_rank(job):
    _assert_all_raise(job, case_plans_differ, PlanError, "ranks [1, 2, 3] differ from rank 0")


def test_per_rank_plans_move_exactly_what_the_global_plan_moves(job):
    """``plan_for_rank`` on every rank, then ``transfer``: the same target shards, bit for bit, and
    the same bytes on the wire as the global plan; with a byte bound, several rounds."""
    _assert_exact(job, case_per_rank)
    recs = _assert_exact(job, case_per_rank_rounds)
    assert max(rec["stats"]["rounds"] for rec in recs.values()) > 1
    assert all(rec["stats"]["peak_staged_bytes"] <= 256 for rec in recs.values())


def test_expert_placement_composed_with_edp_zero_moves_live(job):
    _assert_exact(job, case_experts)


def test_per_rank_plans_that_disagree_raise_plan_error_on_every_rank(job):
    (msg, *_) = _assert_all_raise(job, case_per_rank_disagree, PlanError, "disagree on what moves between them")
    assert "ranks 1 and 3" in msg and "ranks 0 and 1" not in msg
    _assert_all_raise(job, case_per_rank_foreign, PlanError, "rank 1 holds a plan made for rank(s) [0]")


def test_scaling_an_integer_dtype_raises_on_every_rank(job):
    _assert_all_raise(job, case_int_scaled, ShardError, "integer dtype torch.int64")


def test_too_small_max_inflight_bytes_raises_plan_error_on_every_rank(job):
    _assert_all_raise(job, case_limit_too_small, PlanError,
                      "max_inflight_bytes=2 cannot hold one element (4 bytes)")


def test_plan_ranks_outside_the_group_raise_plan_error_on_every_rank(job):
    _assert_all_raise(job, case_ranks_outside_group, PlanError, "plan ranks [4, 5], outside the group of 4")


def test_local_shards_not_a_dict_raise_shard_error_on_every_rank(job):
    _assert_all_raise(job, case_shards_not_a_dict, ShardError, "rank 1 passed local_shards as a list")


def test_group_still_works_after_errors(job):
    _assert_exact(job, case_after_errors)


def _wire_counts(src, tgt, dtype_of, scale_power: int, limit: int | None) -> dict[int, dict[str, int]]:
    """Per rank, the messages and staging copies the wire protocol implies for this plan: what
    ``transfer`` must report in ``stats``."""
    named = sorted(plan_model(src, tgt).params.items())
    esizes = [torch.empty((), dtype=dtype_of(n)).element_size() for n, _ in named]
    want = {r: dict.fromkeys(["messages_sent", "messages_received", "packed_bytes", "unpacked_bytes"], 0)
            for r in range(WORLD)}
    for rnd in schedule([(p, e) for (_, p), e in zip(named, esizes)], limit):
        packed: set = set()  # a sender packs equal content once per round
        for (s, d), msgs in messages(rnd, esizes, scale_power).items():
            for m in msgs:
                want[s]["messages_sent"] += 1
                want[d]["messages_received"] += 1
                want[d]["unpacked_bytes"] += 0 if m.into_target else m.nbytes
                key = (s, tuple((p.param, p.shape, p.src) for p in m.parts))
                if not m.from_source and key not in packed:
                    packed.add(key)
                    want[s]["packed_bytes"] += m.nbytes
    return want


def _assert_wire(recs: dict[int, dict], want: dict[int, dict[str, int]]) -> None:
    for r, rec in recs.items():
        got = {k: rec["stats"][k] for k in want[r]}
        assert got == want[r], f"rank {r}: {got} != {want[r]}"


def test_direct_messages_skip_staging(job):
    recs = _assert_exact(job, case_direct)
    src, tgt = _direct_pair()
    _assert_wire(recs, _wire_counts(src, tgt, direct_dtype, -1, None))
    assert all(rec["stats"]["rounds"] == 1 for rec in recs.values())
    # most bytes skip one staging copy or both
    assert sum(rec["stats"]["packed_bytes"] for rec in recs.values()) < sum(rec["plan_sent"] for rec in recs.values()) / 2
    assert sum(rec["stats"]["unpacked_bytes"] for rec in recs.values()) < sum(rec["plan_sent"] for rec in recs.values())


def test_direct_messages_in_bounded_rounds(job):
    recs = _assert_exact(job, case_direct_rounds)
    src, tgt = _direct_pair()
    _assert_wire(recs, _wire_counts(src, tgt, direct_dtype, -1, DIRECT_LIMIT))
    assert recs[0]["stats"]["rounds"] > 3
    assert all(rec["stats"]["peak_staged_bytes"] <= DIRECT_LIMIT for rec in recs.values())


def test_out_tensors_are_filled_and_returned(job):
    _assert_exact(job, case_out)
    _assert_exact(job, case_out_padded)


def test_out_of_the_wrong_shape_raises_on_every_rank(job):
    _assert_all_raise(job, case_bad_out_shape, ShardError, "parameter 'cols': rank 2 out is [512, 512]",
                      "contiguous [256, 1024]")


def test_out_of_another_dtype_raises_on_every_rank(job):
    _assert_all_raise(job, case_bad_out_dtype, ShardError, "parameter 'grid'", "[3] hold torch.float64")


def test_job_exited_cleanly(job):
    assert job["hung"] == [] and job["exitcodes"] == [0] * WORLD


# -- the schedule, without processes -------------------------------------------------------------


def _coverage(rounds) -> dict:
    got: dict = {}
    for rnd in rounds:
        for items in rnd.values():
            for it in items:
                got.setdefault((it.param, it.seg), []).append((it.lo, it.hi))
    return got


@pytest.mark.parametrize("limit", [None, 8, 30, 200, 10**6])
def test_schedule_covers_each_remote_segment_once_within_the_limit(limit):
    src, tgt = llama_pair()
    mplan: ModelPlan = plan_model(src, tgt)
    params = [(p, torch.empty((), dtype=llama_dtype(n)).element_size())
              for n, p in sorted(mplan.params.items())]
    rounds = schedule(params, limit)
    for rnd in rounds:
        load: dict[int, int] = {}
        for (s, d), items in rnd.items():
            sizes = [params[it.param][1] for it in items]
            assert sizes == sorted(sizes, reverse=True)  # aligned without padding
            for it in items:
                assert it.seg.src_rank == s and it.seg.dst_rank == d and not it.seg.is_local
                load[s] = load.get(s, 0) + it.numel * params[it.param][1]
                load[d] = load.get(d, 0) + it.numel * params[it.param][1]
        if limit is not None:
            assert max(load.values()) <= limit
    remote = {(k, s) for k, (p, _) in enumerate(params) for s in p.segments if not s.is_local}
    cover = _coverage(rounds)
    assert set(cover) == remote
    for (_, seg), ranges in cover.items():
        ranges.sort()
        assert ranges[0][0] == 0 and ranges[-1][1] == seg.numel
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


@pytest.mark.parametrize("limit", [0, 3, 7.5, "64"])
def test_schedule_refuses_a_limit_that_cannot_hold_one_element(limit):
    src, tgt = llama_pair()
    params = [(p, 8) for _, p in sorted(plan_model(src, tgt).params.items())]
    with pytest.raises(PlanError, match="max_inflight_bytes"):
        schedule(params, limit)
    assert schedule(params, 8)


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (4, 1, 3, 2)])
def test_index_ranges_decompose_into_ordered_boxes(shape):
    """An item's views are its index range ``[lo, hi)`` as at most ``2·ndim − 1`` boxes, in
    row-major order, on a row-major side and on a strided one (a transposed, offset layout)."""
    n = prod(shape)
    row_major = View(0, row_major_strides(shape))
    space = torch.arange(3 + 2 * n)
    strided = View(3, tuple(2 * s for s in reversed(row_major_strides(tuple(reversed(shape))))))
    seg = Segment(0, row_major, 1, strided, shape)
    for lo in range(n):
        for hi in range(lo + 1, n + 1):
            item = Item(0, seg, lo, hi)
            boxes = item.views(seg.src)
            assert len(boxes) <= 2 * len(shape) - 1
            flat = []
            for ext, v in boxes:
                flat += view_of(torch.arange(n), ext, v).reshape(-1).tolist()
            assert flat == list(range(lo, hi)), (lo, hi, boxes)
            on_dst = [x for ext, v in item.views(seg.dst)
                      for x in view_of(space, ext, v).reshape(-1).tolist()]
            assert on_dst == view_of(space, shape, strided).reshape(-1)[lo:hi].tolist(), (lo, hi)



def _addresses(shape: tuple[int, ...], view: View) -> list[int]:
    return view_of(torch.arange(view.span(shape)[1]), shape, view).reshape(-1).tolist()


def _elements(param: int, shape: tuple[int, ...], src: View, dst: View) -> list[tuple[int, int, int]]:
    return [(param, a, b) for a, b in zip(_addresses(shape, src), _addresses(shape, dst))]


@pytest.mark.parametrize("limit", [None, 200])
@pytest.mark.parametrize("pair", ["llama", "direct"])
def test_messages_carry_each_element_once_and_skip_staging_only_where_contiguous(pair, limit):
    src, tgt = llama_pair() if pair == "llama" else _direct_pair(16, 64)
    dtype_of = llama_dtype if pair == "llama" else direct_dtype
    named = sorted(plan_model(src, tgt).params.items())
    esizes = [torch.empty((), dtype=dtype_of(n)).element_size() for n, _ in named]
    rounds = schedule([(p, e) for (_, p), e in zip(named, esizes)], limit)
    kinds: set = set()
    for min_bytes in (1, 16, 64, 256, MIN_DIRECT_BYTES):
        for rnd in rounds:
            for link, msgs in messages(rnd, esizes, -1, min_bytes).items():
                kinds |= _check_link(rnd[link], msgs, esizes, min_bytes)
        if min_bytes == MIN_DIRECT_BYTES:  # toy sizes: one packed message per link
            assert all(len(msgs) == 1 for rnd in rounds for msgs in messages(rnd, esizes, -1).values())
    assert pair == "llama" or kinds == {(True, True), (True, False), (False, True), (False, False)}


def _check_link(items: list[Item], msgs, esizes: list[int], min_bytes: int) -> set[tuple[bool, bool]]:
    want = sorted(e for it in items for (shape, s), (_, d) in zip(it.views(it.seg.src), it.views(it.seg.dst))
                  for e in _elements(it.param, shape, s, d))
    got = sorted(e for m in msgs for p in m.parts for e in _elements(p.param, p.shape, p.src, p.dst))
    assert got == want  # every element once, its source and target addresses kept together
    packed = [m for m in msgs if not (m.from_source or m.into_target)]
    assert len(packed) <= 1 and (not packed or msgs[-1] is packed[0])
    for m in msgs:
        assert m.nbytes == sum(prod(p.shape) * esizes[p.param] for p in m.parts)
        sizes = [esizes[p.param] for p in m.parts]
        assert sizes == sorted(sizes, reverse=True)  # aligned without padding
        if m.from_source or m.into_target:
            assert len(m.parts) == 1 and m.nbytes >= min_bytes
            p = m.parts[0]
            run = list(range(0, prod(p.shape)))
            assert not m.from_source or [a - p.src.offset for a in _addresses(p.shape, p.src)] == run
            assert not m.into_target or (p.factor ** -1 == 1.0
                                         and [a - p.dst.offset for a in _addresses(p.shape, p.dst)] == run)
    return {(m.from_source, m.into_target) for m in msgs}


@pytest.mark.parametrize("budget", [8, 100, 1 << 20])
def test_per_link_cuts_agree_at_both_ends_and_respect_budgets(budget):
    """``schedule_links`` from each rank's own plan: the two ends of every link cut it into the
    same rounds, each round within the link's budget, every remote element once."""
    from reshard.execute.schedule import schedule_links

    src, tgt = llama_pair()
    es = {n: torch.empty((), dtype=llama_dtype(n)).element_size() for n in src}
    cuts = {}
    for r in range(WORLD):
        mp = plan_for_rank(src, tgt, r)
        names = sorted(mp.params)
        pairs = [(mp.params[n], es[n]) for n in names]
        links = {(s.src_rank, s.dst_rank) for p, _ in pairs for s in p.segments if not s.is_local}
        rounds = schedule_links(pairs, dict.fromkeys(links, budget))
        for i, rnd in enumerate(rounds):
            for link, items in rnd.items():
                assert sum(it.numel * pairs[it.param][1] for it in items) <= budget
                key = [(names[it.param], it.seg, it.lo, it.hi) for it in items]
                cuts.setdefault(link, {}).setdefault(r, []).append((i, key))
    whole = plan_model(src, tgt)
    for link, ends in cuts.items():
        assert set(ends) == set(link), link
        assert ends[link[0]] == ends[link[1]], link
        want = sum(s.numel for p in whole.params.values() for s in p.segments if (s.src_rank, s.dst_rank) == link)
        assert sum(it[3] - it[2] for _, key in ends[link[0]] for it in key) == want
