"""Plain tensor-parallel layouts against DeepSpeed 0.19.8: AutoTP's split sizes, replicated and
pre-divided tensors, contiguous splits on any dim, VocabParallel partition sizes, legacy padded
vocabularies and ``TensorParallelConv2d``."""

from __future__ import annotations

import itertools

import pytest
import torch

from reshard.errors import MapError
from reshard.layouts import (
    autotp_shard_sizes,
    autotp_split,
    conv2d_bias,
    conv2d_split_sizes,
    conv2d_weight,
    even_sizes,
    near_even_sizes,
    padded_vocab,
    padded_vocab_rows,
    prescaled_bias,
    replicated,
    split,
    vocab_parallel,
)
from tests.support import oracles

TPS = [1, 2, 3, 4, 5, 6, 7, 8, 16]

# Layer names DeepSpeed treats specially (head rule off) and the flag the builder takes instead.
NAMES = {None: True, "model.layers.0.self_attn.q_proj": True, "model.layers.0.mlp.up_proj": False,
         "lm_head": False, "block_sparse_moe.experts.0.w1": False}


def test_autotp_sizes_equal_deepspeed_across_sweeps():
    cases = 0
    for tp in TPS:
        for total in list(range(0, 50)) + [64, 96, 100, 128, 4096, 4097, 11008, 14336]:
            for kv in (None, 1, 2, 3, 4, 8, 12, 32):
                for grain in (1, 2, 3, 8, 64):
                    for name, aware in NAMES.items():
                        try:
                            want = oracles.shard_size_list(total, tp, num_kv_heads=kv, grain=grain, name=name)
                        except (AssertionError, ZeroDivisionError):
                            continue
                        got = autotp_shard_sizes(total, tp, num_kv_heads=kv, grain=grain, head_aware=aware)
                        assert got == want, (total, tp, kv, grain, name)
                        cases += 1
    assert cases > 30_000


def test_split_sizes_helpers():
    assert near_even_sizes(10, 4) == [3, 3, 2, 2]
    assert even_sizes(12, 4) == [3, 3, 3, 3]
    with pytest.raises(MapError):
        even_sizes(10, 4)
    # TensorParallelConv2d puts the remainder on the last ranks
    assert conv2d_split_sizes(10, 4) == [2, 2, 3, 3]
    assert padded_vocab_rows(50257, 8, divisible_by=128) == 50176 + 1024


@pytest.mark.parametrize("tp", TPS)
def test_replicated_and_prescaled(tp):
    for shape in [(6, 4), (5,), (), (2, 3, 4)]:
        full = oracles.random_full(shape, tp)
        m = replicated(shape, tp)
        assert m.num_pieces == tp and all(p.locations == frozenset(range(tp)) for _, _, p in m.pieces())
        oracles.verify(m, full, {r: full.clone() for r in range(tp)}, deepspeed=tp <= 4 and shape != ())
        b = prescaled_bias(shape, tp)
        exact = tp & (tp - 1) == 0  # division by a power of two is exact
        oracles.verify(b, full, {r: full / float(tp) for r in range(tp)}, exact=exact, deepspeed=exact and shape != ())
        assert all(p.scale == 1.0 / tp for _, _, p in b.pieces())


def test_replicated_relabelled():
    m = replicated((4, 4), [3, 7, 11])
    assert m.ranks == (3, 7, 11)
    assert all(p.locations == frozenset({3, 7, 11}) for _, _, p in m.pieces())


@pytest.mark.parametrize("tp", TPS)
def test_uneven_split_any_dim_matches_torch_split(tp):
    for shape in [(13, 6), (6, 13), (3, 10, 4), (2, 3, 17, 2), (17,)]:
        full = oracles.random_full(shape, tp)
        for dim in range(len(shape)):
            sizes = near_even_sizes(shape[dim], tp)
            if tp > 1 and shape[dim] >= tp:
                sizes[0], sizes[-1] = sizes[0] - 1, sizes[-1] + 1  # make it properly uneven
            m = split(shape, dim, sizes)
            want = dict(enumerate(full.split(sizes, dim)))
            oracles.verify(m, full, {r: t.contiguous() for r, t in want.items()}, deepspeed=tp in (2, 3))
            assert all(len(s.pieces) == (1 if sizes[r] else 0) for r, s in m.shards.items())


def test_split_piece_form():
    # A row split is one flat piece per rank; a column split keeps its row stride.
    rows = split((8, 6), 0, [4, 4])
    assert [(p.shape, p.source.strides, p.dest.strides) for _, _, p in rows.pieces()] == [((24,), (1,), (1,))] * 2
    cols = split((8, 6), 1, [2, 4])
    got = [(p.shape, p.source.offset, p.source.strides, p.dest.strides) for _, _, p in cols.pieces()]
    assert got == [((8, 2), 0, (6, 1), (2, 1)), ((8, 4), 2, (6, 1), (4, 1))]


@pytest.mark.parametrize("tp", TPS)
def test_autotp_linear_layers(tp):
    """LinearLayer (dim 0, column parallel) and LinearAllreduce (dim 1, row parallel) cut with
    ``get_shard_size_list``; q/k/v with kv heads, MLP and lm_head names with the head rule off."""
    for (rows, cols), kv, grain, name in itertools.product([(64, 48), (96, 40), (30, 16)], [None, 2, 8],
                                                          [1, 8], [None, "model.layers.0.mlp.up_proj", "lm_head"]):
        m_ds = oracles.meta(kv, grain=grain)
        for dim in (0, 1):
            full = oracles.random_full((rows, cols), tp + rows)
            try:
                want = {r: oracles.linear_split(full, dim, tp, r, m_ds, name).contiguous() for r in range(tp)}
            except AssertionError:
                continue
            m = autotp_split((rows, cols), dim, tp, num_kv_heads=kv, grain=grain, head_aware=NAMES[name])
            oracles.verify(m, full, want, deepspeed=tp == 2 and grain == 1 and kv == 2)


@pytest.mark.parametrize("tp", TPS)
def test_vocab_parallel_prefix_sums(tp):
    for vocab, hidden in [(100, 8), (128, 4), (7, 3)]:
        sizes = oracles.shard_size_list(vocab, tp, name="lm_head")
        full = oracles.random_full((vocab, hidden), tp)
        m = vocab_parallel((vocab, hidden), sizes)
        for r in range(tp):
            start = sum(sizes[:r])  # VocabParallelEmbedding.vocab_start_index
            ps = m.shard(r).pieces
            if sizes[r]:
                assert len(ps) == 1 and ps[0].source.offset == start * hidden
        oracles.verify(m, full, {r: t.contiguous() for r, t in enumerate(full.split(sizes, 0))}, deepspeed=tp <= 3)


@pytest.mark.parametrize("tp", TPS)
def test_padded_vocab(tp):
    for vocab, hidden, div in [(13, 4, 1), (50, 3, 4), (64, 2, 8), (1, 5, 1)]:
        rows = padded_vocab_rows(vocab, tp, divisible_by=div)
        assert rows % (tp * div) == 0 and rows - vocab < tp * div
        logical = oracles.random_full((rows, hidden), tp)
        logical[vocab:] = float("nan")  # legacy TP promises nothing about padding rows
        m = padded_vocab((vocab, hidden), tp, divisible_by=div)
        assert m.logical_shape == (rows, hidden) and m.valid_shape == (vocab, hidden)
        want = {r: t.contiguous() for r, t in enumerate(logical.chunk(tp, 0))}
        oracles.verify(m, logical.nan_to_num(nan=0.0), {r: t.nan_to_num(nan=0.0) for r, t in want.items()},
                       deepspeed=tp <= 4)
        # The real rows come back without reading a single padding row.
        got = m.rebuild(want, valid_only=True, verify=False)
        assert torch.equal(got, logical[:vocab])


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 5, 8])
def test_conv2d(tp):
    for oc, ic, k in [(10, 7, 3), (16, 16, 1), (5, 9, 2)]:
        full_w = oracles.random_full((oc, ic, k, k), tp)
        full_b = oracles.random_full((oc,), tp + 1)
        for by_oc in (True, False):
            if min(oc, ic) < tp:
                continue
            want = [oracles.conv2d(full_w, full_b, tp, r, by_oc) for r in range(tp)]
            mw = conv2d_weight(full_w.shape, tp, shard_by_oc=by_oc)
            oracles.verify(mw, full_w, {r: w.contiguous() for r, (w, _) in enumerate(want)}, deepspeed=tp <= 4)
            mb = conv2d_bias(full_b.shape, tp, shard_by_oc=by_oc)
            exact = by_oc or tp & (tp - 1) == 0
            oracles.verify(mb, full_b, {r: b.contiguous() for r, (_, b) in enumerate(want)}, exact=exact)
            if not by_oc:
                assert all(p.scale == 1.0 / tp for _, _, p in mb.pieces())


def test_builders_refuse_bad_input():
    with pytest.raises(MapError):
        split((4, 4), 0, [1, 2])
    with pytest.raises(MapError):
        split((4, 4), 2, [4])
    with pytest.raises(MapError):
        replicated((2,), [1, 1])
