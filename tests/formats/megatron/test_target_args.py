"""A Megatron target's ``args`` are what Megatron's own ``validate_args`` leaves at the target's
topology: a fixture resharded to the topology of another fixture of the same model and recipe
(written by Megatron-Core there) has that fixture's args, every one of them but the save path.

Megatron-Core 0.19.2 derives from the parallel sizes (``training/arguments.py``): the world and DP
sizes, ``transformer_pipeline_model_parallel_size``, the weight shards of TP and expert TP
(``tensor_parallel_num_weight_shards = tp * gtp_weight_remat_size``, resp. for experts),
``inprocess_active_world_size`` (its argparse default is ``WORLD_SIZE``), expert TP (TP unless
given), sequence parallelism (off at TP 1), the virtual stages' fields and the interleaved
schedule's flags; a global batch that was not given is ``micro_batch_size * dp``.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from reshard.errors import CheckpointError
from reshard.formats.megatron.common import args_for
from reshard.formats.megatron.legacy import LegacyBackend
from reshard.formats.megatron.model import Arch
from reshard.formats.megatron.reader import MegatronReader
from reshard.jobs.convert import reshard

from .support import FIXTURES

TOPOLOGY_ARGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size", "world_size",
                 "transformer_pipeline_model_parallel_size", "tensor_parallel_num_weight_shards",
                 "expert_tensor_parallel_size", "expert_tensor_parallel_num_weight_shards",
                 "inprocess_active_world_size", "virtual_pipeline_model_parallel_size",
                 "num_layers_per_virtual_pipeline_stage", "overlap_p2p_comm", "align_param_gather",
                 "use_distributed_optimizer", "dist_ckpt_optim_fully_reshardable")

# (source, target topology, the fixture Megatron wrote at that topology from the same model and recipe)
PAIRS = [
    ("torch_dist_tp2_dp2_distopt", dict(tp=1, pp=2, dp=2), "torch_dist_pp2_dp2_distopt"),
    ("torch_dist_pp2_dp2_distopt", dict(tp=2, pp=1, dp=2), "torch_dist_tp2_dp2_distopt"),
    ("torch_dist_tp2_dp2_distopt", dict(tp=1, pp=1, dp=2, optimizer="fully_reshardable"),
     "torch_dist_dp2_fully_reshardable"),
    ("torch_dist_tp2_pp2", dict(tp=1, pp=2, dp=1, vpp=2), "torch_dist_pp2_vpp2"),
    ("torch_dist_pp2_vpp2", dict(tp=2, pp=2, dp=1, vpp=1), "torch_dist_tp2_pp2"),
    ("torch_dist_tp2_mla", dict(tp=2, pp=1, dp=2, optimizer="dp_reshardable"), "torch_dist_tp2_dp2_mla_distopt"),
    ("torch_dist_tp2_dp2_mla_distopt", dict(tp=2, pp=1, dp=1, optimizer="adam"), "torch_dist_tp2_mla"),
    ("legacy_tp2_pp2", dict(tp=1, pp=2, dp=1, vpp=2, ckpt_format="torch"), "legacy_pp2_vpp2"),
    ("legacy_pp2_vpp2", dict(tp=2, pp=2, dp=1, vpp=1, ckpt_format="torch"), "legacy_tp2_pp2"),
]

# a legacy output whose ranks changed carries no RNG states and says so (Megatron then loads with --no-load-rng)
_NOT_TOPOLOGY = {"save", "no_save_rng"}


def _differences(got: Any, want: Any) -> dict[str, tuple]:
    a, b = vars(got), vars(want)
    return {k: (a.get(k, "<missing>"), b.get(k, "<missing>")) for k in sorted(set(a) | set(b))
            if k not in _NOT_TOPOLOGY and repr(a.get(k, "<missing>")) != repr(b.get(k, "<missing>"))}


@pytest.mark.parametrize("source,topology,target", PAIRS, ids=[f"{p[0]}-to-{p[2]}" for p in PAIRS])
def test_args_are_megatrons_at_the_target_topology(tmp_path, source, topology, target):
    src, want = MegatronReader.open(FIXTURES / source), MegatronReader.open(FIXTURES / target)
    changed = [k for k in TOPOLOGY_ARGS if getattr(src.args, k, None) != getattr(want.args, k, None)]
    assert "tensor_parallel_num_weight_shards" in changed or "inprocess_active_world_size" in changed or \
        "transformer_pipeline_model_parallel_size" in changed, changed  # the pair tests a derived field
    out = MegatronReader.open(reshard(FIXTURES / source, tmp_path / "out", to="megatron", **topology).out_dir)
    assert {k: getattr(out.args, k, None) for k in TOPOLOGY_ARGS} == {k: getattr(want.args, k, None)
                                                                      for k in TOPOLOGY_ARGS}
    assert _differences(out.args, want.args) == {}
    if isinstance(want.src, LegacyBackend):  # every file's args: the same but the saving rank
        assert isinstance(out.src, LegacyBackend) and set(out.src.files) == set(want.src.files)
        for key in want.src.files:
            got, exp = out.src.state_dict(key)["args"], want.src.state_dict(key)["args"]
            # local_rank is the saving process's rank on its node (a launch fact, not the topology's): kept
            assert got.rank == exp.rank and _differences(got, exp).keys() <= {"local_rank"}, key


def _arch(args: Any, **sizes: int) -> Arch:
    import dataclasses
    return dataclasses.replace(Arch.from_args(args, "test"), **sizes)


def test_fields_whose_default_is_the_run_size_follow_it_unless_set_apart():
    """``inprocess_active_world_size`` and a global batch that was not given follow the target's
    sizes; values the source set apart from its own topology are the user's and are kept."""
    args = copy.copy(MegatronReader.open(FIXTURES / "torch_dist_tp2_dp2_distopt").args)
    assert args._is_global_batch_size_explicitly_specified and args.global_batch_size == 4
    out = args_for(args, _arch(args, tp=1, etp=1, dp=4), "dp_reshardable")
    assert (out.world_size, out.inprocess_active_world_size, out.global_batch_size) == (4, 4, 4)
    assert (out.tensor_parallel_num_weight_shards, out.expert_tensor_parallel_num_weight_shards) == (1, 1)
    args._is_global_batch_size_explicitly_specified = False  # Megatron derived it: micro batch 2 x DP 2
    out = args_for(args, _arch(args, tp=1, etp=1, dp=4), "dp_reshardable")
    assert (out.global_batch_size, out.eval_global_batch_size) == (8, 8)
    args.inprocess_active_world_size = 3  # a warm reserve the user set
    assert args_for(args, _arch(args, tp=1, etp=1, dp=4), "dp_reshardable").inprocess_active_world_size == 3


def test_sequence_parallel_and_tp_comm_overlap_are_off_at_tp1():
    args = copy.copy(MegatronReader.open(FIXTURES / "torch_dist_moe_tp2_ep2_shared_distopt").args)
    assert args.sequence_parallel and args.expert_tensor_parallel_size == 1
    args.tp_comm_overlap = True
    out = args_for(args, _arch(args, tp=1, etp=1), "dp_reshardable")
    assert (out.sequence_parallel, out.tp_comm_overlap) == (False, False)
    assert (out.tensor_parallel_num_weight_shards, out.expert_tensor_parallel_num_weight_shards) == (1, 1)
    kept = args_for(args, _arch(args, tp=2, etp=2), "dp_reshardable")
    assert (kept.sequence_parallel, kept.tp_comm_overlap) == (True, True)
    assert (kept.tensor_parallel_num_weight_shards, kept.expert_tensor_parallel_num_weight_shards) == (2, 2)


@pytest.mark.parametrize("field", ["gtp_weight_remat_size", "expert_gtp_weight_remat_size"])
def test_weights_sharded_beyond_tp_are_refused_by_name(field):
    """Generalized tensor parallelism (``--tensor-parallel-num-weight-shards`` > TP) shards each
    weight over TP x GTP ranks, padded: not read, so never written with a world that drops it."""
    args = copy.copy(MegatronReader.open(FIXTURES / "torch_dist_tp2_dp2_distopt").args)
    setattr(args, field, 2)
    with pytest.raises(CheckpointError, match=f"args.{field} = 2: .*sharded beyond"):
        Arch.from_args(args, "planted")
