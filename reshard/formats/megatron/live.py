"""A live Megatron-Core ``GPTModel`` (local spec) as the source of a weight sync: every parameter
under its Hugging Face names (the architecture mapping document, as ``names="hf"`` reads a
checkpoint), mapped over the trainer ranks that hold it, and this rank's shards as views of its
own module parameters -- the tensors the optimizer updates in place, never gathered or copied.

A module parameter (one TP rank's part of one layer's key: ``model.LocalParam``) is cut into HF
tensors by ``hfmap.restrict``; the runs of one parameter that belong to one HF name (the q rows of
each query group a TP rank holds, say) become one shard on that rank: a slice of the parameter,
or, for several evenly spaced runs, a strided ``[runs, run length]`` view of it. Only data-parallel
rank 0 of each model-parallel position offers its shards, so each element is sent once; other
data-parallel ranks join the sync holding nothing.

The model's shape comes from its ``TransformerConfig``; what the mapping cannot place (experts,
multi-latent attention, multi-token prediction, virtual pipeline stages, linear biases, a
parameter the model holds that no key names) is refused with a ``MapError``, never dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any

import torch

from ...errors import MapError, ReshardError
from ...ir.param_map import ParamMap
from ...ir.piece import Piece, View
from ...layouts._core import finish
from .hfmap import hf_params, restrict
from .lowering import local_map
from .model import Arch, LocalParam

__all__ = ["arch_of_config", "megatron_sources"]

# TransformerConfig fields whose layouts the live source does not map (each with what it is)
_REFUSED = (("num_moe_experts", "experts"), ("multi_latent_attention", "multi-latent attention"),
            ("mtp_num_layers", "multi-token prediction layers"),
            ("virtual_pipeline_model_parallel_size", "virtual pipeline stages"))


def arch_of_config(config: Any, *, vocab_size: int, padded_vocab: int, tied: bool, dp: int = 1) -> Arch:
    """The :class:`Arch` of a GPTModel built from ``config`` (a ``TransformerConfig``) with
    ``padded_vocab`` embedding rows of which the first ``vocab_size`` are the HF model's."""
    for field, what in _REFUSED:
        if getattr(config, field, None) not in (None, 0, 1, False):
            raise MapError(f"live Megatron source: config.{field} = {getattr(config, field)!r}: {what} are not "
                           "mapped by the live source (a checkpoint of it is: reshard.open(path, names='hf'))")
    heads = int(config.num_attention_heads)
    groups = getattr(config, "num_query_groups", None) or heads
    args = SimpleNamespace(
        num_layers=config.num_layers, hidden_size=config.hidden_size, num_attention_heads=heads,
        group_query_attention=True, num_query_groups=groups, kv_channels=config.kv_channels,
        ffn_hidden_size=config.ffn_hidden_size, padded_vocab_size=padded_vocab, vocab_size=vocab_size,
        swiglu=bool(config.gated_linear_unit), add_qkv_bias=bool(getattr(config, "add_qkv_bias", False)),
        add_bias_linear=bool(config.add_bias_linear), untie_embeddings_and_output_weights=not tied,
        qk_layernorm=bool(getattr(config, "qk_layernorm", False)),
        tensor_model_parallel_size=config.tensor_model_parallel_size,
        pipeline_model_parallel_size=config.pipeline_model_parallel_size, data_parallel_size=dp,
        context_parallel_size=getattr(config, "context_parallel_size", 1),
        decoder_first_pipeline_num_layers=getattr(config, "num_layers_in_first_pipeline_stage", None),
        decoder_last_pipeline_num_layers=getattr(config, "num_layers_in_last_pipeline_stage", None))
    try:
        return Arch.from_args(args, "live Megatron source")
    except ReshardError as e:
        raise MapError(str(e)) from None


def megatron_sources(params: Mapping[str, torch.Tensor], config: Any, *, vocab_size: int, padded_vocab: int,
                     tied: bool, tp_rank: int, pp_rank: int, dp_rank: int = 0, dp: int = 1,
                     rank_of: Callable[[int, int], int] | None = None, mapping: Any = None
                     ) -> tuple[dict[str, ParamMap], dict[str, torch.Tensor]]:
    """Maps (HF names, over the trainer ranks) and this rank's shards of a live GPTModel whose
    parameters on this rank are ``params`` (``named_parameters()``; a ``module.`` wrapper prefix is
    ignored). ``rank_of(tp, pp)``: the trainer rank of data-parallel rank 0 at that TP and pipeline
    rank (default Megatron's order ``tp-dp-pp`` over ``dp`` data-parallel replicas)."""
    arch = arch_of_config(config, vocab_size=vocab_size, padded_vocab=padded_vocab, tied=tied, dp=dp)
    where = rank_of or (lambda t, p: arch.rank(tp=t, pp=p, dp=0))
    own = {_unwrapped(n): p for n, p in params.items()}
    if tied:  # the last pipeline stage's copy of the embedding (Megatron keeps the two equal)
        own.pop("output_layer.weight", None)
    mine = {_local_name(arch, lp): lp for lp in arch.stage_params(pp_rank, tp_rank)}
    extra = sorted(set(own) - set(mine))
    if extra:
        raise MapError(f"live Megatron source (TP {tp_rank}, PP {pp_rank}): parameter {extra[0]!r} (of {len(extra)}) "
                       "has no key in this model's layout (a linear bias, a LayerNorm bias or a module the mapping "
                       "does not know)")
    for name, lp in mine.items():
        got = own.get(name)
        if got is None:
            raise MapError(f"live Megatron source (TP {tp_rank}, PP {pp_rank}): the model lacks {name!r}")
        if tuple(got.shape) != lp.shape:
            raise MapError(f"live Megatron source: {name!r} is {list(got.shape)}; its layout says {list(lp.shape)}")
    try:
        hf = hf_params(arch, mapping)
    except ReshardError as e:
        raise MapError(f"live Megatron source: {e}") from None
    cache: dict = {}
    maps, shards = {}, {}
    for param in hf:
        base, locals_ = local_map(arch, arch.spec(param.key), cache)
        m, origin = restrict(base, param)
        rank_of_label = {lab: where(locals_[r].tp, arch.stage_of(locals_[r].spec, locals_[r].index))
                         for lab, (r, _, _) in origin.items()}
        maps[param.name], runs = _merged(m, origin, rank_of_label, param.name)
        me = where(tp_rank, pp_rank)
        if dp_rank == 0 and me in runs:
            lp = locals_[runs[me][0][0]]
            shards[param.name] = _view(own[_local_name(arch, lp)], [(lo, hi) for _, lo, hi in runs[me]],
                                       maps[param.name].shard(me).shape)
    return maps, shards


def _unwrapped(name: str) -> str:
    while name.startswith("module."):  # DDP / Float16Module wrappers
        name = name[len("module."):]
    return name


def _local_name(arch: Arch, lp: LocalParam) -> str:
    """``lp``'s name in its stage's module (``named_parameters``): layers numbered within the stage."""
    if not lp.spec.layered:
        return lp.spec.local
    return lp.spec.local.format(layer=arch.place(lp.spec.layer_at(lp.index))[2])


def _merged(m: ParamMap, origin: Mapping[int, tuple[int, int, int]], rank_of_label: Mapping[int, int], name: str
            ) -> tuple[ParamMap, dict[int, list[tuple[int, int, int]]]]:
    """``restrict``'s map (a shard per run) with each trainer rank's runs, all of one module
    parameter, as one shard: one run as it is, evenly spaced runs of one length as ``[runs, length]``."""
    runs: dict[int, list[tuple[int, int, int]]] = {}
    labels: dict[int, list[int]] = {}
    for lab in sorted(origin, key=lambda x: origin[x][1]):
        q = rank_of_label[lab]
        runs.setdefault(q, []).append(origin[lab])
        labels.setdefault(q, []).append(lab)
    shards = {}
    for q, rs in runs.items():
        if len({r for r, _, _ in rs}) != 1:
            raise MapError(f"{name}: trainer rank {q} holds it in more than one module parameter")
        n = rs[0][2] - rs[0][1]
        gaps = {b[1] - a[1] for a, b in zip(rs, rs[1:])}
        if any(hi - lo != n for _, lo, hi in rs) or len(gaps) > 1:
            raise MapError(f"{name}: trainer rank {q}'s parts of it are not evenly spaced in its parameter")
        pieces = []
        for j, lab in enumerate(labels[q]):
            for p in m.shard(lab).pieces:
                pieces.append(Piece(p.shape, p.source, View(p.dest.offset + j * n, p.dest.strides),
                                    frozenset(rank_of_label[x] for x in p.locations), p.scale))
        shards[q] = ((n,) if len(rs) == 1 else (len(rs), n), pieces)
    return finish(m.logical_shape, shards, m.valid_shape), runs


def _view(param: torch.Tensor, runs: list[tuple[int, int]], shape: tuple[int, ...]) -> torch.Tensor:
    """The runs ``[lo, hi)`` of a parameter's elements as one view of it (no copy)."""
    flat = param.detach().view(-1)
    lo, hi = runs[0]
    if len(runs) == 1:
        return flat[lo:hi]
    return flat.as_strided(shape, (runs[1][0] - lo, 1), flat.storage_offset() + lo)
