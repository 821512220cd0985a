"""A weight sync from a quantized checkpoint read lazily (``reader_sources``' default,
``reshard.execute.lazy``): each shard read when a push packs it, a band at a time, never the
checkpoint's decoded shards at once.

Real gloo processes (``tests/support/sync_lazy_job.py``): 2 trainer ranks reading transformers' own
FP8 Qwen2 folder (``fp8_qwen2``, 16 x 32 blocks) and its kept FP8 DCP at 2 files, 2 engine TP ranks
as vLLM lays Llama/Qwen2 out. Every engine tensor of a lazy push equals, bit for bit, the eager
push's (every shard read first, a quantized one decoded whole) into a bf16 engine and into an FP8
one (``Fp8Block``). A scale damaged after ``reshard.open`` is refused on every rank, naming the
tensor, before anything is sent. In process: the loopback and the vLLM trainer's pack against the
eager source, and a push that holds one band of one parameter at a time.
"""

from __future__ import annotations

import json
import shutil
import weakref

import pytest
import torch

import reshard
from reshard.execute.bands import Banded
from reshard.execute.lazy import LazyShards
from reshard.execute.sources import reader_sources
from reshard.execute.sync_program import simulate
from reshard.layouts.arch import LLAMA_VLLM, inference_targets
from reshard.layouts.inference import engine_shapes
from tests.support import sync_lazy_job as J
from tests.support.paths import REPO
from tests.support.spawn import run_ranks

HF = REPO / "tests" / "fixtures" / "hf"
FP8 = HF / "fp8_qwen2"
JOB = {"trainer": [0, 1], "engine": [2, 3], "heads": 4, "kv_heads": 2, "block": [16, 32], "band_bytes": 512,
       "inflight": 4096}
TIMEOUT_S = 240


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict:
    workdir = tmp_path_factory.mktemp("lazysync")
    hf = workdir / "hf"
    shutil.copytree(FP8, hf)  # its scale is damaged in place by the job
    kept = workdir / "kept"
    reshard.reshard(FP8, kept, to="dcp", files=2, quantize="keep")
    dcp = next(p.parent for p in kept.rglob(".metadata"))
    cfg = {**JOB, "sources": {"hf": str(hf), "dcp": str(dcp)}}
    (workdir / "job.json").write_text(json.dumps(cfg))
    ran = run_ranks(J.worker, len(JOB["trainer"]) + len(JOB["engine"]), workdir, TIMEOUT_S, "phase")
    crashed = ran["records"].get("crashed", {})
    assert not crashed, f"ranks crashed: {crashed}"
    assert not ran["hung"], f"ranks {ran['hung']} hung"
    return {**ran, "workdir": workdir}


@pytest.mark.parametrize("source", ["hf", "dcp"])
@pytest.mark.parametrize("target", ["bf16", "fp8", "fp8cut"])
def test_a_lazy_push_gives_the_eager_push_bytes(job, source, target):
    rec = job["records"][f"{source}-{target}"]
    assert bool(rec[0]["quantized"]) == target.startswith("fp8")
    compared = 0
    for r in JOB["engine"]:
        eager = torch.load(job["workdir"] / f"engine-{source}-{target}-eager-{r}.pt")
        lazy = torch.load(job["workdir"] / f"engine-{source}-{target}-lazy-{r}.pt")
        assert eager.keys() == lazy.keys()
        for n, t in eager.items():
            assert t.dtype == lazy[n].dtype
            assert torch.equal(_bits(t), _bits(lazy[n])), (n, r)
            assert not (t.dtype == torch.bfloat16 and bool((t == 9.0).all())), (n, r)  # filled, not left
            compared += 1
        if target != "bf16":
            assert any(t.dtype == torch.float8_e4m3fn for t in eager.values())
    assert compared >= 2 * 12
    for r in JOB["trainer"]:  # the same bytes crossed the wire, in the same rounds
        s = rec[r]["stats"]
        assert s["lazy"]["sent_bytes"] == s["eager"]["sent_bytes"] and s["lazy"]["rounds"] == s["eager"]["rounds"]
    first = rec[0]["stats"]["lazy"]
    assert first["sent_bytes"] > 0 and first["rounds"] > 1


@pytest.mark.parametrize("source", ["hf", "dcp"])
def test_a_block_the_engine_tp_cuts_is_quantized_whole_on_both_ranks(job, source):
    """``o_proj`` row-parallel at TP 2 holds 32 of its 64 input columns on each rank: the one 64-wide
    block column is cut, and each rank's ``weight_scale_inv`` is the whole block's (the replicated
    piece, issue 33 item 5), equal on both ranks, while the payloads are each rank's own columns."""
    scales, payloads = [], []
    for r in JOB["engine"]:
        got = torch.load(job["workdir"] / f"engine-{source}-fp8cut-lazy-{r}.pt")
        names = [n for n, t in got.items() if n.endswith("o_proj.weight_scale_inv")]
        assert len(names) == 2  # both layers
        scales.append(torch.cat([got[n].reshape(-1) for n in sorted(names)]))
        payloads.append(torch.cat([_bits(got[n[:-len("_scale_inv")]]).reshape(-1) for n in sorted(names)]))
        assert all(tuple(got[n].shape) == (4, 1) for n in names)
    assert torch.equal(_bits(scales[0]), _bits(scales[1]))
    assert not torch.equal(payloads[0], payloads[1])


def test_a_scale_damaged_after_open_is_refused_on_every_rank_before_anything_is_sent(job):
    got = job["records"]["damaged"]
    assert set(got) == set(JOB["trainer"] + JOB["engine"])
    for r, rec in got.items():
        assert rec["raised"] == "QuantizedError", (r, rec)
        assert J.DAMAGED in rec["message"] and "finite positive" in rec["message"], rec["message"]
        assert rec["untouched"], r  # the engine's tensors still hold the 9s they were set to
    # the eager path reads what it is handed: NaN weights reach the engine, no error
    assert all(rec["eager"]["raised"] is None for rec in got.values())
    assert any(got[r]["eager_nan"] for r in JOB["engine"])


def _targets(maps):
    shapes = {n: tuple(m.valid_shape) for n, m in maps.items()}
    return inference_targets(LLAMA_VLLM, shapes, tp=2, num_heads=4, num_kv_heads=2, ranks=[1, 2])


@pytest.mark.parametrize("name", ["fp8_qwen2", "fp8_qwen2_ue8m0", "mxfp4_gpt_oss"])
def test_lazy_shards_are_the_eager_shards(name):
    reader = reshard.open(HF / name)
    _, eager = reader_sources(reader, 0, lazy=False)
    _, lazy = reader_sources(reader, 0)
    assert isinstance(lazy, LazyShards) and list(lazy) == list(eager)
    for n, t in eager.items():
        assert lazy.shape(n) == tuple(t.shape) and lazy.dtype(n) == t.dtype
        assert torch.equal(_bits(lazy[n]), _bits(t)), n
        whole = lazy.open(n)
        got = torch.cat([whole.span(lo, min(whole.numel, lo + 100))[0][lo - whole.span(lo, lo + 1)[1]:][:100]
                         for lo in range(0, whole.numel, 100)]) if whole.numel else t.reshape(-1)
        assert torch.equal(_bits(got[:t.numel()]), _bits(t.reshape(-1))), n
    assert lazy.problems(list(lazy)) == []


@pytest.mark.parametrize("limit", [None, 4096])
def test_loopback_push_from_a_lazy_source_equals_the_eager_one(monkeypatch, limit):
    monkeypatch.setenv("RESHARD_BAND_BYTES", "512")
    reader = reshard.open(FP8)
    maps, eager = reader_sources(reader, 0, lazy=False)
    _, lazy = reader_sources(reader, 0)
    tg = _targets(maps)
    outs = []
    for src in (eager, lazy):
        into = {q: {n: torch.full(s, 9.0, dtype=torch.bfloat16) for n, s in engine_shapes(tg, q).items()} for q in (1, 2)}
        simulate(maps, tg, torch.bfloat16, {0: src}, into, limit=limit)
        outs.append(into)
    for q in (1, 2):
        for n, t in outs[0][q].items():
            assert torch.equal(_bits(t), _bits(outs[1][q][n])), (n, q)


def test_a_lazy_push_holds_one_band_of_one_parameter(monkeypatch):
    """Every band the push reads is about a band wide (whole block rows), and when one is made no
    band of another parameter is alive: what bounds a push's memory, whatever the checkpoint's size."""
    monkeypatch.setenv("RESHARD_BAND_BYTES", "2048")
    reader = reshard.open(FP8)
    maps, lazy = reader_sources(reader, 0)
    made, alive_others, refs = [], [], []
    span = Banded.span

    def watched(self, lo, hi):
        t, base = span(self, lo, hi)
        alive_others.extend(k for k, r in refs if k != id(self) and r() is not None)
        refs.append((id(self), weakref.ref(t)))
        made.append(t.numel() * t.element_size())
        return t, base

    monkeypatch.setattr(Banded, "span", watched)
    whole = reader.fragment

    def never_whole(name, state, rank):  # a quantized weight is read in bands only, never decoded whole
        assert reader.stored(name) is None, name
        return whole(name, state, rank)

    monkeypatch.setattr(reader, "fragment", never_whole)
    tg = _targets(maps)
    into = {q: {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in engine_shapes(tg, q).items()} for q in (1, 2)}
    simulate(maps, tg, torch.bfloat16, {0: lazy}, into, limit=4096)
    assert len(made) > len(maps) and not alive_others
    assert max(made) <= 2048 + 2 * 16 * 128 * 4  # a band and at most two block rows (16 x 128 float32) more
    assert all(r() is None for _, r in refs)  # nothing of the checkpoint held after the push


def test_the_vllm_trainers_pack_from_a_lazy_source_equals_the_eager_one(monkeypatch):
    """``formats.vllm.wire.pack`` (what ``ReshardTrainerWeightTransferEngine.send_weights`` sends each
    worker; no vLLM import) from ``ShardSource.checkpoint``'s lazy shards: the eager message, bytes."""
    from reshard.formats.vllm import wire
    from reshard.plan.planner import plan_for_rank

    monkeypatch.setenv("RESHARD_BAND_BYTES", "512")
    reader = reshard.open(FP8)
    maps, eager = reader_sources(reader, 0, lazy=False)
    _, lazy = reader_sources(reader, 0)
    tg = _targets(maps)
    sends, _ = wire.link_program(plan_for_rank(maps, {n: t.map for n, t in tg.items()}, 0), 0)
    assert sorted(sends) == [1, 2]
    for link in sends.values():
        want = wire.pack(link, eager, torch.empty(link.numel, dtype=torch.bfloat16))
        got = wire.pack(link, lazy, torch.empty(link.numel, dtype=torch.bfloat16))
        assert torch.equal(_bits(want), _bits(got))
        assert lazy._open is None  # nothing of the checkpoint held between messages
