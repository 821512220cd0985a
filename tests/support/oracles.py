"""DeepSpeed 0.19.8's own partition code, called on CPU with an explicit rank, as test oracles for
``reshard.layouts``; plus small independent helpers to apply a map and to check a map's
coverage and locations element by element.

Nothing here re-implements a DeepSpeed rule: each oracle calls the DeepSpeed function that does
the partitioning. Where the arithmetic sits inline in a constructor that needs a process group
(ZeRO's per-parameter padding), the few transcribed lines are marked.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import pytest
import torch

from reshard import ParamMap
from reshard.ir import prod

ds = pytest.importorskip("deepspeed")

from deepspeed.checkpoint import affine as ds_affine  # noqa: E402
from deepspeed.module_inject import fusedqkv_utils as ds_fused  # noqa: E402
from deepspeed.module_inject import layers as ds_layers  # noqa: E402
from deepspeed.module_inject.tp_shard import AutoTPMeta, get_shard_size_list  # noqa: E402

# -- AutoTP -------------------------------------------------------------------------------------


def meta(num_kv_heads=None, num_attention_heads=None, n_embd=None, grain=1) -> AutoTPMeta:
    return AutoTPMeta(num_kv_heads=num_kv_heads, num_attention_heads=num_attention_heads, n_embd=n_embd,
                      tp_grain_size=grain)


def shard_size_list(total, tp, *, num_kv_heads=None, grain=1, name=None) -> list[int]:
    return list(get_shard_size_list(total, tp, meta(num_kv_heads, grain=grain), name))


# ``prepare_tp_fused_qkvw`` picks the layout from ``str(module)``: a module class with the right
# name is all it looks at.
_BLOCK_CLASS = {
    "bloom": "BloomBlock",
    "glm": "GLMBlock",
    "qwen": "QWenBlock",
    "phi3": "Phi3DecoderLayer",
    "bigcode": "GPTBigCodeBlock",
    "codegen": "CodeGenBlock",
}


def block_module(kind: str) -> torch.nn.Module:
    return type(_BLOCK_CLASS[kind], (torch.nn.Module,), {})()


def fused_qkv(kind: str, weight: torch.Tensor, tp: int, rank: int, m: AutoTPMeta) -> torch.Tensor:
    return ds_fused.prepare_tp_fused_qkvw(block_module(kind), weight, tp, rank, m)


def fused_qkv_subparam_split(kind: str, weight: torch.Tensor, tp: int, rank: int, m: AutoTPMeta) -> torch.Tensor:
    """The other path: ``fused_LinearLayer`` cuts supported fused layouts with
    ``_partition_logical_tensor`` at widths from ``fused_qkv_subparam_sizes``."""
    sizes = ds_fused.fused_qkv_subparam_sizes(block_module(kind), tuple(weight.shape), m)
    widths = ds_layers._subparam_shard_widths(sizes, tp, m)
    return ds_layers._partition_logical_tensor(weight, 0, tp, rank, widths, subparam_sizes=sizes)


def _fake_layer(**attrs) -> types.SimpleNamespace:
    return types.SimpleNamespace(move=lambda t: t, **attrs)


def gate_up(weight: torch.Tensor, tp: int, rank: int, m: AutoTPMeta) -> torch.Tensor:
    """``GateUpPack_LinearLayer``'s partition: ``SubParamColumnParallel._tp_partition`` with the
    sub-parameter spec the layer's constructor sets (two halves, MLP-named widths)."""
    half = weight.shape[0] // 2
    sizes = (half, half)
    layer = _fake_layer(tp_world_size=tp, tp_index=rank, _subparam_sizes=sizes,
                        _subparam_shard_widths=ds_layers._subparam_shard_widths(sizes, tp, m, "mlp"))
    p = torch.nn.Parameter(weight.clone(), requires_grad=False)
    ds_layers.SubParamColumnParallel._tp_partition(layer, [p])
    return p.data


def linear_split(weight: torch.Tensor, dim: int, tp: int, rank: int, m: AutoTPMeta, name=None) -> torch.Tensor:
    """``LinearLayer``/``LinearAllreduce``: ``split(get_shard_size_list(...), dim)[rank]``, via the
    layer helper ``_partition_logical_tensor``."""
    widths = [list(get_shard_size_list(weight.shape[dim], tp, m, name))]
    return ds_layers._partition_logical_tensor(weight, dim, tp, rank, widths)


def shared_qk(weight, bias, tp: int, rank: int, value: bool, num_heads: int):
    return ds_fused.shard_value_with_share_qk(weight, bias, rank, tp, value, meta(num_heads))


def conv2d(weight: torch.Tensor, bias: torch.Tensor | None, tp: int, rank: int, shard_by_oc: bool):
    conv = torch.nn.Conv2d(weight.shape[1], weight.shape[0], tuple(weight.shape[2:]), bias=bias is not None)
    with torch.no_grad():
        conv.weight.copy_(weight)
        if bias is not None:
            conv.bias.copy_(bias)
    out = ds_layers.TensorParallelConv2d(conv, rank, tp, shard_by_oc).conv
    return out.weight.data, (out.bias.data if bias is not None else None)


# -- ZeRO ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def _world_size(module, size: int) -> Iterator[None]:
    """``get_data_parallel_partitions`` asks ``deepspeed.comm`` for the DP world size; answer it
    without a process group."""
    real = module.dist
    module.dist = types.SimpleNamespace(get_world_size=lambda group=None: size, get_rank=lambda group=None: 0)
    try:
        yield
    finally:
        module.dist = real


def zero12(tensors: list[torch.Tensor], dp: int, *, param_alignment: int = 1, round_robin: bool = False):
    """``DeepSpeedZeroOptimizer``'s flat partitions of one group, each DP rank's
    ``param_slice_mappings`` (``{index: fragment_address}``), from its own methods, and whether
    those were linked with explicit offsets (only when some parameter is padded)."""
    from deepspeed.runtime.zero import stage_1_and_2 as s12
    from deepspeed.utils.mixed_precision_linkage import link_hp_params
    from torch._utils import _flatten_dense_tensors

    opt = s12.DeepSpeedZeroOptimizer
    fake = types.SimpleNamespace(flatten=_flatten_dense_tensors, real_dp_process_group=[None])
    lp = [t.clone() for t in tensors]
    ordered = opt._round_robin_reorder(fake, lp, dp)[0] if round_robin else lp
    # Transcribed from DeepSpeedZeroOptimizer.__init__ (inline there): per-parameter padding.
    padding, offsets, cursor = [], [], 0
    for k, t in enumerate(ordered):
        offsets.append(cursor)
        cursor += t.numel()
        pad = 0 if k == len(ordered) - 1 else (-cursor) % param_alignment
        padding.append(pad)
        cursor += pad
    alignment = 2 * dp  # nccl_start_alignment_factor * dp world size
    flat = opt.flatten_dense_tensors_aligned(fake, ordered, alignment, param_padding=padding)
    with _world_size(s12, dp):
        parts = opt.get_data_parallel_partitions(fake, flat, 0)
    # As _link_all_hp_params: explicit offsets only when there is per-parameter padding.
    by_id = {id(t): o for t, o in zip(ordered, offsets)}
    param_offsets = [by_id[id(t)] for t in lp] if any(padding) else None
    size = flat.numel() // dp
    mappings = []
    for d in range(dp):
        link_hp_params(lp_param_list=lp, flat_hp_partition=parts[d].clone(), gradient_dict={},
                       offload_gradient_dict=None, use_offload=False, param_group_index=0,
                       partition_start=d * size, partition_size=size, dp_group=None, param_offsets=param_offsets)
        mappings.append({i: t._hp_mapping.get_hp_fragment_address() for i, t in enumerate(lp)
                         if t._hp_mapping is not None})
    # (partitions, mappings, whether the mappings came from explicit offsets)
    return [p.clone() for p in parts], mappings, param_offsets is not None


def zero3(tensor: torch.Tensor, dp: int) -> list[torch.Tensor]:
    """ZeRO-3 partitions of one parameter: sizes from ``ds_to_universal._zero_partitioned_param_info``;
    the padded split as ``Init._partition_param`` does it (transcribed: a zero tail on the last
    holders)."""
    from deepspeed.checkpoint.ds_to_universal import _zero_partitioned_param_info

    part, pad = _zero_partitioned_param_info(tensor.numel(), dp)
    flat = torch.cat([tensor.reshape(-1), tensor.new_zeros(pad)])
    return [flat.narrow(0, d * part, part).clone() for d in range(dp)]


# -- DeepSpeed's affine module -----------------------------------------------------------------


def to_deepspeed(m: ParamMap):
    return ds_affine.ParamAffineMap.from_dict(m.to_dict())


# -- independent application and coverage -------------------------------------------------------


def extract(m: ParamMap, full: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank ``rank``'s shard by ``torch.as_strided``, elements no piece writes left at zero (as
    DeepSpeed's padding is)."""
    flat = full.contiguous().reshape(-1)
    shard = m.shard(rank)
    out = torch.zeros(prod(shard.shape), dtype=full.dtype)
    for p in shard.pieces:
        dst = torch.as_strided(out, p.shape, p.dest.strides, p.dest.offset)
        src = torch.as_strided(flat, p.shape, p.source.strides, p.source.offset)
        dst.copy_(src * p.scale if p.scale != 1.0 else src)
    return out.view(shard.shape)


def coverage(m: ParamMap) -> None:
    """Element by element: pieces stay in bounds, no shard address is written twice, a rank holds
    each element of F once, every element is covered, and each piece's locations are exactly the
    ranks holding each of its elements (holder sets as bitmasks, so ranks must be below 62)."""
    numel = m.numel
    assert max(m.ranks, default=0) < 62
    mask = torch.zeros(numel, dtype=torch.int64)
    addresses = torch.arange(numel)
    seen = []
    for rank, shard in m.shards.items():
        written = torch.zeros(prod(shard.shape), dtype=torch.int64)
        mine = torch.zeros(numel, dtype=torch.int64)
        for p in shard.pieces:
            assert p.source.span(p.shape)[1] <= numel, f"rank {rank}: {p.describe()} reads past F"
            assert p.dest.span(p.shape)[1] <= written.numel(), f"rank {rank}: {p.describe()} writes past the shard"
            torch.as_strided(written, p.shape, p.dest.strides, p.dest.offset).add_(1)
            idx = torch.as_strided(addresses, p.shape, p.source.strides, p.source.offset).reshape(-1)
            mine.index_add_(0, idx, torch.ones_like(idx))
            seen.append((rank, p, idx))
        assert not written.numel() or int(written.max()) <= 1, f"rank {rank}: a shard address is written twice"
        assert not numel or int(mine.max()) <= 1, f"rank {rank}: holds an element of F twice"
        mask |= mine << rank
    missing = torch.nonzero(mask == 0).reshape(-1)
    assert not len(missing), f"F elements {missing[:5].tolist()} covered by no piece"
    for rank, p, idx in seen:
        want = sum(1 << r for r in p.locations)
        bad = torch.nonzero(mask[idx] != want).reshape(-1)
        assert not len(bad), (
            f"rank {rank} {p.describe()}: element {int(idx[bad[0]])} is held by mask {int(mask[idx[bad[0]]]):b}")


def random_full(shape, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=g, dtype=torch.float64).to(dtype)


def verify(
    m: ParamMap,
    full: torch.Tensor,
    expected: dict[int, torch.Tensor],
    *,
    tiled: bool = True,
    deepspeed: bool = False,
    exact: bool = True,
) -> None:
    """The map is canonical and valid, extracts exactly the ``expected`` shards from ``full`` (the
    independent as_strided helper and ``m.extract`` agree), and the shards rebuild F; with
    ``deepspeed``, DeepSpeed's ``ParamAffineMap`` loads the map and does the same."""
    from reshard.ir import canonicalize

    assert canonicalize(m) == m, "builder output is not canonical"
    coverage(m)
    if tiled:
        m.check()
    assert set(expected) == set(m.ranks), f"ranks {sorted(expected)} expected, map has {list(m.ranks)}"
    same = torch.equal if exact else (lambda a, b: torch.allclose(a, b, rtol=1e-6, atol=1e-6))
    for r, want in expected.items():
        got = extract(m, full, r)
        assert got.shape == want.shape, f"rank {r}: shard {list(got.shape)} vs {list(want.shape)}"
        if not tiled:
            # the shard is shared with other parameters: compare where this map writes
            mine = extract(m, torch.ones_like(full), r) != 0
            got, want = got[mine], want[mine]
        assert same(got, want), f"rank {r}: shard differs from DeepSpeed's"
        if tiled:
            assert same(m.extract(full, r), want)
    shards = {r: t.clone() for r, t in expected.items()}
    assert same(m.rebuild(shards, valid_only=True), full[tuple(slice(0, n) for n in m.valid_shape)])
    if deepspeed:
        dm = to_deepspeed(m)
        dm.validate_coverage()
        assert same(dm.rebuild(shards), full)
        for r, want in expected.items():
            assert same(dm.extract(full, r), want)
