"""The two directions between Megatron's ``args`` and a transformers ``config.json`` for
Llama / Qwen2-style GQA models (Qwen3 with QK layer norms) and their MoE kin (Mixtral; Qwen2-MoE
with a gated shared expert; Qwen3-MoE with QK layer norms; both Qwen ones with dense layers mixed
in, ``mlp_only_layers``), and DeepSeek-V3 (multi-latent attention, dense or MoE with a sigmoid
router, an expert bias, group-limited routing and ungated shared experts):

* :func:`hf_config`: the ``config.json`` of a Hugging Face export of a Megatron model;
* :func:`args_from_hf`: the ``argparse.Namespace`` a Megatron-LM ``load_checkpoint`` needs
  (``--use-checkpoint-args`` takes the model shape from it) for an HF import. Model fields come
  from the config; parallel sizes from the target; training fields are Megatron-LM's defaults,
  which a training command line overrides (documented in docs/megatron-checkpoints.md §8).
"""

from __future__ import annotations

import argparse
from functools import partial
from typing import Any

import torch

from ...errors import ReshardError
from .model import MLA, Arch

__all__ = ["args_from_hf", "hf_config"]

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _refuse(args: Any, field: str, bad: Any, what: str, model: str = "Llama/Qwen/Mixtral") -> None:
    value = getattr(args, field, None)
    if bad(value):
        raise ReshardError(f"args.{field} = {value!r}: {what} has no {model} config")


def hf_config(args: Any, arch: Arch, dtype: torch.dtype) -> dict[str, Any]:
    """``config.json`` of the HF model Megatron's ``args`` describe (refused where no Llama,
    Qwen2 or Mixtral model computes the same function)."""
    _refuse(args, "swiglu", lambda v: not v, "a non-SwiGLU MLP")
    _refuse(args, "normalization", lambda v: v != "RMSNorm", "a non-RMSNorm model")
    _refuse(args, "position_embedding_type", lambda v: v != "rope", "a model without RoPE")
    _refuse(args, "rotary_interleaved", bool, "interleaved RoPE")
    _refuse(args, "rotary_percent", lambda v: v not in (None, 1.0), "partial RoPE")
    _refuse(args, "use_rope_scaling", bool, "RoPE scaling")
    _refuse(args, "apply_layernorm_1p", bool, "a zero-centred norm")
    _refuse(args, "layernorm_zero_centered_gamma", bool, "a zero-centred norm")
    eps = getattr(args, "norm_epsilon", None) or getattr(args, "layernorm_epsilon", 1e-5)
    base = {
        "hidden_size": arch.hidden, "intermediate_size": arch.ffn, "num_hidden_layers": arch.layers,
        "num_attention_heads": arch.heads, "num_key_value_heads": arch.groups, "head_dim": arch.head_dim,
        "vocab_size": arch.vocab, "max_position_embeddings": int(getattr(args, "max_position_embeddings", 0) or 4096),
        "rms_norm_eps": float(eps), "hidden_act": "silu", "tie_word_embeddings": arch.tied,
        "rope_parameters": {"rope_theta": float(getattr(args, "rotary_base", 10000) or 10000), "rope_type": "default"},
        "attention_dropout": 0.0, "dtype": _DTYPES.get(dtype, "float32"), "torch_dtype": _DTYPES.get(dtype, "float32"),
        "initializer_range": float(getattr(args, "init_method_std", 0.02) or 0.02), "use_cache": True,
    }
    if arch.mla:
        return _deepseek_v3(args, arch, arch.mla, base)
    if arch.experts:
        base.update(_moe_config(args, arch))
    elif arch.qk_norm:  # Qwen3: RMSNorm of each q / k head (head_dim wide) before RoPE, as Megatron's
        if arch.qkv_bias:
            raise ReshardError("args.qk_layernorm with add_qkv_bias: no Qwen3 config holds both")
        base.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=False,
                    use_sliding_window=False, sliding_window=None, max_window_layers=arch.layers)
    elif arch.qkv_bias:
        base.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=False,
                    sliding_window=None, max_window_layers=arch.layers)
    else:
        base.update(architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False, mlp_bias=False,
                    pretraining_tp=1)
    return base


def _deepseek_v3(args: Any, arch: Arch, m: MLA, base: dict[str, Any]) -> dict[str, Any]:
    """A DeepSeek-V3 config for multi-latent attention (``deepseek_v3.json``): the rope part
    interleaved on both sides (``rope_interleave``), the latent norms present; dense, or MoE
    from ``first_k_dense_replace`` on (:func:`_deepseek_v3_moe`)."""
    _refuse(args, "rope_type", lambda v: v not in (None, "rope"), "MLA with YaRN RoPE (--rope-type yarn)")
    _refuse(args, "qk_layernorm", lambda v: not v, "MLA without latent norms (DeepseekV3 always has them)")
    if float(getattr(args, "mscale_all_dim", 0) or 0) and float(getattr(args, "rotary_scaling_factor", 1) or 1) > 1:
        raise ReshardError("args.mscale_all_dim with rotary_scaling_factor > 1: a YaRN softmax scale DeepseekV3 "
                           "applies only with YaRN RoPE")
    if base["rms_norm_eps"] != 1e-6:  # DeepseekV3RMSNorm(q_lora_rank) / (kv_lora_rank): eps fixed at 1e-6
        raise ReshardError(f"args.norm_epsilon = {base['rms_norm_eps']!r} with multi_latent_attention: transformers' "
                           "DeepseekV3 fixes its latent norms' eps at 1e-6, so no DeepseekV3 config computes this model")
    base.pop("head_dim")
    base.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", num_key_value_heads=arch.heads,
                q_lora_rank=m.q_lora or None, kv_lora_rank=m.kv_lora, qk_nope_head_dim=m.qk_head,
                qk_rope_head_dim=m.rope, v_head_dim=m.v_head, rope_interleave=True, attention_bias=False,
                first_k_dense_replace=arch.layers, n_routed_experts=1, n_shared_experts=0, num_experts_per_tok=1,
                moe_intermediate_size=arch.ffn, n_group=1, topk_group=1, num_nextn_predict_layers=0, pretraining_tp=1)
    if arch.experts:
        base.update(_deepseek_v3_moe(args, arch))
    return base


def _deepseek_v3_moe(args: Any, arch: Arch) -> dict[str, Any]:
    """The MoE part of a DeepSeek-V3 config. DeepseekV3TopkRouter: sigmoid scores, the expert
    bias added for the choice only, ``n_group`` groups ranked by the sum of their top-2 biased
    scores, the best ``topk_group`` kept, top-k experts among them, their unbiased scores
    renormalised (``norm_topk_prob``) and scaled (``routed_scaling_factor``) -- Megatron's sigmoid
    router with ``moe_router_num_groups`` / ``moe_router_group_topk`` computes the same when it
    ranks groups by their top ``topk // group_topk`` = 2 scores, and it renormalises whenever top-k > 1."""
    where = "the DeepseekV3 router (sigmoid, expert bias, group-limited top-k)"
    refuse = partial(_refuse, model="DeepseekV3")
    refuse(args, "moe_router_score_function", lambda v: v != "sigmoid", f"a router other than {where}")
    refuse(args, "moe_router_load_balancing_type", lambda v: v in ("sinkhorn", "quantile_balancing") or (
        isinstance(v, list) and any(x in ("sinkhorn", "quantile_balancing") for x in v)), f"a router other than {where}")
    refuse(args, "moe_expert_capacity_factor", lambda v: v is not None and v >= 0, "token dropping (capacity)")
    refuse(args, "moe_input_jitter_eps", lambda v: v is not None, "router input jitter")
    refuse(args, "moe_router_force_load_balancing", bool, "forced (random) routing")
    refuse(args, "moe_apply_probs_on_input", bool, "routing weights applied to the expert input")
    refuse(args, "moe_latent_size", lambda v: v is not None, "latent MoE projections")
    refuse(args, "moe_router_dtype", lambda v: v not in (None, "fp32"), f"a router dtype other than {where}'s fp32")
    # the deprecated spelling of group-limited routing (num_groups = EP): Megatron's config rewrites it, args keep it
    refuse(args, "moe_router_topk_limited_devices", lambda v: v is not None, "device-limited routing (deprecated)")
    if not arch.expert_bias:  # DeepseekV3 always holds the bias: leaving it to from_pretrained's zero init hides a loss
        raise ReshardError("args.moe_router_enable_expert_bias = False: DeepseekV3's router always holds "
                           "e_score_correction_bias, which this checkpoint has no tensor for")
    if arch.shared_gate:
        raise ReshardError("args.moe_shared_expert_gate = True: DeepseekV3's shared experts have no gate")
    if not arch.shared_ffn or arch.shared_ffn % arch.moe_ffn:
        raise ReshardError(f"args.moe_shared_expert_intermediate_size = {arch.shared_ffn or None!r}: DeepseekV3's "
                           f"shared experts are n_shared_experts x moe_intermediate_size ({arch.moe_ffn}) wide")
    moe = [arch.is_moe(i) for i in range(arch.layers)]
    k = moe.index(True)
    if not all(moe[k:]):
        raise ReshardError(f"args.moe_layer_freq = {getattr(args, 'moe_layer_freq', None)!r}: DeepseekV3's MoE "
                           "layers are all those from first_k_dense_replace on")
    topk = int(getattr(args, "moe_router_topk", 2))
    groups = int(getattr(args, "moe_router_num_groups", None) or 1)
    group_topk = int(getattr(args, "moe_router_group_topk", None) or 0)
    if group_topk and topk // group_topk != 2:
        raise ReshardError(f"args.moe_router_group_topk = {group_topk} with moe_router_topk {topk}: Megatron ranks "
                           f"groups by their top {topk // group_topk} scores, DeepseekV3 by their top 2")
    if arch.experts // groups < 2:  # DeepseekV3 takes each group's top 2
        raise ReshardError(f"args.num_experts = {arch.experts} in {groups} groups: DeepseekV3 ranks groups by "
                           "their top 2 experts, so needs 2 or more per group")
    scale = getattr(args, "moe_router_topk_scaling_factor", None)
    return dict(n_routed_experts=arch.experts, num_experts_per_tok=topk, moe_intermediate_size=arch.moe_ffn,
                n_shared_experts=arch.shared_ffn // arch.moe_ffn, first_k_dense_replace=k,
                n_group=groups if group_topk else 1, topk_group=group_topk or 1, norm_topk_prob=topk > 1,
                routed_scaling_factor=float(scale) if scale else 1.0, scoring_func="sigmoid", topk_method="noaux_tc",
                output_router_logits=False)
def _refuse_router(args: Any) -> None:
    """Megatron router settings under which no Mixtral / Qwen-MoE model routes the same: the HF
    routers are ``softmax`` over all experts, top-k, optionally renormalised (``norm_topk_prob``)."""
    where = "the Hugging Face MoE router (softmax, top-k)"
    _refuse(args, "moe_router_score_function", lambda v: v not in (None, "softmax"), f"a router other than {where}")
    # sinkhorn and quantile balancing choose experts (and weights) their own way, at inference too
    _refuse(args, "moe_router_load_balancing_type", lambda v: v in ("sinkhorn", "quantile_balancing") or (
        isinstance(v, list) and any(x in ("sinkhorn", "quantile_balancing") for x in v)), f"a router other than {where}")
    _refuse(args, "moe_router_enable_expert_bias", bool, "a router expert_bias (no place in a Mixtral/Qwen-MoE model)")
    _refuse(args, "moe_router_topk_scaling_factor", lambda v: v not in (None, 1.0), "scaled routing weights")
    _refuse(args, "moe_router_num_groups", lambda v: v not in (None, 0, 1), "group-limited routing")
    _refuse(args, "moe_router_group_topk", lambda v: v not in (None, 0), "group-limited routing")
    _refuse(args, "moe_router_topk_limited_devices", lambda v: v is not None, "device-limited routing")
    _refuse(args, "moe_expert_capacity_factor", lambda v: v is not None and v >= 0, "token dropping (capacity)")
    _refuse(args, "moe_input_jitter_eps", lambda v: v is not None, "router input jitter")
    _refuse(args, "moe_router_force_load_balancing", bool, "forced (random) routing")
    _refuse(args, "moe_apply_probs_on_input", bool, "routing weights applied to the expert input")
    _refuse(args, "moe_latent_size", lambda v: v is not None, "latent MoE projections")


def _moe_config(args: Any, arch: Arch) -> dict[str, Any]:
    """The MoE part of the config: Qwen2-MoE (a gated shared expert), Qwen3-MoE (QK layer norms)
    or Mixtral. Megatron's default router (top-k of the logits, then softmax over those k) equals
    softmax, top-k, renormalised (``norm_topk_prob``); ``--moe-router-pre-softmax`` is softmax,
    top-k without it."""
    _refuse_router(args)
    norm = not bool(getattr(args, "moe_router_pre_softmax", False))
    topk = int(getattr(args, "moe_router_topk", 2))
    dense = [i for i in range(arch.layers) if not arch.is_moe(i)]
    qwen = dict(intermediate_size=arch.ffn, moe_intermediate_size=arch.moe_ffn, num_experts=arch.experts,
                num_experts_per_tok=topk, norm_topk_prob=norm, decoder_sparse_step=1, mlp_only_layers=dense,
                use_sliding_window=False, sliding_window=None, max_window_layers=arch.layers, output_router_logits=False)
    if arch.shared_ffn:  # Qwen2-MoE: shared_expert_gate is sigmoid(x W) times the shared expert, as Megatron's
        if not arch.shared_gate:
            raise ReshardError("args.moe_shared_expert_gate = False: a shared expert without its gate has no HF "
                               "config (Qwen2-MoE always gates it)")
        if arch.qk_norm:
            raise ReshardError("args.qk_layernorm with a shared expert: no Qwen2-MoE / Qwen3-MoE config holds both")
        return dict(qwen, architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", qkv_bias=arch.qkv_bias,
                    shared_expert_intermediate_size=arch.shared_ffn)
    if arch.qk_norm:
        if arch.qkv_bias:
            raise ReshardError("args.qk_layernorm with add_qkv_bias: no Qwen3-MoE config holds both")
        return dict(qwen, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", attention_bias=False)
    if dense:
        raise ReshardError(f"args.moe_layer_freq = {getattr(args, 'moe_layer_freq', None)!r}: dense layers among MoE "
                           "ones without QK layer norms or a shared expert have no HF config (Mixtral is MoE only)")
    if arch.qkv_bias:
        raise ReshardError("args.add_qkv_bias with experts: no Mixtral config holds q/k/v biases")
    if not norm:
        raise ReshardError("args.moe_router_pre_softmax = True: Mixtral always renormalises its top-k weights")
    return dict(architectures=["MixtralForCausalLM"], model_type="mixtral", intermediate_size=arch.moe_ffn,
                num_local_experts=arch.experts, num_experts_per_tok=topk, sliding_window=None, output_router_logits=False)


def _rope_theta(cfg: dict) -> float:
    params = cfg.get("rope_parameters") or {}
    if params.get("rope_type", "default") != "default" or cfg.get("rope_scaling"):
        raise ReshardError(f"config.json: RoPE scaling {params or cfg.get('rope_scaling')} is not imported by reshard")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def padded_vocab(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron's ``_vocab_size_with_padding``."""
    m = divisible_by * tp
    return -(-vocab // m) * m


_MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")


def _moe_args(cfg: dict, arch: str, layers: int, tp: int, ep: int, etp: int | None) -> dict[str, Any]:
    """The MoE fields of Megatron's ``args`` for a Mixtral / Qwen2-MoE / Qwen3-MoE config (empty
    for a dense model); the router as the HF one computes (see :func:`_moe_config`)."""
    kind = cfg.get("model_type")
    if kind == "deepseek_v3" and int(cfg.get("first_k_dense_replace", 0) or 0) < layers:
        return _deepseek_v3_moe_args(cfg, arch, layers, tp, ep, etp)
    if kind not in _MOE_TYPES:
        if ep != 1 or etp not in (None, tp):
            raise ReshardError(f"--ep / --etp: the HF model ({arch}) has no experts")
        return {}
    if kind == "mixtral":
        experts, ffn, norm, dense = int(cfg["num_local_experts"]), int(cfg["intermediate_size"]), True, []
    else:
        # Qwen3-MoE: transformers 5 saves num_experts as num_local_experts (its attribute_map)
        experts = int(cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"])
        ffn, norm = int(cfg["moe_intermediate_size"]), bool(cfg.get("norm_topk_prob"))
        step, only = int(cfg.get("decoder_sparse_step") or 1), set(cfg.get("mlp_only_layers") or [])
        dense = [i for i in range(layers) if i in only or (i + 1) % step != 0]
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) if kind == "qwen2_moe" else 0
    if kind == "qwen2_moe" and not shared:
        raise ReshardError(f"config.json ({arch}): shared_expert_intermediate_size = 0 is not imported")
    return dict(num_experts=experts, moe_ffn_hidden_size=ffn, moe_router_topk=int(cfg["num_experts_per_tok"]),
                moe_layer_freq=[0 if i in dense else 1 for i in range(layers)] if dense else 1,
                moe_router_pre_softmax=not norm, moe_router_score_function="softmax",
                moe_router_enable_expert_bias=False, moe_router_load_balancing_type="aux_loss",
                moe_aux_loss_coeff=float(cfg.get("router_aux_loss_coef") or 0.0), moe_grouped_gemm=False,
                moe_token_dispatcher_type="alltoall", moe_router_dtype=None, moe_expert_capacity_factor=None,
                moe_shared_expert_intermediate_size=shared or None, moe_shared_expert_gate=bool(shared),
                expert_model_parallel_size=ep, expert_tensor_parallel_size=etp or tp,
                sequence_parallel=tp > 1)  # Megatron's validate_args: MoE with TP needs sequence parallelism


def _deepseek_v3_moe_args(cfg: dict, arch: str, layers: int, tp: int, ep: int, etp: int | None) -> dict[str, Any]:
    """Megatron's MoE fields for a DeepSeek-V3 config (see :func:`_deepseek_v3_moe`): the first
    ``first_k_dense_replace`` layers dense, a sigmoid router with an expert bias, group-limited
    where DeepseekV3 limits groups, the shared experts one ungated MLP."""
    experts = int(cfg.get("n_routed_experts") or cfg.get("num_local_experts"))
    ffn, topk = int(cfg["moe_intermediate_size"]), int(cfg["num_experts_per_tok"])
    k = int(cfg.get("first_k_dense_replace", 0) or 0)
    if cfg.get("scoring_func", "sigmoid") != "sigmoid":
        raise ReshardError(f"config.json ({arch}): scoring_func = {cfg.get('scoring_func')!r}: transformers' "
                           "DeepseekV3 scores with a sigmoid whatever it says; not imported")
    if bool(cfg.get("norm_topk_prob", True)) != (topk > 1):  # Megatron's sigmoid router: renormalised iff k > 1
        raise ReshardError(f"config.json ({arch}): norm_topk_prob = {cfg.get('norm_topk_prob')!r} with "
                           f"num_experts_per_tok = {topk}: Megatron's sigmoid router renormalises exactly when top-k > 1")
    shared = int(cfg.get("n_shared_experts") or 0)
    if not shared:
        raise ReshardError(f"config.json ({arch}): n_shared_experts = 0 (an empty shared MLP) is not imported")
    groups, group_topk = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    if experts % groups or experts // groups < 2 or not 1 <= group_topk <= groups:
        raise ReshardError(f"config.json ({arch}): {experts} experts in n_group = {groups}, topk_group = {group_topk}: "
                           "not a grouping DeepseekV3 computes")
    limited = group_topk < groups  # every group kept: no limit
    if limited and topk // group_topk != 2:
        raise ReshardError(f"config.json ({arch}): num_experts_per_tok = {topk} with topk_group = {group_topk}: "
                           f"DeepseekV3 ranks groups by their top 2 experts, Megatron by their top {topk // group_topk}")
    scale = float(cfg.get("routed_scaling_factor") or 1.0)
    return dict(num_experts=experts, moe_ffn_hidden_size=ffn, moe_router_topk=topk,
                moe_layer_freq=[0 if i < k else 1 for i in range(layers)] if k else 1,
                moe_router_pre_softmax=False, moe_router_score_function="sigmoid",
                moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-3,
                moe_router_num_groups=groups if limited else None, moe_router_group_topk=group_topk if limited else None,
                moe_router_topk_scaling_factor=scale if scale != 1.0 else None,
                moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_grouped_gemm=False,
                moe_token_dispatcher_type="alltoall", moe_router_dtype=None, moe_expert_capacity_factor=None,
                moe_shared_expert_intermediate_size=shared * ffn, moe_shared_expert_gate=False,
                expert_model_parallel_size=ep, expert_tensor_parallel_size=etp or tp, sequence_parallel=tp > 1)


def args_from_hf(cfg: dict, *, tp: int, pp: int, dp: int, dtype: torch.dtype, divisible_by: int = 128,
                 ep: int = 1, etp: int | None = None) -> argparse.Namespace:
    """Megatron-LM ``args`` for the HF model ``cfg`` at TP x PP x DP (x EP, expert TP) (see the
    module doc)."""
    arch = (cfg.get("architectures") or ["?"])[0]
    if cfg.get("model_type") not in ("llama", "qwen2", "qwen3", "mistral", "deepseek_v3", *_MOE_TYPES):
        raise ReshardError(f"config.json: model_type {cfg.get('model_type')!r} ({arch}): reshard imports Llama, "
                           "Qwen2, Qwen3, Mistral, Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V3 models into "
                           "Megatron")
    if cfg.get("hidden_act", "silu") != "silu" or cfg.get("mlp_bias") or (cfg.get("sliding_window") and cfg.get(
            "use_sliding_window")):
        raise ReshardError(f"config.json ({arch}): a non-SwiGLU MLP, MLP biases or sliding windows are not imported")
    heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
    groups = int(cfg.get("num_key_value_heads") or heads)
    kind = cfg.get("model_type")
    qkv_bias = kind == "qwen2" or (kind == "qwen2_moe" and cfg.get("qkv_bias", True)) or bool(cfg.get("attention_bias"))
    if kind == "qwen3_moe" and cfg.get("attention_bias"):
        raise ReshardError(f"config.json ({arch}): attention_bias (o_proj too) is not imported")
    vocab = int(cfg["vocab_size"])
    seq = int(cfg.get("max_position_embeddings") or 4096)
    bf16, fp16 = dtype == torch.bfloat16, dtype == torch.float16
    fields = dict(
        num_layers=int(cfg["num_hidden_layers"]), hidden_size=hidden, ffn_hidden_size=int(cfg["intermediate_size"]),
        num_attention_heads=heads, group_query_attention=groups != heads, num_query_groups=groups,
        kv_channels=int(cfg.get("head_dim") or hidden // heads), max_position_embeddings=seq, seq_length=seq,
        position_embedding_type="rope", add_position_embedding=False, use_rotary_position_embeddings=True,
        rotary_base=int(_rope_theta(cfg)) if _rope_theta(cfg).is_integer() else _rope_theta(cfg), rotary_percent=1.0,
        rotary_interleaved=False, use_rope_scaling=False, swiglu=True, squared_relu=False, openai_gelu=False,
        normalization="RMSNorm", norm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)), apply_layernorm_1p=False,
        layernorm_zero_centered_gamma=False, add_bias_linear=False, disable_bias_linear=True, add_qkv_bias=qkv_bias,
        untie_embeddings_and_output_weights=not bool(cfg.get("tie_word_embeddings", False)),
        apply_query_key_layer_scaling=False, attention_dropout=0.0, hidden_dropout=0.0,
        qk_layernorm=kind in ("qwen3", "qwen3_moe"),
        multi_latent_attention=False, num_experts=None, vocab_size=vocab, make_vocab_size_divisible_by=divisible_by,
        padded_vocab_size=padded_vocab(vocab, divisible_by, tp),
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, data_parallel_size=dp, world_size=tp * pp * dp,
        expert_model_parallel_size=1, expert_tensor_parallel_size=tp, context_parallel_size=1,
        virtual_pipeline_model_parallel_size=None, bf16=bf16, fp16=fp16, params_dtype=dtype,
        accumulate_allreduce_grads_in_fp32=bf16 or fp16, ckpt_format="torch_dist", use_distributed_optimizer=False,
        transformer_impl="local", init_method_std=float(cfg.get("initializer_range", 0.02)),
        tokenizer_type="NullTokenizer", iteration=0, consumed_train_samples=0, skipped_train_samples=0,
        consumed_valid_samples=0,
        # training fields: Megatron-LM's defaults (a training command line sets its own)
        optimizer="adam", lr=1e-4, min_lr=0.0, lr_decay_style="linear", weight_decay=0.01, adam_beta1=0.9,
        adam_beta2=0.999, adam_eps=1e-8, clip_grad=1.0, seed=1234, micro_batch_size=1, global_batch_size=dp,
        train_iters=1, lr_warmup_iters=0,
    )
    if cfg.get("model_type") == "deepseek_v3":
        fields.update(_mla_args(cfg, arch))
    try:
        fields.update(_moe_args(cfg, arch, fields["num_layers"], tp, ep, etp))
    except ReshardError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise ReshardError(f"config.json ({arch}): lacks or mis-states a field the MoE model needs ({e!r})") from None
    return argparse.Namespace(**fields)


def _mla_args(cfg: dict, arch: str) -> dict[str, Any]:
    """Megatron's multi-latent attention fields for a DeepSeek-V3 (``deepseek_v3.json``)."""
    # num_nextn_predict_layers (transformers' default 1) is read by no DeepseekV3 module: a folder's MTP tensors
    # (model.layers.<num_hidden_layers>.*) have no Megatron key, so they are refused by name unless --drop
    if not cfg.get("rope_interleave", True):
        raise ReshardError(f"config.json ({arch}): rope_interleave = false: Megatron's MLA takes the rope part "
                           "interleaved (rows would need permuting), not imported by reshard")
    if cfg.get("attention_bias"):
        raise ReshardError(f"config.json ({arch}): attention_bias: Megatron's MLA projections have no biases")
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    if eps != 1e-6:  # Megatron has one eps for every norm; DeepseekV3's latent norms fix theirs at 1e-6
        raise ReshardError(f"config.json ({arch}): rms_norm_eps = {eps!r}: DeepseekV3's latent norms use 1e-6 and "
                           "Megatron one eps for every norm, so no Megatron model computes this one")
    q_lora = cfg.get("q_lora_rank")
    if q_lora is None:  # MLASelfAttention refuses a q_layernorm without q_lora_rank (QKNormConfigResolver)
        raise ReshardError(f"config.json ({arch}): q_lora_rank = null (one q_proj, no q norm): Megatron's MLA with "
                           "latent norms has no such layout (its local spec needs q_lora_rank), not imported")
    return dict(multi_latent_attention=True, q_lora_rank=int(q_lora),
                kv_lora_rank=int(cfg["kv_lora_rank"]), qk_head_dim=int(cfg["qk_nope_head_dim"]),
                qk_pos_emb_head_dim=int(cfg["qk_rope_head_dim"]), v_head_dim=int(cfg["v_head_dim"]),
                kv_channels=int(cfg["v_head_dim"]), group_query_attention=False,
                num_query_groups=int(cfg["num_attention_heads"]), rope_type="rope", qk_layernorm=True,
                layernorm_epsilon=eps, rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0,
                mla_down_proj_fusion=False, cache_mla_latents=False)
