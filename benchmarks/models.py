"""Model-shaped sets of maps for benchmarks (sizes only: no tensors are allocated)."""

from __future__ import annotations

from reshard import ParamMap, Piece, Shard, View
from reshard.ir import row_major_strides


def _split_rows(sizes: list[int], parts: int, cols: int, ranks: list[int], dim: int = 0) -> ParamMap:
    """Concatenated sub-parameters along ``dim`` of a 2-d F, each split evenly over ``ranks``."""
    total = sum(sizes)
    shape = (total, cols) if dim == 0 else (cols, total)
    fs = row_major_strides(shape)
    shard_extent = sum(s // parts for s in sizes)
    sshape = (shard_extent, cols) if dim == 0 else (cols, shard_extent)
    ss = row_major_strides(sshape)
    shards = {}
    for i, r in enumerate(ranks):
        pieces, f0, d0 = [], 0, 0
        for s in sizes:
            w = s // parts
            ext = (w, cols) if dim == 0 else (cols, w)
            pieces.append(Piece(ext, View((f0 + i * w) * fs[dim], fs), View(d0 * ss[dim], ss), frozenset({r})))
            f0 += s
            d0 += w
        shards[r] = Shard(sshape, tuple(pieces))
    return ParamMap(shape, shards)


def _replicated(shape: tuple[int, ...], ranks: list[int]) -> ParamMap:
    fs = row_major_strides(shape)
    p = Piece(shape, View(0, fs), View(0, fs), frozenset(ranks))
    return ParamMap(shape, {r: Shard(shape, (p,)) for r in ranks})


def llama_maps(tp: int, *, layers: int = 80, hidden: int = 8192, kv: int = 1024, inter: int = 28672,
               vocab: int = 128256) -> dict[str, ParamMap]:
    """Llama-70B-shaped TP layout: fused QKV and gate_up as sub-parameters, o_proj and down
    split on dim 1, norms replicated, embedding and head split on the vocabulary."""
    ranks = list(range(tp))
    maps: dict[str, ParamMap] = {"embed.weight": _split_rows([vocab], tp, hidden, ranks)}
    for i in range(layers):
        p = f"layers.{i}."
        maps[p + "attn.qkv.weight"] = _split_rows([hidden, kv, kv], tp, hidden, ranks)
        maps[p + "attn.o_proj.weight"] = _split_rows([hidden], tp, hidden, ranks, dim=1)
        maps[p + "mlp.gate_up.weight"] = _split_rows([inter, inter], tp, hidden, ranks)
        maps[p + "mlp.down.weight"] = _split_rows([inter], tp, hidden, ranks, dim=1)
        maps[p + "input_norm.weight"] = _replicated((hidden,), ranks)
        maps[p + "post_norm.weight"] = _replicated((hidden,), ranks)
    maps["norm.weight"] = _replicated((hidden,), ranks)
    maps["lm_head.weight"] = _split_rows([vocab], tp, hidden, ranks)
    return maps
