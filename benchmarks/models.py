"""Model-shaped sets of maps for benchmarks, built with ``reshard.layouts`` (sizes only: no
tensors are allocated)."""

from __future__ import annotations

from reshard import ParamMap
from reshard.layouts import even_sizes, replicated, split, sub_params


def llama_maps(tp: int, *, layers: int = 80, hidden: int = 8192, kv: int = 1024, inter: int = 28672,
               vocab: int = 128256, ranks: list[int] | None = None) -> dict[str, ParamMap]:
    """Llama-70B-shaped TP layout: fused QKV and gate_up as sub-parameters, o_proj and down
    split on dim 1, norms replicated, embedding and head split on the vocabulary."""
    r = ranks or list(range(tp))

    def even(n: int) -> list[int]:
        return even_sizes(n, tp)

    maps: dict[str, ParamMap] = {"embed.weight": split((vocab, hidden), 0, even(vocab), ranks=r)}
    for i in range(layers):
        p = f"layers.{i}."
        maps[p + "attn.qkv.weight"] = sub_params((hidden + 2 * kv, hidden), [hidden, kv, kv],
                                                 [even(hidden), even(kv), even(kv)], ranks=r)
        maps[p + "attn.o_proj.weight"] = split((hidden, hidden), 1, even(hidden), ranks=r)
        maps[p + "mlp.gate_up.weight"] = sub_params((2 * inter, hidden), [inter, inter], [even(inter)] * 2, ranks=r)
        maps[p + "mlp.down.weight"] = split((hidden, inter), 1, even(inter), ranks=r)
        maps[p + "input_norm.weight"] = replicated((hidden,), r)
        maps[p + "post_norm.weight"] = replicated((hidden,), r)
    maps["norm.weight"] = replicated((hidden,), r)
    maps["lm_head.weight"] = split((vocab, hidden), 0, even(vocab), ranks=r)
    return maps
