"""Virtual (interleaved) and uneven pipeline stages: which global layers each stage's model chunk
holds (Megatron's ``get_transformer_layer_offset``), checked against where Megatron itself put
each layer's chunks; what the writer keeps of them, and what it refuses."""

from __future__ import annotations

import copy

import pytest

from reshard.errors import CheckpointError
from reshard.formats.megatron.model import Arch
from reshard.formats.megatron.reader import MegatronReader
from reshard.jobs.convert import reshard

from .support import FIXTURES, compare_megatron


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
