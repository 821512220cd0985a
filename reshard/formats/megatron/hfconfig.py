"""The two directions between Megatron's ``args`` and a transformers ``config.json`` for
Llama / Qwen2-style GQA models (Qwen3 with QK layer norms, Mixtral with experts):

* :func:`hf_config`: the ``config.json`` of a Hugging Face export of a Megatron model;
* :func:`args_from_hf`: the ``argparse.Namespace`` a Megatron-LM ``load_checkpoint`` needs
  (``--use-checkpoint-args`` takes the model shape from it) for an HF import. Model fields come
  from the config; parallel sizes from the target; training fields are Megatron-LM's defaults,
  which a training command line overrides (documented in docs/megatron-checkpoints.md §8).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from ...errors import ReshardError
from .model import MLA, Arch

__all__ = ["args_from_hf", "hf_config"]

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _refuse(args: Any, field: str, bad: Any, what: str) -> None:
    value = getattr(args, field, None)
    if bad(value):
        raise ReshardError(f"args.{field} = {value!r}: {what} has no Llama/Qwen2 config")


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
    if arch.experts and arch.qk_norm:
        raise ReshardError("args.qk_layernorm = True with experts: a Qwen3-MoE config is not written by reshard")
    if arch.experts:
        base.update(architectures=["MixtralForCausalLM"], model_type="mixtral", intermediate_size=arch.moe_ffn,
                    num_local_experts=arch.experts, num_experts_per_tok=int(getattr(args, "moe_router_topk", 2)))
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
    """A dense DeepSeek-V3 config for multi-latent attention (``deepseek_v3.json``): the rope
    part interleaved on both sides (``rope_interleave``), the latent norms present."""
    _refuse(args, "rope_type", lambda v: v not in (None, "rope"), "MLA with YaRN RoPE (--rope-type yarn)")
    _refuse(args, "qk_layernorm", lambda v: not v, "MLA without latent norms (DeepseekV3 always has them)")
    if float(getattr(args, "mscale_all_dim", 0) or 0) and float(getattr(args, "rotary_scaling_factor", 1) or 1) > 1:
        raise ReshardError("args.mscale_all_dim with rotary_scaling_factor > 1: a YaRN softmax scale DeepseekV3 "
                           "applies only with YaRN RoPE")
    if arch.experts:
        raise ReshardError("args.num_experts with multi_latent_attention: a DeepSeek-V3 MoE config is not written "
                           "by reshard yet (dense MLA only)")
    if base["rms_norm_eps"] != 1e-6:  # DeepseekV3RMSNorm(q_lora_rank) / (kv_lora_rank): eps fixed at 1e-6
        raise ReshardError(f"args.norm_epsilon = {base['rms_norm_eps']!r} with multi_latent_attention: transformers' "
                           "DeepseekV3 fixes its latent norms' eps at 1e-6, so no DeepseekV3 config computes this model")
    base.pop("head_dim")
    base.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", num_key_value_heads=arch.heads,
                q_lora_rank=m.q_lora or None, kv_lora_rank=m.kv_lora, qk_nope_head_dim=m.qk_head,
                qk_rope_head_dim=m.rope, v_head_dim=m.v_head, rope_interleave=True, attention_bias=False,
                first_k_dense_replace=arch.layers, n_routed_experts=1, n_shared_experts=0, num_experts_per_tok=1,
                moe_intermediate_size=arch.ffn, n_group=1, topk_group=1, num_nextn_predict_layers=0, pretraining_tp=1)
    return base


def _rope_theta(cfg: dict) -> float:
    params = cfg.get("rope_parameters") or {}
    if params.get("rope_type", "default") != "default" or cfg.get("rope_scaling"):
        raise ReshardError(f"config.json: RoPE scaling {params or cfg.get('rope_scaling')} is not imported by reshard")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def padded_vocab(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron's ``_vocab_size_with_padding``."""
    m = divisible_by * tp
    return -(-vocab // m) * m


def args_from_hf(cfg: dict, *, tp: int, pp: int, dp: int, dtype: torch.dtype, divisible_by: int = 128) -> argparse.Namespace:
    """Megatron-LM ``args`` for the HF model ``cfg`` at TP x PP x DP (see the module doc)."""
    arch = (cfg.get("architectures") or ["?"])[0]
    if cfg.get("model_type") not in ("llama", "qwen2", "qwen3", "mistral", "deepseek_v3"):
        raise ReshardError(f"config.json: model_type {cfg.get('model_type')!r} ({arch}): reshard imports Llama, "
                           "Qwen2, Qwen3, Mistral and dense DeepSeek-V3 models into Megatron")
    if cfg.get("hidden_act", "silu") != "silu" or cfg.get("mlp_bias") or (cfg.get("sliding_window") and cfg.get(
            "use_sliding_window")):
        raise ReshardError(f"config.json ({arch}): a non-SwiGLU MLP, MLP biases or sliding windows are not imported")
    heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
    groups = int(cfg.get("num_key_value_heads") or heads)
    qkv_bias = cfg.get("model_type") == "qwen2" or bool(cfg.get("attention_bias"))
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
        qk_layernorm=cfg.get("model_type") == "qwen3",
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
        adam_beta2=0.999, adam_eps=1e-8, clip_grad=1.0, seed=1234, micro_batch_size=1, global_batch_size=1,
        train_iters=1, lr_warmup_iters=0,
    )
    if cfg.get("model_type") == "deepseek_v3":
        fields.update(_mla_args(cfg, arch))
    return argparse.Namespace(**fields)


def _mla_args(cfg: dict, arch: str) -> dict[str, Any]:
    """Megatron's multi-latent attention fields for a dense DeepSeek-V3 (``deepseek_v3.json``)."""
    layers = int(cfg["num_hidden_layers"])
    if int(cfg.get("first_k_dense_replace", 0) or 0) < layers:
        raise ReshardError(f"config.json ({arch}): first_k_dense_replace = {cfg.get('first_k_dense_replace')} < "
                           f"{layers} layers: DeepSeek-V3 MoE layers are not imported by reshard yet (dense only)")
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
