"""A weight sync from a Megatron-Core checkpoint on disk: each trainer rank reads its own files.

Under HF names a Megatron map's keys are runs (``Reader.labels``: one per run that lies contiguous
in a file, numbered in order), not saving ranks; ``Reader.saver`` says whose file holds each, so
``ShardSource.checkpoint`` puts storage rank ``k``'s runs on trainer rank ``k``, several runs of one
parameter joined into one shard. Before, run ``j`` went to trainer rank ``j``: on
``torch_dist_pp2_uneven`` (PP 2, stage 0 = layer 0, 2 query groups) trainer rank 1 read the second
query group's rows of layer 0 from stage 0's file.

Real gloo processes (``tests/support/sync_megatron_job.py``): 2 trainer ranks, 2 vLLM-style engine
ranks at TP 2. Each trainer logs the file of every chunk it reads while building its source and
pushing; the engine's tensors are compared, bit for bit, with vLLM's slicing of the full tensors the
reader's own maps rebuild (the same for a lazy and an eager source).
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig

import reshard
from reshard.execute.sources import reader_sources
from reshard.formats.megatron.reader import MegatronReader
from tests.support import sync_megatron_job as J
from tests.support.paths import REPO
from tests.support.spawn import run_ranks
from tests.support.vllm_ref import engine_slices

MEGATRON = REPO / "tests" / "fixtures" / "megatron"
# PP 2 uneven (weights); DP 2 with the distributed optimizer's bucket ranges (fp32 masters, bf16 weights);
# DP 2 fully_reshardable (fp32 masters as chunks of their own keys)
FIXTURES = ["torch_dist_pp2_uneven", "torch_dist_dp2_distopt_bf16", "torch_dist_dp2_fully_reshardable"]
JOB = {"trainer": [0, 1], "engine": [2, 3], "heads": 4, "kv_heads": 2}
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict:
    workdir = tmp_path_factory.mktemp("megatronsync")
    cfg = {**JOB, "sources": {f: str(MEGATRON / f) for f in FIXTURES}}
    (workdir / "job.json").write_text(json.dumps(cfg))
    ran = run_ranks(J.worker, len(JOB["trainer"]) + len(JOB["engine"]), workdir, TIMEOUT_S, "phase")
    crashed = ran["records"].get("crashed", {})
    assert not crashed, f"ranks crashed: {crashed}"
    assert not ran["hung"], f"ranks {ran['hung']} hung"
    return {**ran, "workdir": workdir}


def _state(reader) -> str:
    return "fp32" if "fp32" in reader.states(reader.names[0]) else "weight"


def _own_files(fixture: str) -> dict[int, set[str]]:
    """Each storage rank's files of the checkpoint (its ``__R_0.distcp``), from the DCP metadata."""
    ck = MegatronReader.open(MEGATRON / fixture).src.ck
    out: dict[int, set[str]] = {}
    for e in ck.tensors.values():
        for c in e.chunks:
            out.setdefault(c.rank, set()).add(c.file)
    return out


@pytest.mark.parametrize("how", ["lazy", "eager"])
@pytest.mark.parametrize("fixture", FIXTURES)
def test_each_trainer_rank_reads_only_its_own_files(job, fixture, how):
    own = _own_files(fixture)
    rec = job["records"][f"{fixture}-{how}"]
    for r in JOB["trainer"]:
        assert rec[r]["reads"] > 0, r
        assert set(rec[r]["files"]) <= own[r], (r, rec[r]["files"])
    for r in JOB["engine"]:
        assert rec[r]["reads"] == 0, r  # an engine rank builds the maps, reads nothing


@pytest.mark.parametrize("how", ["lazy", "eager"])
@pytest.mark.parametrize("fixture", FIXTURES)
def test_the_engine_gets_the_checkpoints_tensors(job, fixture, how):
    reader = reshard.open(str(MEGATRON / fixture), names="hf")
    state = _state(reader)
    full = {}
    for n in reader.names:  # the reader's own maps and fragments: independent of the sources' grouping
        m = reader.map(n, state)
        full[n] = m.rebuild({k: reader.fragment(n, state, k) for k in m.ranks}, valid_only=True).to(torch.bfloat16)
    cfg = LlamaConfig(**reader.hf_config())
    compared = 0
    for i, r in enumerate(JOB["engine"]):
        got = torch.load(job["workdir"] / f"engine-{fixture}-{how}-{r}.pt")
        want = engine_slices(full, cfg, len(JOB["engine"]), i)
        assert got.keys() == want.keys()
        for n, t in want.items():
            assert torch.equal(got[n].view(torch.int16), t.view(torch.int16)), (n, r)
            compared += 1
    assert compared >= 2 * 10


def test_a_pipeline_stage_s_rows_stay_on_its_trainer_rank():
    """``torch_dist_pp2_uneven``: trainer rank 0 holds stage 0 (the embedding and layer 0, each of
    q/k/v's query groups joined into one shard), rank 1 stage 1 (layers 1-2, the final norm, the
    output layer); a map's holders are trainer ranks."""
    reader = reshard.open(str(MEGATRON / "torch_dist_pp2_uneven"), names="hf")
    maps, mine = {}, {}
    for r in (0, 1):
        maps, mine[r] = reader_sources(reader, r, lazy=False)
    assert set(mine[0]) == {n for n in reader.names if n.startswith(("model.embed_tokens", "model.layers.0."))}
    assert set(mine[1]) == set(reader.names) - set(mine[0])
    q = "model.layers.0.self_attn.q_proj.weight"
    assert len(reader.map(q, "weight").ranks) == 2 and maps[q].ranks == (0,)  # two runs, one trainer rank
    for n, m in maps.items():
        full = m.rebuild({r: mine[r][n] for r in m.ranks})
        ref = reader.map(n, "weight")
        assert torch.equal(full, ref.rebuild({k: reader.fragment(n, "weight", k) for k in ref.ranks})), n


def test_a_legacy_files_saver_is_the_rank_that_saved_it():
    """Legacy files: a run's storage rank is its file's ``args.rank`` (``legacy_tp2_pp2``: TP x PP
    = 2 x 2, ranks ``tp + 2 pp``)."""
    reader = MegatronReader.open(MEGATRON / "legacy_tp2_pp2", names="hf")
    layer0, layer3 = "model.layers.0.self_attn.q_proj.weight", "model.layers.3.mlp.down_proj.weight"
    assert {reader.saver(layer0, "weight", k) for k in reader.map(layer0, "weight").ranks} == {0, 1}
    assert {reader.saver(layer3, "weight", k) for k in reader.map(layer3, "weight").ranks} == {2, 3}


def test_storage_ranks_on_fewer_live_ranks_only_as_asked():
    """``torch_dist_tp2_pp2_qwen2_vllm`` was saved by 4 ranks: 2 live ranks without ``ranks=`` are
    refused (storage ranks 2 and 3 would have no reader: the first parameter of stage 1 is named); ``ranks=[0, 1, 0, 1]`` puts stage 1's files
    on the stage 0 ranks of the same TP rank, each live rank's runs of a parameter one shard."""
    from reshard.errors import MapError

    reader = reshard.open(str(MEGATRON / "torch_dist_tp2_pp2_qwen2_vllm"), names="hf")
    with pytest.raises(MapError, match=r"has storage ranks \[2\], but only 2 live ranks read it"):
        reader_sources(reader, 0, ranks=[0, 1])
    maps, mine = {}, {}
    for r in (0, 1):
        maps, mine[r] = reader_sources(reader, r, ranks=[0, 1, 0, 1], lazy=False)
    assert {m.ranks for m in maps.values()} <= {(0,), (1,), (0, 1)}
    for n, m in maps.items():
        ref = reader.map(n, "weight")
        want = ref.rebuild({k: reader.fragment(n, "weight", k) for k in ref.ranks})
        assert torch.equal(m.rebuild({r: mine[r][n] for r in m.ranks}), want), n
