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
]


@pytest.mark.parametrize("fixture,topology,kind", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_resharded_equals_the_oracle(tmp_path, fixture, topology, kind):
    report = reshard(FIXTURES / fixture, tmp_path, to="megatron", **topology)
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
