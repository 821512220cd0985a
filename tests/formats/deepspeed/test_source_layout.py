"""The reader's one layout (``layout.source``: built from ``param_shapes``, outer map x partition
group x rule) gives every optimizer map and every fragment's place: for each ZeRO-1/2 kind
(dense, AutoTP, pipeline, TP x PP, AutoEP, classic MoE) every parameter's fragment on every rank
lies where the rank's own ``param_slice_mappings`` records it, under its local name for a classic
MoE expert; ZeRO-3 (no recorded offsets) follows its sub-groups end to end."""

from __future__ import annotations

import pytest

from reshard.formats.deepspeed.reader import DeepSpeedReader
from reshard.ir.piece import prod
from tests.support.paths import DEEPSPEED

ZERO12 = ["llama_tp2_dp2", "llama_zero1_dp2_bf16", "llama_zero2_dp2", "pipe_pp2_dp2_bf16_odd", "tp_pipe_tp2_pp2",
          "mixtral_autoep_ep2_dp4", "moe_ep2_dp4"]
ZERO3 = ["llama_zero3_dp3", "llama_zero3_tp2_dp2", "mixtral_autoep_ep2_zero3"]


def _reader(name: str) -> DeepSpeedReader:
    r = DeepSpeedReader.open(DEEPSPEED / name)
    r.check()
    return r


@pytest.mark.parametrize("name", ZERO12)
def test_every_fragment_lies_where_the_files_record_it(name):
    r = _reader(name)
    ck, seen = r.ck, 0
    for n in r.names:
        if not ck.has_optimizer_state(n):
            continue
        m = r.map(n, "fp32")
        m.check()
        local = q.local if (q := ck.moe_param(n)) is not None else n
        for g, shard in m.shards.items():
            d, t = divmod(g, ck.mp)
            k, start = ck.layout.locate(n, g)
            f = ck.osd(t, d)["param_slice_mappings"][k][local]
            assert (start, shard.numel) == (int(f.start), int(f.numel)), (n, g)
            seen += 1
    assert seen >= len(r.names)


@pytest.mark.parametrize("name", ZERO3)
def test_zero3_fragments_follow_the_recorded_sub_groups(name):
    r = _reader(name)
    ck = r.ck
    for n in r.names:
        m = r.map(n, "fp32")
        m.check()
        for g, shard in m.shards.items():
            d, t = divmod(g, ck.mp)
            k, start = ck.layout.locate(n, g)
            sub = ck.groups(t)[k]  # the sub-group: its parameters' partitions end to end, ceil(numel / size) each
            size = len(ck.layout.units[k].group.members[0])
            shapes = list(sub.values()) if ck.experts is None or k not in ck.experts.groups else \
                [ck.experts.params[x].shard_shape(ck.layout.units[k].group.place(g)[0]) for x in sub]
            parts = [-(-prod(s) // size) for s in shapes]
            i = list(sub).index(n)
            assert start == sum(parts[:i]) and shard.numel <= parts[i], (n, g)
