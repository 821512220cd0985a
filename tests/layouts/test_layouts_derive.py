"""``derive`` run on DeepSpeed 0.19.8's real partition functions recovers exactly the maps the
builders in ``reshard.layouts`` produce (both canonical), across sizes and TP degrees."""

from __future__ import annotations

import pytest
import torch

from reshard.ir import canonicalize
from reshard.layouts import (
    autotp_split,
    bigcode_mqa,
    codegen_qkv,
    conv2d_bias,
    conv2d_weight,
    fused_qkv,
    gate_up,
    shared_qk_o_proj,
    shared_qk_value,
)
from reshard.layouts.derive import derive
from tests.support import oracles


def _same(builder_map, fn, shape, tp, dtype=torch.float64):
    got = derive(fn, shape, tp, dtype=dtype)
    assert got == builder_map, (got.summary(), builder_map.summary())
    assert canonicalize(got) == got


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 8])
def test_autotp_linear(tp):
    m = oracles.meta(None)
    for shape, dim in [((24, 10), 0), ((10, 36), 1), ((13, 5), 0)]:
        if shape[dim] < tp:
            continue
        builder = autotp_split(shape, dim, tp, head_aware=False)
        _same(builder, lambda f, r: oracles.linear_split(f, dim, tp, r, m, name="mlp").contiguous(), shape, tp)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("kind,shape,kw", [
    ("bloom", (96, 5), {"num_kv_heads": 4}),
    ("glm", (48, 6), {"num_kv_heads": 2, "n_embd": 32}),
    ("qwen", (48, 6), {"num_kv_heads": 2, "n_embd": 32}),
    ("phi3", (64, 4), {"num_kv_heads": 8, "num_attention_heads": 8, "n_embd": 32}),
])
def test_fused_qkv(kind, shape, kw, tp):
    m = oracles.meta(kw.get("num_kv_heads"), kw.get("num_attention_heads"), kw.get("n_embd"))
    builder = fused_qkv(kind, shape, tp, **kw)
    _same(builder, lambda f, r: oracles.fused_qkv(kind, f, tp, r, m).contiguous(), shape, tp)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_bigcode_and_codegen(tp):
    m = oracles.meta(None, n_embd=64)
    _same(bigcode_mqa((96, 8), tp, n_embd=64),
          lambda f, r: oracles.fused_qkv("bigcode", f, tp, r, m).contiguous(), (96, 8), tp)
    mc = oracles.meta(32)
    _same(codegen_qkv((192, 8), tp, num_kv_heads=32),
          lambda f, r: oracles.fused_qkv("codegen", f, tp, r, mc).contiguous(), (192, 8), tp)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gate_up(tp):
    m = oracles.meta(8)
    _same(gate_up((64, 8), tp, num_kv_heads=8), lambda f, r: oracles.gate_up(f, tp, r, m).contiguous(), (64, 8), tp)


@pytest.mark.parametrize("tp", [2, 4])
def test_yuan(tp):
    def first(out):
        out = out[0] if isinstance(out, tuple) else out
        return out.data.contiguous()

    def value(f, r):
        return first(oracles.shared_qk(f, None, tp, r, True, 8))

    def o_proj(f, r):
        return first(oracles.shared_qk(f, None, tp, r, False, 8))

    _same(shared_qk_value((64, 8), tp, num_heads=8), value, (64, 8), tp)
    _same(shared_qk_o_proj((8, 64), tp, num_heads=8), o_proj, (8, 64), tp)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("by_oc", [True, False])
def test_conv2d_weight_and_prescaled_bias(tp, by_oc):
    shape_w, shape_b = (8, 12, 3, 3), (8,)
    bias = torch.zeros(shape_b)

    def weight(f, r):  # noqa: B023 (called immediately)
        return oracles.conv2d(f, bias, tp, r, by_oc)[0].contiguous()

    def bias_fn(f, r):
        return oracles.conv2d(torch.zeros(shape_w, dtype=f.dtype), f, tp, r, by_oc)[1].contiguous()

    # the layer holds float32 parameters, so derive in float32
    _same(conv2d_weight(shape_w, tp, shard_by_oc=by_oc), weight, shape_w, tp, torch.float32)
    _same(conv2d_bias(shape_b, tp, shard_by_oc=by_oc), bias_fn, shape_b, tp, torch.float32)


def _spy(fn, seen):
    def run(f, r):
        seen.append(f.dtype)
        return fn(f, r)

    return run


@pytest.mark.parametrize("tp", [2, 4])
def test_results_as_deepspeed_returns_them(tp):
    """No ``.contiguous()``: where DeepSpeed slices, derive gets views (read from their geometry
    alone), elsewhere copies; either way it reads index markers once per rank and finds the
    builders' maps."""
    m = oracles.meta(None)
    for shape, dim in [((24, 10), 0), ((10, 36), 1)]:
        seen: list[torch.dtype] = []
        fn = _spy(lambda f, r: oracles.linear_split(f, dim, tp, r, m, name="mlp"), seen)
        _same(autotp_split(shape, dim, tp, head_aware=False), fn, shape, tp)
        assert seen == [torch.int32] * tp + [torch.float64] * tp  # index markers, then the check
    for kind, shape, kw in [("bloom", (96, 5), {"num_kv_heads": 4}), ("qwen", (48, 6), {"num_kv_heads": 2, "n_embd": 32})]:
        mk = oracles.meta(kw.get("num_kv_heads"), None, kw.get("n_embd"))
        seen = []
        fn = _spy(lambda f, r: oracles.fused_qkv(kind, f, tp, r, mk), seen)
        _same(fused_qkv(kind, shape, tp, **kw), fn, shape, tp)
        _same(fused_qkv(kind, shape, tp, **kw), fn, shape, tp, torch.float32)
        assert seen == ([torch.int32] * tp + [torch.float64] * tp + [torch.int32] * tp + [torch.float32] * tp)
