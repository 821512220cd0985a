"""Multi-token prediction on the routes issue 35 left: DCP / universal in Megatron's names back to
Megatron (``--megatron-args``), MTP under virtual pipeline stages, legacy files with MTP.

* ``torch_dist_deepseek_v3_mtp_tp2_ep2`` (MLA + MoE MTP layer), ``torch_dist_mtp1`` (dense) and
  ``torch_dist_pp2_vpp2_mtp1`` (PP 2 x virtual PP 2, the MTP layer on the last stage's last model
  chunk) go to DCP / universal under Megatron's names -- every key kept, the MTP layer's too -- and
  back to Megatron at another TP / EP / PP with the args, optimizer groups and run state of the
  Megatron checkpoint ``--megatron-args`` names: every weight and Adam moment, the MTP layer's
  included, equals Megatron's reload of the fixture bit for bit.
* ``torch_dist_pp2_vpp2_mtp1``: the MTP keys lie in the last stage's file, and the checkpoint
  reshards to PP 1 and back to its virtual stages.
* ``legacy_tp2_pp2_mtp1`` (``--ckpt-format torch``): the last stage keeps a copy of the embedding
  for the MTP block, in its model and optimizer; checked equal to the first stage's and written
  back (``test_legacy_writer`` compares the files with Megatron's).

Megatron's own loader on these outputs: ``test_megatron_loads`` (opt-in)."""

from __future__ import annotations

import shutil

import pytest
import torch

from reshard.errors import CheckpointError, ReshardError
from reshard.formats.megatron import safe
from reshard.formats.megatron.reader import MegatronReader
from reshard.formats.registry import open_reader
from reshard.jobs.convert import convert, reshard
from reshard.storage import torch_zip

from .support import FIXTURES, compare_megatron

MTP = "torch_dist_deepseek_v3_mtp_tp2_ep2"
VPP = "torch_dist_pp2_vpp2_mtp1"
LEGACY = "legacy_tp2_pp2_mtp1"

ROUND_TRIPS = [  # (fixture, via, target topology): default tier; the other routes slow
    (MTP, "dcp", dict(tp=1, pp=1, dp=1, ep=1)),
    pytest.param(MTP, "universal", dict(tp=1, pp=2, dp=2, ep=2), marks=pytest.mark.slow),
    ("torch_dist_mtp1", "universal", dict(tp=2, pp=2, dp=1)),
    (VPP, "dcp", dict(tp=2, pp=2, dp=1)),  # the reference's PP: its virtual stages kept
    pytest.param(VPP, "universal", dict(tp=1, pp=1, dp=1), marks=pytest.mark.slow),
    pytest.param(LEGACY, "dcp", dict(tp=1, pp=2, dp=1), marks=pytest.mark.slow),
]


def _mtp_count(reader) -> int:
    return sum(n.startswith("mtp.") for n in reader.names)


@pytest.mark.parametrize("fixture,via,topology", ROUND_TRIPS)
def test_megatron_names_through_dcp_or_universal_and_back_keep_the_mtp_layer(tmp_path, fixture, via, topology):
    mid = convert(FIXTURES / fixture, tmp_path / via, fmt=via)
    assert not mid.dropped
    r = open_reader(mid.out_dir)
    src = MegatronReader.open(FIXTURES / fixture)
    assert _mtp_count(r) == _mtp_count(src) > 0
    report = reshard(mid.out_dir, tmp_path / "back", to="megatron", optimizer="adam", megatron_args=FIXTURES / fixture,
                     **topology)
    assert any("--megatron-args" in n for n in report.notes)
    back = MegatronReader.open(report.out_dir)
    back.check()
    a = back.arch
    assert (a.tp, a.pp, a.dp, a.mtp) == (topology["tp"], topology["pp"], topology["dp"], src.arch.mtp)
    assert a.vpp == (src.arch.vpp if topology["pp"] == src.arch.pp else 1)
    assert back.src.sharding == "adam" and (report.out_dir / "latest_checkpointed_iteration.txt").read_text() == "3"
    n = compare_megatron(back, fixture)  # weights and both moments, the MTP layer's among them
    states = {s for name in back.names if name.startswith("mtp.") for s in back.states(name)}
    assert n > 3 * _mtp_count(src) and {"exp_avg", "exp_avg_sq"} <= states


def test_a_source_in_megatron_names_is_refused_without_megatron_args_or_for_another_model(tmp_path):
    mid = convert(FIXTURES / "torch_dist_mtp1", tmp_path / "dcp", fmt="dcp").out_dir
    out = tmp_path / "out"
    with pytest.raises(ReshardError, match=r"--megatron-args CKPT"):
        reshard(mid, out, to="megatron", tp=2)
    with pytest.raises(ReshardError, match=r"linear_qkv.layer_norm_weight' is \[2, 24\], the args of --megatron-args "
                                           r".*torch_dist_tp2_pp2 imply \[4, 24\]"):
        reshard(mid, out, to="megatron", megatron_args=FIXTURES / "torch_dist_tp2_pp2")
    with pytest.raises(ReshardError, match="keeps the source's args"):
        reshard(FIXTURES / "torch_dist_mtp1", out, to="megatron", megatron_args=FIXTURES / "torch_dist_mtp1")
    with pytest.raises(ReshardError, match="--megatron-args and --hf-config"):
        reshard(mid, out, to="megatron", megatron_args=FIXTURES / "torch_dist_mtp1", hf_config=mid)
    # a model without an MTP layer (the same decoder) is another model: the MTP tensors have no key there
    with pytest.raises(ReshardError, match=r"'mtp\.layers\.0\.[^']*' \(of \d+\) is no key of the Megatron model"):
        reshard(mid, out, to="megatron", megatron_args=FIXTURES / "torch_dist_tp2_dp2_distopt")
    # and an MTP model cannot be filled from a source whose MTP layer was dropped
    dropped = convert(FIXTURES / "torch_dist_mtp1", tmp_path / "dropped", fmt="dcp", drop=[r"^mtp\."]).out_dir
    with pytest.raises(ReshardError, match=r"has no 'mtp\.layers\.0\.enorm\.weight', which the Megatron model"):
        reshard(dropped, out, to="megatron", megatron_args=FIXTURES / "torch_dist_mtp1")
    assert not out.exists()


def test_vpp_mtp_layer_lies_on_the_last_stages_last_chunk_and_reshards(tmp_path):
    r = MegatronReader.open(FIXTURES / VPP)
    a = r.arch
    assert (a.pp, a.vpp, a.mtp, a.layers) == (2, 2, 1, 4)
    assert [list(a.chunk_layers(1, v)) for v in range(2)] == [[1], [3]]
    for name in (n for n in r.names if n.startswith("mtp.")):
        assert {c.file for c in r.src.ck.entry(name).chunks} == {"__1_0.distcp"}, name  # PP rank 1, DP 0
    # written again at its own topology: Megatron's tensor keys, chunks and files
    same = reshard(FIXTURES / VPP, tmp_path / "same", to="megatron").out_dir
    mine = MegatronReader.open(same)
    assert mine.arch.vpp == 2 and mine.args.virtual_pipeline_model_parallel_size == 2
    theirs = r.src.ck
    assert set(mine.src.ck.tensors) == set(theirs.tensors)
    for k in theirs.tensors:
        assert sorted((c.file, c.offsets) for c in mine.src.ck.entry(k).chunks) == \
            sorted((c.file, c.offsets) for c in theirs.entry(k).chunks), k
    # to PP 1 (the stages merged), and from there back to PP 2 x virtual PP 2 through Megatron's names
    flat = reshard(FIXTURES / VPP, tmp_path / "pp1", to="megatron", tp=1, pp=1).out_dir
    assert compare_megatron(MegatronReader.open(flat), VPP) > 0
    mid = convert(flat, tmp_path / "dcp", fmt="dcp").out_dir
    back = reshard(mid, tmp_path / "back", to="megatron", pp=2, megatron_args=FIXTURES / VPP).out_dir
    b = MegatronReader.open(back)
    assert (b.arch.pp, b.arch.vpp, b.arch.mtp) == (2, 2, 1)
    assert compare_megatron(b, VPP) > 0


def test_legacy_mtp_keeps_the_last_stages_embedding_copy(tmp_path):
    r = MegatronReader.open(FIXTURES / LEGACY)
    r.check()
    assert not [h for h in r.unlowered() if h.what == "weights"]  # the copy is read (checked equal), not left over
    last = FIXTURES / LEGACY / "iter_0000003" / "mp_rank_00_001" / "model_optim_rng.pt"
    sd = safe.load_file(last)
    assert next(iter(sd["model"])) == "embedding.word_embeddings.weight"  # registered first on the last stage
    # a copy that drifted from the first stage's is refused, naming it
    bad = tmp_path / "bad"
    shutil.copytree(FIXTURES / LEGACY, bad)
    sd["model"]["embedding.word_embeddings.weight"] = sd["model"]["embedding.word_embeddings.weight"] + 1
    with open(bad / "iter_0000003" / "mp_rank_00_001" / "model_optim_rng.pt", "wb") as f:
        torch_zip.save(sd, f, pickler=safe.PICKLER)  # Megatron's enums in args under their own names
    with pytest.raises(CheckpointError, match="mp_rank_00_001.*embedding.word_embeddings.weight \\(weight, TP rank 0\\): "
                                              "the last stage's copy for the MTP block differs"):
        MegatronReader.open(bad).check()


def test_legacy_mtp_with_the_distributed_optimizer_checks_the_copys_bucket(tmp_path):
    """``legacy_pp2_dp2_mtp1_distopt``: each stage's ``distrib_optim.pt`` ends with the embedding (the
    first stage's, and the last stage's copy: registered first, so last in the reversed buffer, a
    ``shared_embedding`` bucket of its own); the copy's fp32 master and moments equal the first
    stage's, and a drifted one is refused naming the file."""
    name = "legacy_pp2_dp2_mtp1_distopt"
    r = MegatronReader.open(FIXTURES / name)
    r.check()
    assert (r.arch.pp, r.arch.dp, r.arch.mtp, r.src.sharding) == (2, 2, 1, "dp_reshardable")
    assert not [h for h in r.unlowered() if h.what == "weights"]
    it = FIXTURES / name / "iter_0000003"
    n = r.arch.spec("embedding.word_embeddings.weight").shape
    numel = n[0] * n[1]
    bufs = [next(iter(safe.load_file(it / f / "distrib_optim.pt")[0].values())) for f in ("mp_rank_00_000", "mp_rank_00_001")]
    for k in ("param", "exp_avg", "exp_avg_sq"):
        assert torch.equal(bufs[0][k][-numel:], bufs[1][k][-numel:]), k
    bad = tmp_path / "bad"
    shutil.copytree(FIXTURES / name, bad)
    d = safe.load_file(it / "mp_rank_00_001" / "distrib_optim.pt")
    next(iter(d[0].values()))["exp_avg"][-1] += 1
    with open(bad / "iter_0000003" / "mp_rank_00_001" / "distrib_optim.pt", "wb") as f:
        torch_zip.save(d, f, pickler=safe.PICKLER)
    with pytest.raises(CheckpointError, match="mp_rank_00_001/distrib_optim.pt: embedding.word_embeddings.weight "
                                              "\\(exp_avg, TP rank 0\\): the last stage's copy for the MTP block differs"):
        MegatronReader.open(bad).check()


def test_a_planted_tensor_in_megatron_names_is_refused_by_name_or_dropped_and_recorded(tmp_path):
    """Every source tensor accounted for on this route: a tensor no key of the model takes is refused
    naming it before any output, and with ``--drop`` left out, listed in the report and the manifest."""
    import json

    from tests.jobs.test_accounted import PLANTED, _plant_dcp

    mid = convert(FIXTURES / MTP, tmp_path / "dcp", fmt="dcp").out_dir
    _plant_dcp(mid, tmp_path, {"model.mtp.layers.0.planted_buffer": PLANTED.clone()}, {})
    assert "mtp.layers.0.planted_buffer" in open_reader(mid).names
    out = tmp_path / "out"
    with pytest.raises(ReshardError, match=r"'mtp\.layers\.0\.planted_buffer' \(of 1\) is no key of the Megatron model"):
        reshard(mid, out, to="megatron", ep=1, megatron_args=FIXTURES / MTP)
    assert not out.exists()
    report = reshard(mid, out, to="megatron", ep=1, optimizer="adam", megatron_args=FIXTURES / MTP,
                     drop=[r"planted_buffer"])
    assert report.dropped == ["mtp.layers.0.planted_buffer"]
    manifest = json.loads((report.out_dir / "reshard-manifest.json").read_text())
    assert [d["key"] for d in manifest["dropped"]] == ["mtp.layers.0.planted_buffer"]
    assert compare_megatron(MegatronReader.open(report.out_dir), MTP) > 0


def test_a_source_step_other_than_the_references_is_refused(tmp_path):
    """The target takes the reference's iteration and learning-rate scheduler: a source trained further (another
    Adam step) is refused naming both steps, and written weights-only on request."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    mid = convert(FIXTURES / "torch_dist_mtp1", tmp_path / "dcp", fmt="dcp").out_dir
    md = FileSystemReader(str(mid)).read_metadata()
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
             if hasattr(v, "size")}
    with warnings.catch_warnings():  # one process, no process group
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(mid))
        state = {k: (torch.tensor(5.0) if k.endswith(".step") else v) for k, v in state.items()}
        dcp.save(state, checkpoint_id=str(tmp_path / "later"))
    out = tmp_path / "out"
    with pytest.raises(ReshardError, match=r"its optimizer step 5 is not that of --megatron-args .*torch_dist_mtp1 "
                                           r"\(3\), whose iteration and learning-rate scheduler"):
        reshard(tmp_path / "later", out, to="megatron", optimizer="adam", megatron_args=FIXTURES / "torch_dist_mtp1")
    assert not out.exists()
    back = reshard(tmp_path / "later", out, to="megatron", optimizer="none", megatron_args=FIXTURES / "torch_dist_mtp1")
    assert compare_megatron(MegatronReader.open(back.out_dir), "torch_dist_mtp1") > 0
