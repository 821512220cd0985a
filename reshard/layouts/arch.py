"""Architecture mappings: which engine tensor, in which layout, each source parameter becomes, as data.

A *mapping document* says, for a model architecture and an engine, how the trainer's (Hugging
Face) parameter names become the engine's tensors; :func:`inference_targets` is the one function
that reads it. A document is plain data (JSON-compatible)::

    {"version": 1, "engine": "vllm",
     "params": [{"from": "model.layers.{i}.self_attn.q_proj.weight",
                 "to": "model.layers.{i}.self_attn.qkv_proj.weight", "layout": "qkv", "part": "q"},
                ...]}

* ``from`` is a name pattern; each ``{placeholder}`` matches a run of digits and is substituted
  into ``to`` (default: ``from``). The first rule that matches a name applies.
* ``layout`` is one of :data:`LAYOUTS`: ``replicated``, ``column``, ``row``, ``vocab`` (padded
  vocabulary-parallel), ``qkv`` (``part`` ``"q"``, ``"k"`` or ``"v"`` of a ``QKVParallelLinear``),
  ``merged`` (``part`` ``k`` of a ``MergedColumnParallelLinear``: gate 0, up 1), ``moe_w13``,
  ``moe_w2`` (stacked experts). Rules that share a ``to`` name are the parts of one fused tensor.

A new architecture is a new document, not new code; a new *layout* is a builder in
:mod:`reshard.layouts.inference` and one line in :data:`LAYOUTS`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import MapError
from .compose import replicate_over
from .inference import (
    Placed,
    check_placed,
    column_parallel,
    merged_column_parts,
    moe_experts,
    placed,
    qkv_parts,
    row_parallel,
    vocab_parallel_padded,
)
from .tp import replicated

__all__ = ["LAYOUTS", "LLAMA_VLLM", "QWEN3_MOE_VLLM", "inference_targets"]

LAYOUTS = ("replicated", "column", "row", "vocab", "qkv", "merged", "moe_w13", "moe_w2")


def _attention(prefix: str = "model.layers.{i}.self_attn.") -> list[dict[str, Any]]:
    rules = []
    for kind in ("weight", "bias"):  # Qwen2 has q/k/v biases; o_proj's bias, where present, is whole
        rules += [{"from": f"{prefix}{p}_proj.{kind}", "to": f"{prefix}qkv_proj.{kind}", "layout": "qkv", "part": p}
                  for p in "qkv"]
        rules.append({"from": f"{prefix}o_proj.{kind}", "layout": "row"})
    return rules


_EDGES = [
    {"from": "model.embed_tokens.weight", "layout": "vocab"},
    {"from": "lm_head.weight", "layout": "vocab"},
    {"from": "model.norm.weight", "layout": "replicated"},
    {"from": "model.layers.{i}.input_layernorm.weight", "layout": "replicated"},
    {"from": "model.layers.{i}.post_attention_layernorm.weight", "layout": "replicated"},
]

# Llama, Mistral, Qwen2 (q/k/v biases) under vLLM's tensor parallelism (vLLM's own names).
LLAMA_VLLM: dict[str, Any] = {"version": 1, "engine": "vllm", "params": _EDGES + _attention() + [
    {"from": "model.layers.{i}.mlp.gate_proj.weight", "to": "model.layers.{i}.mlp.gate_up_proj.weight",
     "layout": "merged", "part": 0},
    {"from": "model.layers.{i}.mlp.up_proj.weight", "to": "model.layers.{i}.mlp.gate_up_proj.weight",
     "layout": "merged", "part": 1},
    {"from": "model.layers.{i}.mlp.down_proj.weight", "layout": "row"},
]}

# Qwen3-MoE / Mixtral as transformers 5 holds them (stacked experts) under vLLM's FusedMoE.
QWEN3_MOE_VLLM: dict[str, Any] = {"version": 1, "engine": "vllm", "params": _EDGES + _attention() + [
    {"from": "model.layers.{i}.self_attn.q_norm.weight", "layout": "replicated"},
    {"from": "model.layers.{i}.self_attn.k_norm.weight", "layout": "replicated"},
    {"from": "model.layers.{i}.mlp.gate.weight", "layout": "replicated"},
    {"from": "model.layers.{i}.mlp.experts.gate_up_proj", "to": "model.layers.{i}.mlp.experts.w13_weight",
     "layout": "moe_w13"},
    {"from": "model.layers.{i}.mlp.experts.down_proj", "to": "model.layers.{i}.mlp.experts.w2_weight",
     "layout": "moe_w2"},
]}


def _rules(doc: Any) -> list[tuple[re.Pattern, str, dict[str, Any]]]:
    if not isinstance(doc, Mapping) or doc.get("version") != 1 or not isinstance(doc.get("params"), list):
        raise MapError('a mapping document is {"version": 1, "params": [rule, ...]}')
    out = []
    for k, rule in enumerate(doc["params"]):
        if not isinstance(rule, Mapping) or not isinstance(rule.get("from"), str) or rule.get("layout") not in LAYOUTS:
            raise MapError(f"params[{k}]: a rule needs a 'from' pattern and a 'layout' among {list(LAYOUTS)}, "
                           f"got {rule!r}")
        pattern = re.escape(rule["from"])
        pattern = re.sub(r"\\\{(\w+)\\\}", lambda m: f"(?P<{m.group(1)}>\\d+)", pattern)
        out.append((re.compile(pattern + r"\Z"), rule.get("to", rule["from"]), dict(rule)))
    return out


def _match(rules, name: str) -> tuple[str, dict[str, Any]] | None:
    for rx, to, rule in rules:
        m = rx.match(name)
        if m:
            return to.format(**m.groupdict()), rule
    return None


def inference_targets(doc: Mapping[str, Any], shapes: Mapping[str, Sequence[int]], *, tp: int,
                      num_heads: int | None = None, num_kv_heads: int | None = None, ep: int = 1,
                      ranks: Sequence[int] | Sequence[Sequence[int]] | None = None, pad_to: int = 64,
                      pad_per_rank: bool = False, placement: str = "linear") -> dict[str, Placed]:
    """The engine's target, by source name, of every parameter in ``shapes`` (source name ->
    full shape), laid out as ``doc`` says at tensor-parallel degree ``tp`` (experts: ``ep`` EP
    ranks × ``tp / ep`` TP ranks over the same ranks). ``ranks`` are the engine's global ranks
    (default ``0..tp-1``), or a list of such lists, one per engine replica. A name no rule
    matches, a fused tensor missing a part, or a layout the sizes do not allow raises
    :class:`MapError` naming the parameter."""
    groups = [list(range(tp))] if ranks is None else (
        [list(g) for g in ranks] if ranks and isinstance(ranks[0], Sequence) else [list(ranks)])  # type: ignore[arg-type]
    rules = _rules(doc)
    matched: dict[str, tuple[str, dict[str, Any]]] = {}
    unknown = []
    for name in shapes:
        hit = _match(rules, name)
        if hit is None:
            unknown.append(name)
        else:
            matched[name] = hit
    if unknown:
        raise MapError(f"no rule of the mapping document matches {unknown[:5]}"
                       + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""))
    fused: dict[str, dict[Any, str]] = {}
    for name, (to, rule) in matched.items():
        if rule["layout"] in ("qkv", "merged"):
            fused.setdefault(to, {})[rule.get("part")] = name
    cfg = {"tp": tp, "num_heads": num_heads, "num_kv_heads": num_kv_heads, "ep": ep, "pad_to": pad_to,
           "pad_per_rank": pad_per_rank, "placement": placement}
    local: dict[str, Placed] = {}
    for name, (to, rule) in matched.items():
        if name in local:
            continue
        try:
            if rule["layout"] in ("qkv", "merged"):
                local.update(_fused(to, rule["layout"], fused[to], shapes, cfg))
            else:
                local[name] = placed(_single(rule["layout"], tuple(shapes[name]), cfg), to)
        except MapError as e:
            raise MapError(f"parameter {name!r} ({rule['layout']} -> {to!r}): {e}") from None
    out = {name: _on_ranks(local[name], groups) for name in shapes}
    check_placed(out)
    return out


def _single(layout: str, shape: tuple[int, ...], cfg: Mapping[str, Any]):
    tp = cfg["tp"]
    if layout == "replicated":
        return replicated(shape, tp)
    if layout == "column":
        return column_parallel(shape, tp)
    if layout == "row":
        return row_parallel(shape, tp)
    if layout == "vocab":
        return vocab_parallel_padded(shape, tp, pad_to=cfg["pad_to"], per_rank=cfg["pad_per_rank"])
    ep = cfg["ep"]
    if tp % ep:
        raise MapError(f"ep {ep} does not divide tp {tp}")
    return moe_experts(shape, "w13" if layout == "moe_w13" else "w2", ep=ep, tp=tp // ep,
                       placement=cfg["placement"])


def _fused(to: str, layout: str, parts: Mapping[Any, str], shapes, cfg) -> dict[str, Placed]:
    if layout == "qkv":
        missing = [p for p in "qkv" if p not in parts]
        if missing:
            raise MapError(f"fused {to!r} lacks its part(s) {missing}")
        if cfg["num_heads"] is None or cfg["num_kv_heads"] is None:
            raise MapError("qkv needs num_heads and num_kv_heads")
        built = qkv_parts(shapes[parts["q"]], shapes[parts["k"]], cfg["tp"], num_heads=cfg["num_heads"],
                          num_kv_heads=cfg["num_kv_heads"])
        if tuple(shapes[parts["v"]]) != tuple(shapes[parts["k"]]):
            raise MapError(f"v {list(shapes[parts['v']])} differs from k {list(shapes[parts['k']])}")
        return {parts[p]: b.named(to) for p, b in zip("qkv", built)}
    order = sorted(parts, key=lambda p: (not isinstance(p, int), p))
    if order != list(range(len(order))):
        raise MapError(f"fused {to!r} has parts {order}, not 0..{len(order) - 1}")
    built = merged_column_parts([shapes[parts[k]] for k in order], cfg["tp"])
    return {parts[k]: b.named(to) for k, b in zip(order, built)}


def _on_ranks(t: Placed, groups: list[list[int]]) -> Placed:
    """Local engine ranks ``0..tp-1`` onto each replica's global ranks."""
    if len(groups) == 1:
        return t.with_ranks(dict(enumerate(groups[0])))
    for g in groups:
        if len(g) != len(t.map.ranks):
            raise MapError(f"engine replica ranks {g} are not {len(t.map.ranks)} ranks")
    m = replicate_over(t.map, {i: [g[i] for g in groups] for i in t.map.ranks})
    return Placed(m, t.into, {g[i]: t.shapes[i] for g in groups for i in t.map.ranks},
                  {g[i]: t.offsets[i] for g in groups for i in t.map.ranks})
