"""Virtual (interleaved) and uneven pipeline stages: which global layers each stage's model chunk
holds (Megatron's ``get_transformer_layer_offset``), checked against where Megatron itself put
each layer's chunks; what the writer keeps of them, and what it refuses."""

from __future__ import annotations

import copy

import pytest
import torch

from reshard.errors import CheckpointError, ReshardError
from reshard.formats.megatron import safe
from reshard.formats.megatron.model import Arch
from reshard.formats.megatron.reader import MegatronReader
from reshard.jobs.convert import convert, reshard

from .support import FIXTURES, compare_megatron, full


def test_layers_of_each_model_chunk():
    vpp = MegatronReader.open(FIXTURES / "torch_dist_pp2_vpp2").arch
    assert (vpp.pp, vpp.vpp) == (2, 2)
    assert [[list(vpp.chunk_layers(p, v)) for v in range(2)] for p in range(2)] == [[[0], [2]], [[1], [3]]]
    assert [vpp.place(i) for i in range(4)] == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]
    uneven = MegatronReader.open(FIXTURES / "torch_dist_pp2_uneven").arch
    assert (uneven.first, uneven.last, uneven.vpp) == (1, None, 1)
    assert [uneven.stage_layers(p) for p in range(2)] == [[0], [1, 2]]
    assert [uneven.place(i) for i in range(3)] == [(0, 0, 0), (1, 0, 0), (1, 0, 1)]


@pytest.mark.parametrize("fixture", ["torch_dist_pp2_vpp2", "torch_dist_pp2_uneven", "torch_dist_tp2_pp2"])
def test_each_layer_lies_in_the_file_of_its_stage(fixture):
    """With DP = 1 every chunk is in the file of the rank that holds it: Megatron's placement."""
    r = MegatronReader.open(FIXTURES / fixture)
    a = r.arch
    seen = 0
    for spec in a.keys():
        e = r.src.ck.entry(spec.key)
        for c in e.chunks:
            index = tuple(c.offsets[:spec.stacked])
            t = c.offsets[spec.stacked] * a.tp // a.full_shape(spec)[spec.stacked] if spec.split == "rows" else None
            rank = a.rank(t or 0, a.stage_of(spec, index)) if spec.stacked else None
            if rank is not None and spec.split in ("rows", "rep"):
                assert c.file == f"__{rank}_0.distcp", (spec.key, c.offsets)
                seen += 1
    assert seen >= a.layers


def test_args_that_do_not_add_up_are_refused():
    args = copy.copy(MegatronReader.open(FIXTURES / "torch_dist_pp2_uneven").args)
    args.decoder_first_pipeline_num_layers = 4
    with pytest.raises(CheckpointError, match="3 layers do not divide over 2 pipeline stages"):
        Arch.from_args(args, "planted")
    args = copy.copy(MegatronReader.open(FIXTURES / "torch_dist_pp2_vpp2").args)
    args.virtual_pipeline_model_parallel_size = 3
    with pytest.raises(CheckpointError, match="4 layers do not divide over 2 pipeline stages x 3 virtual stages"):
        Arch.from_args(args, "planted")
    args.virtual_pipeline_model_parallel_size, args.account_for_loss_in_pipeline_split = 2, True
    with pytest.raises(CheckpointError, match="account_for_loss_in_pipeline_split = True"):
        Arch.from_args(args, "planted")


def test_writer_keeps_the_stages_at_the_source_pp_only(tmp_path):
    same = MegatronReader.open(reshard(FIXTURES / "torch_dist_pp2_vpp2", tmp_path / "a", to="megatron", tp=2).out_dir)
    assert same.arch.vpp == 2 and same.args.virtual_pipeline_model_parallel_size == 2
    other = MegatronReader.open(reshard(FIXTURES / "torch_dist_pp2_uneven", tmp_path / "b", to="megatron", pp=3).out_dir)
    assert other.arch.even and other.args.decoder_first_pipeline_num_layers is None
    kept = MegatronReader.open(reshard(FIXTURES / "torch_dist_pp2_uneven", tmp_path / "c", to="megatron").out_dir)
    assert kept.arch.first == 1 and kept.args.decoder_first_pipeline_num_layers == 1


def test_virtual_stages_with_dp_reshardable_keep_a_buffer_per_model_chunk(tmp_path):
    out = reshard(FIXTURES / "torch_dist_pp2_vpp2", tmp_path / "x", to="megatron", optimizer="dp_reshardable").out_dir
    r = MegatronReader.open(out)
    assert r.arch.vpp == 2 and r.src.sharding == "dp_reshardable"
    assert {k.split(".gbuf_idx_")[1][0] for k in r.src.ck.tensors if ".gbuf_idx_" in k} == {"0", "1"}
    assert compare_megatron(r, "torch_dist_pp2_vpp2") > 0
    # as Megatron writes them: per_bucket_numel lists one buffer per chunk, the same sizes
    want = MegatronReader.open(FIXTURES / "torch_dist_pp2_vpp2_distopt").src
    for m in range(2):
        key = f"optimizer.distributed.dp_group_idx_{m}.per_bucket_numel_unpadded/shard_0_1"
        assert r.src.obj(key) == want.obj(key)


# -- --vpp: a target at another virtual pipeline size ---------------------------------------------
_VIRTUAL_ARGS = ("virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
                 "num_virtual_stages_per_pipeline_rank", "overlap_p2p_comm", "align_param_gather")


def _layout(src) -> dict[str, list]:
    """Each tensor's (shape, dtype, chunks with their files), the distributed optimizer's buckets left out
    (it spreads gaps over chunks of its own)."""
    return {k: (e.shape, e.dtype, sorted((c.offsets, c.sizes, c.file) for c in e.chunks))
            for k, e in src.ck.tensors.items() if ".bucket_idx_" not in k}


def test_vpp_from_plain_stages_is_megatrons_interleaved_layout(tmp_path):
    """TP2 x PP2 -> TP1 x PP2 x VPP2: every tensor's chunks in the files where Megatron put them at
    PP2 x VPP2 (layers 0, 2 on stage 0, 1, 3 on stage 1), the args' virtual-stage fields as its
    ``validate_args`` left them, and the model and Adam moments Megatron's reload of the source."""
    out = MegatronReader.open(reshard(FIXTURES / "torch_dist_tp2_pp2", tmp_path, to="megatron", tp=1, vpp=2).out_dir)
    want = MegatronReader.open(FIXTURES / "torch_dist_pp2_vpp2")
    assert (out.arch.pp, out.arch.vpp) == (2, 2) and out.arch == want.arch
    assert _layout(out.src) == _layout(want.src)
    assert {k: getattr(out.args, k) for k in _VIRTUAL_ARGS} == {k: getattr(want.args, k) for k in _VIRTUAL_ARGS}
    assert compare_megatron(out, "torch_dist_tp2_pp2") == 81  # every weight and both moments


def test_vpp_with_the_distributed_optimizer_keeps_a_buffer_per_model_chunk(tmp_path):
    """The same to Megatron's dp_reshardable layout: a DDP buffer per model chunk, of the sizes Megatron's
    PP2 x VPP2 save records."""
    out = MegatronReader.open(reshard(FIXTURES / "torch_dist_tp2_pp2", tmp_path, to="megatron", tp=1, vpp=2,
                                      optimizer="dp_reshardable").out_dir)
    want = MegatronReader.open(FIXTURES / "torch_dist_pp2_vpp2_distopt")
    assert out.src.sharding == "dp_reshardable"
    assert set(out.src.ck.tensors) == set(want.src.ck.tensors) and _layout(out.src) == _layout(want.src)
    for m in range(2):
        key = f"optimizer.distributed.dp_group_idx_{m}.per_bucket_numel_unpadded/shard_0_1"
        assert out.src.obj(key) == want.src.obj(key)
    assert compare_megatron(out, "torch_dist_tp2_pp2") > 0


@pytest.mark.parametrize("fixture", ["torch_dist_pp2_vpp2", "torch_dist_pp2_vpp2_distopt", "torch_dist_pp2_vpp2_mtp1"])
@pytest.mark.parametrize("pp", [2, 1])
def test_vpp_1_or_pp_1_lays_the_layers_out_in_plain_stages(tmp_path, fixture, pp):
    """PP2 x VPP2 -> PP2 (``--vpp 1``) or PP1: each stage its run of layers in one model chunk (one
    DDP buffer), no virtual-stage args (the interleaved schedule's flags off, as ``validate_args``
    leaves them), every weight and moment Megatron's reload of the source."""
    out = MegatronReader.open(reshard(FIXTURES / fixture, tmp_path, to="megatron", pp=pp, **({"vpp": 1} if pp == 2 else {})
                                      ).out_dir)
    a = out.arch
    assert (a.pp, a.vpp) == (pp, 1) and a.even
    assert [a.stage_layers(p) for p in range(pp)] == ([[0, 1], [2, 3]] if pp == 2 else [[0, 1, 2, 3]])
    assert {k: getattr(out.args, k) for k in _VIRTUAL_ARGS} == dict.fromkeys(_VIRTUAL_ARGS[:3]) | {
        "overlap_p2p_comm": False, "align_param_gather": False}
    if pp == 2:  # layers 0, 1 in stage 0's file, 2, 3 in stage 1's (DP = TP = 1: rank = stage)
        for key, e in out.src.ck.tensors.items():
            if key.startswith("decoder.layers."):
                assert {(c.offsets[0], c.file) for c in e.chunks} <= {(0, "__0_0.distcp"), (1, "__0_0.distcp"),
                                                                     (2, "__1_0.distcp"), (3, "__1_0.distcp")}, key
    if "distopt" in fixture:
        assert {k.split(".gbuf_idx_")[1][0] for k in out.src.ck.tensors if ".gbuf_idx_" in k} == {"0"}
    assert compare_megatron(out, fixture) > 0


def test_vpp_as_legacy_files_is_megatrons_model_chunks(tmp_path):
    """``--ckpt-format torch``: legacy TP2 x PP2 -> TP1 x PP2 x VPP2 files hold ``model0`` / ``model1``
    with Megatron's keys in its order (as its PP2 x VPP2 save), and the source's weights and Adam moments."""
    out = reshard(FIXTURES / "legacy_tp2_pp2", tmp_path, to="megatron", tp=1, vpp=2).out_dir
    src = FIXTURES / "legacy_pp2_vpp2" / "iter_0000003"
    files = sorted(src.rglob("model_optim_rng.pt"))
    assert sorted(p.relative_to(out / "iter_0000003") for p in (out / "iter_0000003").rglob("*.pt")) == [
        p.relative_to(src) for p in files]
    for f in files:
        want, got = safe.load_file(f), safe.load_file(out / "iter_0000003" / f.relative_to(src))
        assert [k for k in got if k.startswith("model")] == ["model0", "model1"]
        for mk in ("model0", "model1"):
            assert list(got[mk]) == list(want[mk]), (f, mk)
        assert got["args"].virtual_pipeline_model_parallel_size == 2
        assert [list(s) for s in got["optimizer"]["state"].values()] == [
            list(s) for s in want["optimizer"]["state"].values()]
    assert compare_megatron(MegatronReader.open(out), "legacy_tp2_pp2") > 0


@pytest.mark.parametrize("fixture,options,message", [
    ("torch_dist_tp2_pp2", dict(pp=1, vpp=2), "--vpp 2 with --pp 1"),
    ("torch_dist_pp2_vpp2", dict(vpp=3), r"--vpp 3 at PP=2: .*4 layers do not divide over 2 pipeline stages x 3"),
    ("torch_dist_pp2_dp2_distopt", dict(vpp=2), r"--vpp 2 at PP=2: .*2 layers do not divide"),
    ("legacy_tp2_pp2", dict(vpp=2, optimizer="distributed"), "virtual pipeline size 2"),
    ("torch_dist_pp2_uneven", dict(vpp=2), r"--vpp 2 at PP=2: .*decoder_first_pipeline_num_layers = 1 does not divide"),
])
def test_a_vpp_megatron_cannot_build_is_refused_before_any_output(tmp_path, fixture, options, message):
    with pytest.raises(ReshardError, match=message):
        reshard(FIXTURES / fixture, tmp_path / "out", to="megatron", **options)
    assert not (tmp_path / "out").exists()


def test_vpp_is_a_megatron_option_only(tmp_path):
    with pytest.raises(ReshardError, match="--vpp"):
        reshard(FIXTURES / "torch_dist_tp2_pp2", tmp_path / "out", to="dcp", files=1, vpp=2)
    assert not (tmp_path / "out").exists()


def test_vpp_from_a_dcp_in_megatrons_names(tmp_path):
    """A DCP in Megatron's names, with ``--megatron-args`` of a PP2 source: ``--vpp 2`` lays it out in
    Megatron's interleaved stages, every weight and Adam moment Megatron's reload of that source."""
    mid = convert(FIXTURES / "torch_dist_tp2_pp2", tmp_path / "dcp", fmt="dcp")
    out = MegatronReader.open(reshard(mid.out_dir, tmp_path / "back", to="megatron", optimizer="adam", tp=1, vpp=2,
                                      megatron_args=FIXTURES / "torch_dist_tp2_pp2").out_dir)
    want = MegatronReader.open(FIXTURES / "torch_dist_pp2_vpp2")
    assert out.arch == want.arch and _layout(out.src) == _layout(want.src)
    assert compare_megatron(out, "torch_dist_tp2_pp2") == 81


def test_cli_vpp(tmp_path, capsys):
    from reshard.cli import main

    assert main(["reshard", str(FIXTURES / "torch_dist_tp2_pp2"), str(tmp_path / "a"), "--tp", "1", "--vpp", "2"]) == 0
    out = MegatronReader.open(next(p for p in (tmp_path / "a").iterdir() if p.is_dir()))
    assert (out.arch.pp, out.arch.vpp) == (2, 2)
    assert main(["reshard", str(FIXTURES / "torch_dist_tp2_pp2"), str(tmp_path / "b"), "--pp", "1", "--vpp", "2"]) != 0
    assert "--vpp 2 with --pp 1" in capsys.readouterr().err and not (tmp_path / "b").exists()


def test_vpp_from_an_hf_folder(tmp_path):
    """An HF folder (a 4-layer one, exported from ``torch_dist_tp2_pp2``) -> PP2 x VPP2: the model keys'
    chunks in the files of Megatron's PP2 x VPP2 save, every weight the source's (the vocabulary rows
    the folder holds)."""
    hf = convert(FIXTURES / "torch_dist_tp2_pp2", tmp_path / "hf", fmt="hf").out_dir
    out = MegatronReader.open(reshard(hf, tmp_path / "m", to="megatron", pp=2, vpp=2).out_dir)
    want = MegatronReader.open(FIXTURES / "torch_dist_pp2_vpp2")
    src = MegatronReader.open(FIXTURES / "torch_dist_tp2_pp2")
    assert out.arch == want.arch and out.args.num_layers_per_virtual_pipeline_stage == 1
    assert _layout(out.src) == {k: v for k, v in _layout(want.src).items() if not k.startswith("optimizer.")}
    for k in src.names:
        a, b = full(out, k, "weight"), full(src, k, "weight")
        rows = src.arch.vocab if k.startswith(("embedding.", "output_layer.")) else None
        assert torch.equal(a[:rows], b[:rows]), k
