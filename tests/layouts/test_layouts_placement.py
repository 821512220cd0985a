"""Expert placement (DeepSpeed AutoEP's descriptor and its affine lowering), pipeline stage
placement, and the global rank order of ``reshard.layouts.topology.Topology`` against DeepSpeed's."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from reshard import ParamMap
from reshard.errors import MapError, TopologyError
from reshard.ir import canonicalize
from reshard.layouts import autoep_placement, expert_placement, pipeline_stage, uniform_experts
from reshard.layouts.topology import Topology
from tests.support import oracles

autoep = pytest.importorskip("deepspeed.checkpoint.autoep_affine")


def _placements():
    yield 8, uniform_experts(8, 4)
    yield 6, [[0, 1, 2], [3, 4, 5]]
    yield 4, [[3, 1], [0, 2]]  # non-contiguous, permuted local order
    yield 5, [[0, 1, 2], [2, 3, 4]]  # expert 2 replicated on both ranks
    yield 6, [[0, 1, 2, 3], [2, 3, 4, 5], [5, 0]]  # replicated runs
    yield 8, [[0, 1, 2, 3, 4, 5, 6, 7]] * 3  # every expert everywhere
    rng = random.Random(5)
    for _ in range(10):
        ne, ep = rng.randint(1, 9), rng.randint(1, 5)
        ranks = [sorted(rng.sample(range(ne), rng.randint(0, ne))) for _ in range(ep)]
        for e in range(ne):  # every expert somewhere
            if not any(e in r for r in ranks):
                ranks[rng.randrange(ep)].append(e)
        for r in ranks:
            rng.shuffle(r)
        yield ne, ranks


@pytest.mark.parametrize("num_experts,experts", list(_placements()))
def test_expert_placement_matches_autoep(num_experts, experts):
    for tail in [(3, 4), (5,), ()]:
        shape = (num_experts, *tail)
        desc = autoep.make_autoep_placement_descriptor(num_experts, experts)
        theirs = autoep.autoep_placement_to_affine_map(desc, shape)
        full = oracles.random_full(shape, num_experts)
        # the packed local tensor, expert by expert, is what an EP rank holds
        want = {r: (torch.stack([full[e] for e in ex]) if ex else full.new_zeros((0, *tail)))
                for r, ex in enumerate(experts)}
        for r in want:
            assert torch.equal(theirs.extract(full, r), want[r])
        m = autoep_placement(desc, shape)
        assert m == expert_placement(shape, experts)
        oracles.verify(m, full, want, deepspeed=True)
        # DeepSpeed's lowering, canonicalized, is the same map
        assert canonicalize(ParamMap.from_dict(theirs.to_dict())) == m


def test_expert_placement_pieces_and_global_ranks():
    m = expert_placement((6, 2), [[0, 1, 2, 3], [2, 3, 4, 5]], ranks=[4, 12])
    got = [(r, p.source.offset, p.numel, sorted(p.locations)) for r, _, p in m.pieces()]
    # experts 2-3 are one piece naming both holders; the runs beside them stay private
    assert got == [(4, 0, 4, [4]), (4, 4, 4, [4, 12]), (12, 4, 4, [4, 12]), (12, 8, 4, [12])]
    legacy = autoep.legacy_uniform_autoep_placement_descriptor(8, 2, 4)
    assert autoep_placement(legacy, (8, 3)) == expert_placement((8, 3), uniform_experts(8, 4))


def test_expert_placement_refusals():
    with pytest.raises(MapError, match="placed on no rank"):
        expert_placement((4, 2), [[0, 1], [2]])
    with pytest.raises(MapError, match="twice"):
        expert_placement((4, 2), [[0, 1, 1], [2, 3]])
    with pytest.raises(MapError):
        autoep_placement({"version": 2}, (4, 2))


# -- topology -------------------------------------------------------------------------------------


def _topologies():
    for pp, dp, tp in itertools.product([1, 2, 3], [1, 2, 4], [1, 2, 4]):
        for ep in (1, 2, 4):
            if dp % ep == 0:
                yield pp, dp, tp, ep


@pytest.mark.parametrize("pp,dp,tp,ep", list(_topologies()))
def test_topology_matches_deepspeed(pp, dp, tp, ep):
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    from deepspeed.utils.groups import _get_expert_parallel_ranks

    theirs = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    assert theirs.get_axis_names() == ["pipe", "data", "model"]
    t = Topology(pp, dp, tp, ep)
    assert t.world_size == theirs.world_size()
    for r in range(t.world_size):
        c = theirs.get_coord(r)
        assert (t.coord(r).pipe, t.coord(r).data, t.coord(r).model) == (c.pipe, c.data, c.model)
        assert t.rank(c.pipe, c.data, c.model) == r
        assert t.stage(r) == c.pipe and t.dp_rank(r) == c.data and t.tp_rank(r) == c.model
    assert sorted(t.tp_groups()) == sorted(tuple(g) for g in theirs.get_axis_comm_lists("model")) or tp == 1
    assert sorted(t.dp_groups()) == sorted(tuple(g) for g in theirs.get_axis_comm_lists("data")) or dp == 1
    assert sorted(t.pp_groups()) == sorted(tuple(g) for g in theirs.get_axis_comm_lists("pipe")) or pp == 1
    for s in range(pp):
        assert t.stage_ranks(s) == tuple(theirs.filter_match(pipe=s))
    ep_groups, edp_groups = _get_expert_parallel_ranks(t.world_size, tp, ep, pp)
    assert sorted(t.ep_groups()) == sorted(tuple(g) for g in ep_groups)
    assert sorted(t.expert_dp_groups()) == sorted(tuple(g) for g in edp_groups)
    for r in range(t.world_size):
        assert r in t.tp_group(r) and r in t.dp_group(r) and r in t.ep_group(r)
        assert t.ep_group(r)[t.ep_rank(r)] == r


def test_topology_refusals():
    with pytest.raises(TopologyError):
        Topology(1, 3, 1, ep=2)
    with pytest.raises(TopologyError):
        Topology(0, 1, 1)
    with pytest.raises(TopologyError):
        Topology(2, 2, 2).coord(8)


def test_pipeline_stage_placement():
    t = Topology(pp=3, dp=2, tp=2)
    m = pipeline_stage((4, 3), t, 1)
    assert m.ranks == (4, 5, 6, 7)
    assert all(p.locations == frozenset({4, 5, 6, 7}) for _, _, p in m.pieces())
    full = oracles.random_full((4, 3), 0)
    oracles.verify(m, full, {r: full for r in m.ranks}, deepspeed=True)
    tied = pipeline_stage((4, 3), t, [0, 2])  # embeddings tied between first and last stage
    assert tied.ranks == (0, 1, 2, 3, 8, 9, 10, 11)
    oracles.verify(tied, full, {r: full for r in tied.ranks})
