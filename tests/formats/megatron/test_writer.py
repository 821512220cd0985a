"""Megatron -> Megatron at another TP/PP/DP (and optimizer layout): the output, read back by the
reader, equals Megatron's own TP=1 reload of the source (weights, moments, fp32 masters)."""

from __future__ import annotations

import json

import pytest

from reshard.errors import CheckpointError, ReshardError
from reshard.formats.megatron.reader import MegatronReader
from reshard.jobs.convert import reshard

from .support import FIXTURES, compare_megatron

CASES = [
    ("torch_dist_tp2_pp2", dict(tp=1, pp=1, dp=1), "adam"),
    ("torch_dist_tp2_dp2_distopt", dict(tp=1, pp=2, dp=2), "dp_reshardable"),
    ("torch_dist_pp2_dp2_distopt", dict(tp=2, pp=1, dp=1), "dp_reshardable"),
    ("torch_dist_dp2_fully_reshardable", dict(tp=2, pp=2, dp=1), "fully_reshardable"),
    ("torch_dist_dp2_distopt_bf16", dict(tp=2, pp=1, dp=2), "dp_reshardable"),
    ("legacy_tp2_pp2", dict(tp=1, pp=2, dp=2, optimizer="fully_reshardable"), "fully_reshardable"),
    ("legacy_dp2_distopt", dict(tp=2, pp=2, dp=1), "dp_reshardable"),
    ("torch_dist_moe_ep2_distopt", dict(tp=1, pp=1, dp=2), "dp_reshardable"),
    ("torch_dist_moe_ep2", dict(tp=1, pp=1, dp=2, optimizer="adam"), "adam"),
    ("torch_dist_moe_ep2_distopt", dict(tp=1, pp=1, dp=2, ep=1), "dp_reshardable"),  # experts in the dense buffer
    ("torch_dist_pp2_vpp2", dict(tp=1, pp=1, dp=1), "adam"),
    ("torch_dist_pp2_vpp2", dict(tp=2, pp=2, dp=1), "adam"),
    ("torch_dist_pp2_vpp2_distopt", dict(tp=2, pp=2, dp=1), "dp_reshardable"),
    ("torch_dist_pp2_vpp2_distopt", dict(tp=1, pp=1, dp=2, optimizer="fully_reshardable"), "fully_reshardable"),
    ("legacy_pp2_vpp2", dict(tp=2, pp=2, dp=1, optimizer="dp_reshardable"), "dp_reshardable"),
    ("torch_dist_pp2_uneven", dict(tp=1, pp=2, dp=2, optimizer="dp_reshardable"), "dp_reshardable"),
    ("torch_dist_pp2_uneven", dict(tp=2, pp=3, dp=1), "adam"),
    ("torch_dist_tp2_qk_layernorm", dict(tp=1, pp=2, dp=2, optimizer="dp_reshardable"), "dp_reshardable"),
    # multi-latent attention: the column-parallel down projections and their replicated norms
    ("torch_dist_tp2_mla", dict(tp=1, pp=2, dp=2, optimizer="dp_reshardable"), "dp_reshardable"),
    ("legacy_tp2_mla", dict(tp=1, pp=1, dp=1), "adam"),
    ("torch_dist_tp2_mla_q_proj", dict(tp=1, pp=2, dp=1), "adam"),  # linear_q_proj, no latent norms
    ("torch_dist_tp2_dp2_mla_distopt", dict(tp=1, pp=1, dp=2), "dp_reshardable"),
    ("torch_dist_mla_moe_tp2_ep2", dict(tp=1, pp=3, dp=2, ep=2, optimizer="fully_reshardable"), "fully_reshardable"),
    # DeepSeek-V3 shaped (ungated shared expert, 8 experts in 2 groups, random expert bias): PP2 x EP2 x DP2
    ("torch_dist_deepseek_v3_tp2_ep2", dict(tp=1, pp=2, dp=2, ep=2), "adam"),
    # shared experts + gate, expert bias, layer 0 dense: TP1 x EP1; PP3 (a layer per stage) with expert TP kept
    # apart (1); expert TP = TP (2) with the experts' fc1 halves split
    ("torch_dist_moe_tp2_ep2_shared_distopt", dict(tp=1, pp=1, dp=1, ep=1), "dp_reshardable"),
    ("torch_dist_moe_tp2_ep2_shared_distopt", dict(tp=1, pp=3, dp=2, ep=2, optimizer="fully_reshardable"),
     "fully_reshardable"),
    ("torch_dist_moe_tp2_ep2_shared_distopt", dict(tp=2, pp=1, dp=2, ep=2, etp=2), "dp_reshardable"),
    ("torch_dist_moe_tp2_ep2_shared_distopt", dict(tp=1, pp=1, dp=2, ep=1, etp=2), "dp_reshardable"),  # expert TP > TP
    # every layer MoE (stacked keys), bf16 weights with an fp32 expert bias
    ("torch_dist_moe_ep2_shared_bf16", dict(tp=2, pp=2, dp=1, ep=2, etp=1, optimizer="fully_reshardable"),
     "fully_reshardable"),
    # several DDP buckets (--overlap-grad-reduce --ddp-bucket-size 3000): kept where Megatron buckets (stage 0)
    ("torch_dist_dp2_distopt_buckets", dict(tp=2, pp=1, dp=2), "dp_reshardable"),
    ("torch_dist_dp2_distopt_buckets", dict(tp=1, pp=2, dp=1, optimizer="adam"), "adam"),
    ("legacy_dp2_distopt_buckets", dict(tp=1, pp=2, dp=2), "dp_reshardable"),
    # --moe-grouped-gemm under the local spec (SequentialMLP, the flag kept in args)
    ("torch_dist_moe_ep2_grouped_gemm_local", dict(tp=1, pp=1, dp=2, ep=1), "dp_reshardable"),
    # legacy files with EP (mp_rank_TT_EEE, a chained [dense, experts] Adam): TP1 x EP1; expert TP = TP at EP 2
    ("legacy_moe_tp2_ep2_shared", dict(tp=1, pp=1, dp=1, ep=1), "adam"),
    ("legacy_moe_tp2_ep2_shared", dict(tp=2, pp=1, dp=2, ep=2, etp=2, optimizer="dp_reshardable"), "dp_reshardable"),
    # with the distributed optimizer (distrib_optim.pt = [dense, experts]): kept as dp_reshardable; plain Adam at PP 3
    ("legacy_moe_tp2_ep2_shared_distopt", dict(tp=1, pp=1, dp=2, ep=2), "dp_reshardable"),
    ("legacy_moe_tp2_ep2_shared_distopt", dict(tp=1, pp=3, dp=1, ep=1, optimizer="adam"), "adam"),
    # every rank's file (EP carved out of DP, expert TP = TP): the dense parts from DP rank 0's, to EP 4 x expert TP 1
    ("legacy_moe_tp2_dp2_ep2", dict(tp=1, pp=1, dp=4, ep=4, etp=1, optimizer="fully_reshardable"), "fully_reshardable"),
    # a multi-token-prediction layer (on the last stage, after the final norm; keys per MTP layer)
    ("torch_dist_mtp1", dict(tp=2, pp=2, dp=1), "adam"),
    ("torch_dist_mtp1", dict(tp=2, pp=1, dp=2, optimizer="dp_reshardable"), "dp_reshardable"),
    # legacy MTP over two stages with the distributed optimizer (the embedding copy read, checked, merged)
    ("legacy_pp2_dp2_mtp1_distopt", dict(tp=2, pp=1, dp=2), "dp_reshardable"),
    # DeepSeek-V3 shaped with an MTP layer of MLA + MoE: TP1 x EP1 (its experts join the dense optimizer and
    # buffer); PP2 (the MTP layer, experts too, on the last stage); its experts in the expert buckets, after
    # the decoder's
    ("torch_dist_deepseek_v3_mtp_tp2_ep2", dict(tp=1, pp=1, dp=1, ep=1), "adam"),
    ("torch_dist_deepseek_v3_mtp_tp2_ep2", dict(tp=1, pp=2, dp=2, ep=2), "adam"),
    ("torch_dist_deepseek_v3_mtp_tp2_ep2", dict(tp=2, pp=1, dp=2, ep=2, etp=2, optimizer="dp_reshardable"),
     "dp_reshardable"),
]


@pytest.mark.parametrize("fixture,topology,kind", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_resharded_equals_the_oracle(tmp_path, fixture, topology, kind):
    report = reshard(FIXTURES / fixture, tmp_path, to="megatron", ckpt_format="torch_dist", **topology)
    out = report.out_dir
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "3"
    it = out / "iter_0000003"
    assert (it / "metadata.json").read_bytes() == b'{"sharded_backend": "torch_dist", "sharded_backend_version": 1}'
    world = topology["tp"] * topology["pp"] * topology["dp"]
    assert sorted(p.name for p in it.glob("*.distcp")) == sorted(f"__{r}_0.distcp" for r in range(world))
    reader = MegatronReader.open(out)
    reader.check()
    assert reader.src.sharding == kind
    assert (reader.arch.tp, reader.arch.pp, reader.arch.dp) == (topology["tp"], topology["pp"], topology["dp"])
    if "etp" in topology:
        assert reader.arch.etp == reader.args.expert_tensor_parallel_size == topology["etp"]
    assert compare_megatron(reader, fixture) > 0
    manifest = json.loads((out / "reshard-manifest.json").read_text())
    assert manifest["optimizer"] == kind


def test_common_state_args_follow_the_target(tmp_path):
    out = reshard(FIXTURES / "torch_dist_tp2_pp2", tmp_path, to="megatron", tp=1, pp=2, dp=2,
                  optimizer="dp_reshardable").out_dir
    r = MegatronReader.open(out)
    a = r.args
    assert (a.tensor_model_parallel_size, a.pipeline_model_parallel_size, a.data_parallel_size, a.world_size) == (1, 2, 2, 4)
    assert a.use_distributed_optimizer and r.src.common["content_metadata"]["distrib_optim_sharding_type"] == "dp_reshardable"
    assert r.src.common["iteration"] == 3 and r.step(r.names[1]) == 3.0
    # the rng states are kept only where Megatron would load them (TP and PP unchanged)
    assert not any(k.startswith("rng_state") for k in r.src.ck.objects)


def test_same_topology_keeps_rng_and_rerun_state(tmp_path):
    out = reshard(FIXTURES / "torch_dist_tp2_dp2_distopt", tmp_path, to="megatron").out_dir
    r = MegatronReader.open(out)
    assert sum(k.startswith("rng_state") for k in r.src.ck.objects) == 2
    assert sum(k.startswith("rerun_state_machine_state") for k in r.src.ck.objects) == 4


def test_moe_same_topology_is_megatrons_layout(tmp_path):
    """TP2 x EP2 folded (expert TP 1) written again at its own topology: the same keys, chunks, files
    and bucket objects as Megatron's save, the expert bias fp32 without optimizer state."""
    fixture = "torch_dist_moe_tp2_ep2_shared_distopt"
    src = MegatronReader.open(FIXTURES / fixture).src
    out = MegatronReader.open(reshard(FIXTURES / fixture, tmp_path, to="megatron").out_dir)
    assert (out.arch.tp, out.arch.ep, out.arch.etp, out.arch.dp) == (2, 2, 1, 1)
    assert set(out.src.ck.tensors) == set(src.ck.tensors) and set(out.src.ck.objects) == set(src.ck.objects)
    for key, e in src.ck.tensors.items():
        if ".bucket_idx_" in key:  # the distributed optimizer spreads gaps over chunks of its own
            continue
        got = out.src.ck.tensors[key]
        assert (got.shape, got.dtype) == (e.shape, e.dtype), key
        assert sorted((c.offsets, c.sizes, c.file) for c in got.chunks) == sorted(
            (c.offsets, c.sizes, c.file) for c in e.chunks), key
    for key in src.ck.objects:
        if ".per_bucket_numel" in key:
            assert out.src.obj(key) == src.obj(key), key
    assert out.states("decoder.layers.1.mlp.router.expert_bias") == ("weight",)
    assert not any("expert_bias" in n for g in out.param_groups() for n in g["params"])
    assert compare_megatron(out, fixture) > 0


def test_moe_through_ep1_and_back_keeps_the_expert_groups(tmp_path):
    """EP=2 -> EP=1 (one optimizer, experts in the dense groups) -> EP=2: the expert optimizer's
    groups come back as the dense ones flagged is_expert_parallel, the state bit-exact."""
    fixture = "torch_dist_moe_ep2_distopt"
    one = reshard(FIXTURES / fixture, tmp_path / "a", to="megatron", ep=1).out_dir
    r1 = MegatronReader.open(one)
    assert not r1.arch.expert_apart and not any(k.startswith("chained_") for k in r1.src.ck.tensors)
    assert [g["is_expert_parallel"] for g in r1.param_groups()] == [False, False]
    back = MegatronReader.open(reshard(one, tmp_path / "b", to="megatron", ep=2).out_dir)
    src = MegatronReader.open(FIXTURES / fixture)
    strip = ("params", "step")
    assert [{k: v for k, v in g.items() if k not in strip} for g in back.param_groups()] == [
        {k: v for k, v in g.items() if k not in strip} for g in src.param_groups()]
    assert compare_megatron(back, fixture) > 0


def test_impossible_topologies_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match="query groups do not divide over TP=4"):
        reshard(FIXTURES / "torch_dist_tp2_pp2", tmp_path, to="megatron", tp=4)
    with pytest.raises(ReshardError, match="optimizer"):
        reshard(FIXTURES / "torch_dist_tp2_pp2", tmp_path, to="megatron", optimizer="sgd")
    assert not any(tmp_path.iterdir())


def _bucket_sizes(reader: MegatronReader) -> dict[str, list[int]]:
    """``{dp_group_idx: [unpadded size of each bucket]}`` of a dp_reshardable checkpoint."""
    import re

    out: dict[str, dict[int, int]] = {}
    for k, e in reader.src.ck.tensors.items():
        m = re.search(r"dp_group_idx_(\d+)\.gbuf_idx_0\..*\.bucket_idx_(\d+)\.param$", k)
        if m:
            out.setdefault(m.group(1), {})[int(m.group(2))] = e.shape[0]
    return {g: [v[i] for i in sorted(v)] for g, v in sorted(out.items())}


def test_several_buckets_are_written_as_megatron_cuts_them(tmp_path):
    """The source's bucket args kept: at the source's topology the same buckets (sizes recorded by
    Megatron's own per_bucket_numel_unpadded); at PP 2 only stage 0 is cut (Megatron buckets no later
    stage); the layout's records say so."""
    src = MegatronReader.open(FIXTURES / "torch_dist_dp2_distopt_buckets")
    saved = src.src.obj("optimizer.distributed.dp_group_idx_0.per_bucket_numel_unpadded/shard_0_1")
    assert list(saved[0].values())[0] == _bucket_sizes(src)["0"] == [3072, 4672, 3648, 6080]
    same = MegatronReader.open(reshard(FIXTURES / "torch_dist_dp2_distopt_buckets", tmp_path / "a", to="megatron",
                                       tp=1, pp=1, dp=2).out_dir)
    assert _bucket_sizes(same) == _bucket_sizes(src)
    assert same.src.obj("optimizer.distributed.dp_group_idx_0.per_bucket_numel_unpadded/shard_0_1") == saved
    staged = MegatronReader.open(reshard(FIXTURES / "torch_dist_dp2_distopt_buckets", tmp_path / "b",
                                         to="megatron", tp=1, pp=2, dp=2).out_dir)
    sizes = _bucket_sizes(staged)
    assert len(sizes["0"]) > 1 and len(sizes["1"]) == 1
    assert compare_megatron(staged, "torch_dist_dp2_distopt_buckets") > 0


def test_fully_reshardable_with_several_buckets_is_refused(tmp_path):
    """Megatron-Core 0.19.2 reads a fully_reshardable optimizer with several buckets shifted: not written."""
    with pytest.raises(ReshardError, match="fully_reshardable optimizer with several DDP buckets"):
        reshard(FIXTURES / "torch_dist_dp2_distopt_buckets", tmp_path / "out", to="megatron", tp=1, pp=1, dp=2,
                optimizer="fully_reshardable")
    assert not (tmp_path / "out").exists()


def test_te_grouped_gemm_buckets_are_not_written(tmp_path):
    """A Transformer Engine --moe-grouped-gemm source (plain Adam: read) is not written as dp_reshardable
    buckets, whose order TEGroupedMLP changes; plain Adam is."""
    import argparse
    import shutil

    from .test_bad_input import _common, _plant

    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "torch_dist_moe_ep2", src, ignore=shutil.ignore_patterns("oracle"))
    common = _common(src / "iter_0000003")
    args = argparse.Namespace(**vars(common["args"]))
    args.moe_grouped_gemm, args.transformer_impl = True, "transformer_engine"
    _plant(src / "iter_0000003", "common_state/shard_0_1", dict(common, args=args))
    with pytest.raises(ReshardError, match="dp_reshardable from a source of grouped-GEMM experts under Transformer"):
        reshard(src, tmp_path / "out", to="megatron", tp=1, pp=1, dp=2, optimizer="dp_reshardable")
    assert not (tmp_path / "out").exists()
    out = reshard(src, tmp_path / "adam", to="megatron", tp=1, pp=1, dp=2, ep=1).out_dir
    r = MegatronReader.open(out)
    assert r.args.moe_grouped_gemm and compare_megatron(r, "torch_dist_moe_ep2") > 0
