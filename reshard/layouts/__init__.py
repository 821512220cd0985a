"""Layout builders: every real way a parameter is spread over ranks, as canonical ``ParamMap``s.

Builders take sizes and rank counts (``ranks=`` relabels local rank ``i`` as ``ranks[i]``), never
parameter names. Stacked parallelism is the composition of two maps (:func:`compose`).

* :mod:`.tp` -- replication (optionally scaled), contiguous splits on any dim, AutoTP's split
  sizes, sub-parameters, VocabParallel partition sizes, legacy padded vocabularies.
* :mod:`.fused` -- fused QKV (bloom/glm/qwen/phi3/bigcode/codegen), GLM gate/up, Yuan shared-QK,
  ``TensorParallelConv2d``.
* :mod:`.zero` -- ZeRO-1/2 groups (from sizes or from a checkpoint's ``param_slice_mappings``)
  and ZeRO-3.
* :mod:`.placement` -- experts over an EP group, parameters on pipeline stages.
* :mod:`.compose` -- ``compose(outer, inner_by_rank)``.
* :func:`dim_blocks` / :func:`flat_ranges` -- the two general forms the builders reduce to: shards
  made of blocks of F along one dim, or of flat ranges of F; holder sets are computed exactly.

Conventions: pieces always name the exact set of ranks holding them (computed from what every
rank holds, never assumed); ZeRO shards are whole flat partitions and a rank holding none of a
parameter is omitted from that parameter's map (see :mod:`.zero`).
"""

from ._core import dim_blocks, flat_ranges
from .compose import ZeroComposer, compose, compose_zero, replicate_over
from .fused import (
    FUSED_QKV_KINDS,
    bigcode_mqa,
    codegen_qkv,
    conv2d_bias,
    conv2d_split_sizes,
    conv2d_weight,
    fused_qkv,
    fused_qkv_sub_sizes,
    gate_up,
    shared_qk_head_ids,
    shared_qk_o_proj,
    shared_qk_o_proj_bias,
    shared_qk_value,
)
from .placement import autoep_placement, expert_placement, pipeline_stage, uniform_experts
from .tp import (
    autotp_shard_sizes,
    autotp_split,
    even_sizes,
    near_even_sizes,
    padded_vocab,
    padded_vocab_rows,
    prescaled_bias,
    replicated,
    split,
    sub_params,
    vocab_parallel,
)
from .zero import (
    FlatGroup,
    round_robin_order,
    zero3,
    zero3_partition_numel,
    zero12_from_slice_mappings,
    zero12_group,
    zero12_group_layout,
)

__all__ = [
    "ZeroComposer",
    "FUSED_QKV_KINDS",
    "FlatGroup",
    "autoep_placement",
    "autotp_shard_sizes",
    "autotp_split",
    "bigcode_mqa",
    "codegen_qkv",
    "compose",
    "compose_zero",
    "conv2d_bias",
    "conv2d_split_sizes",
    "conv2d_weight",
    "dim_blocks",
    "even_sizes",
    "expert_placement",
    "flat_ranges",
    "fused_qkv",
    "fused_qkv_sub_sizes",
    "gate_up",
    "near_even_sizes",
    "padded_vocab",
    "padded_vocab_rows",
    "pipeline_stage",
    "prescaled_bias",
    "replicate_over",
    "replicated",
    "round_robin_order",
    "shared_qk_head_ids",
    "shared_qk_o_proj",
    "shared_qk_o_proj_bias",
    "shared_qk_value",
    "split",
    "sub_params",
    "uniform_experts",
    "vocab_parallel",
    "zero12_from_slice_mappings",
    "zero12_group",
    "zero12_group_layout",
    "zero3",
    "zero3_partition_numel",
]
