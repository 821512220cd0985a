"""What a ``torch_dist`` target holds besides tensors (docs/megatron-checkpoints.md §2.5, §2.7):
``common_state`` with ``args`` updated for the target topology and optimizer layout, the
optimizer entries of each layout, and the per-layer ``_extra_state`` placeholders.

From a Megatron source its own ``common_state`` (or a legacy file's top-level entries) is the
template: only the parallel sizes, the padded vocabulary, the optimizer layout and what depends on
them change. From any other source the ``args`` are built from the HF config
(``hfconfig.args_from_hf``) and the checkpoint is a ``release`` one (iteration 0; Megatron then
loads the model only, as after Megatron-Bridge's import).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from .model import EXPERTS, SHARED, Arch

__all__ = ["KINDS", "args_for", "buffer_dtype", "common_state", "default_groups", "extra_state_keys"]

KINDS = ("none", "adam", "dp_reshardable", "fully_reshardable")


def buffer_dtype(args: Any) -> tuple[torch.dtype, torch.dtype]:
    """The DDP buffer's (param dtype, grad dtype): the bucket keys' ``dtype_`` part."""
    params = torch.bfloat16 if getattr(args, "bf16", False) else torch.float16 if getattr(args, "fp16", False) \
        else torch.float32
    grad = torch.float32 if (getattr(args, "accumulate_allreduce_grads_in_fp32", False) or params == torch.float32) \
        else params
    return params, grad


def args_for(args: Any, arch: Arch, kind: str) -> Any:
    """``args`` with the target's parallel sizes, padded vocabulary and optimizer layout."""
    out = copy.copy(args)
    world = arch.tp * arch.pp * arch.dp
    updates = dict(tensor_model_parallel_size=arch.tp, pipeline_model_parallel_size=arch.pp,
                   data_parallel_size=arch.dp, world_size=world, expert_model_parallel_size=arch.ep,
                   expert_tensor_parallel_size=arch.etp, padded_vocab_size=arch.padded_vocab, ckpt_format="torch_dist",
                   use_distributed_optimizer=kind in ("dp_reshardable", "fully_reshardable"),
                   dist_ckpt_optim_fully_reshardable=kind == "fully_reshardable")
    if kind == "none":
        updates.pop("use_distributed_optimizer")
        updates.pop("dist_ckpt_optim_fully_reshardable")
    for k, v in updates.items():
        setattr(out, k, v)
    _derived_args(out, args, arch, world)
    if arch.even:  # a target over even, non-virtual stages says so (fields the source may lack stay unset)
        for k in ("virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
                  "num_virtual_stages_per_pipeline_rank", "decoder_first_pipeline_num_layers",
                  "decoder_last_pipeline_num_layers"):
            if getattr(out, k, None) is not None:
                setattr(out, k, None)
    _virtual_args(out, args, arch)
    return out


def _derived_args(out: Any, args: Any, arch: Arch, world: int) -> None:
    """The fields ``validate_args`` derives from the parallel sizes, as it would at the target: the
    weight shards of TP and expert TP (``tp * gtp_weight_remat_size``; GTP sources are refused, so
    the remat size is 1), the transformer's pipeline size, sequence parallelism (off without TP),
    and the fields whose argparse default is the run's size: the in-process restart's active world
    and a global batch that was not given (``micro_batch_size * dp``). A value the source set
    apart from its own topology is the user's and is kept."""
    updates: dict[str, Any] = dict(
        transformer_pipeline_model_parallel_size=arch.pp, tensor_parallel_num_weight_shards=arch.tp,
        gtp_weight_remat_size=1, expert_tensor_parallel_num_weight_shards=arch.etp, expert_gtp_weight_remat_size=1)
    old_world = getattr(args, "world_size", None)
    if getattr(args, "inprocess_active_world_size", old_world) == old_world:  # argparse default: WORLD_SIZE
        updates["inprocess_active_world_size"] = world
    if getattr(args, "_is_global_batch_size_explicitly_specified", True) is False and \
            getattr(args, "micro_batch_size", None):
        old = getattr(args, "global_batch_size", None)
        updates["global_batch_size"] = args.micro_batch_size * arch.dp
        if getattr(args, "eval_global_batch_size", None) == old:  # its default is the global batch
            updates["eval_global_batch_size"] = updates["global_batch_size"]
    if arch.tp == 1:  # validate_args turns it off without TP (and TP comm overlap needs it)
        for k in ("sequence_parallel", "tp_comm_overlap"):
            if getattr(out, k, False):
                updates[k] = False
    for k, v in updates.items():
        setattr(out, k, v)


def _virtual_args(out: Any, args: Any, arch: Arch) -> None:
    """The virtual stages' fields as Megatron's ``validate_args`` leaves them: the size and the flag
    it was asked by (layers per virtual stage, or stages per rank where the stages are uneven), and
    the interleaved schedule's p2p overlap and aligned param gather (off without virtual stages; on,
    Megatron's defaults, where the source had none to say otherwise)."""
    if arch.vpp == 1:
        for k in ("virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
                  "num_virtual_stages_per_pipeline_rank"):
            if getattr(out, k, None) is not None:
                setattr(out, k, None)
        for k in ("overlap_p2p_comm", "align_param_gather"):
            if hasattr(out, k):
                setattr(out, k, False)
        return
    per_rank = arch.first is not None or arch.last is not None or \
        getattr(args, "num_virtual_stages_per_pipeline_rank", None) is not None
    out.virtual_pipeline_model_parallel_size = arch.vpp
    out.num_virtual_stages_per_pipeline_rank = arch.vpp if per_rank else None
    out.num_layers_per_virtual_pipeline_stage = None if per_rank else arch.layers // (arch.pp * arch.vpp)
    if not getattr(args, "virtual_pipeline_model_parallel_size", None):
        out.overlap_p2p_comm = out.align_param_gather = True


def default_groups(args: Any, expert: bool = False) -> list[dict[str, Any]]:
    """Megatron's two parameter groups (weight decay, none) from ``args``, as a fresh run has."""
    def group(wd_mult: float) -> dict[str, Any]:
        lr = float(getattr(args, "lr", 1e-4) or 1e-4)
        return {"is_expert_parallel": expert, "default_config": True, "wd_mult": wd_mult, "lr_mult": 1.0,
                "is_decoupled_lr": False, "max_lr": lr, "min_lr": float(getattr(args, "min_lr", 0.0) or 0.0), "lr": lr,
                "betas": (float(getattr(args, "adam_beta1", 0.9)), float(getattr(args, "adam_beta2", 0.999))),
                "eps": float(getattr(args, "adam_eps", 1e-8)),
                "weight_decay": float(getattr(args, "weight_decay", 0.01)) * wd_mult, "amsgrad": False,
                "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
                "decoupled_weight_decay": True}
    return [group(1.0), group(0.0)]


def _optimizer_entry(kind: str, groups: list[dict], step: float) -> dict[str, Any]:
    plain = [{k: v for k, v in g.items() if k not in ("params", "step")} for g in groups]
    if kind == "adam":
        return {"state": {"common_step": torch.tensor(float(step))}, "param_groups": plain}
    if kind == "fully_reshardable":
        return {"optimizer": {"param_groups": [dict(g, step=float(step)) for g in plain]},
                "param_state_sharding_type": "fully_reshardable"}
    return {"param_state_sharding_type": "dp_reshardable"}


def content_metadata(kind: str) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    if kind in ("dp_reshardable", "fully_reshardable"):
        meta["distrib_optim_sharding_type"] = kind
    if kind == "fully_reshardable":
        meta["distrib_optim_fully_reshardable_mem_efficient"] = False
    meta.update(singleton_local_shards=False, chained_optim_avoid_prefix=True)
    return meta


def common_state(template: dict | None, args: Any, arch: Arch, kind: str, groups: list[list[dict]],
                 step: float, iteration: int) -> dict[str, Any]:
    """The target's ``common_state``: the source's (``template``) with the target's args and
    optimizer entries, or a fresh one. ``groups``: the param groups of each optimizer (dense,
    and experts' with experts)."""
    out: dict[str, Any] = {}
    keep = ("checkpoint_version", "iteration", "opt_param_scheduler", "rerun_state_machine",
            "num_floating_point_operations_so_far")
    for k in keep:
        if template is not None and k in template:
            out[k] = template[k]
    out["args"] = args
    out.setdefault("checkpoint_version", 3.0)
    out["iteration"] = iteration
    if kind != "none":
        entries = [_optimizer_entry(kind, g, step) for g in groups]
        out["optimizer"] = entries[0] if len(entries) == 1 else dict(enumerate(entries))
    out.setdefault("num_floating_point_operations_so_far", 0.0)
    out["content_metadata"] = content_metadata(kind)
    order = ["args", "checkpoint_version", "iteration", "optimizer", "opt_param_scheduler", "rerun_state_machine",
             "num_floating_point_operations_so_far", "content_metadata"]
    return {k: out[k] for k in order if k in out}


def extra_state_keys(arch: Arch) -> list[str]:
    """The local spec's ``_extra_state`` object keys: one per layer and linear module (``None``
    values), experts' one per layer and expert; per-layer keys (mixed layers) name the layer."""
    def modules(moe: bool) -> list[str]:
        mlp = [SHARED] if moe and arch.shared_ffn else [] if moe else ["decoder.layers.mlp"]
        attn = [f"decoder.layers.self_attention.{n}" for n in arch.attention_linears()]
        return attn + [f"{m}.{w}" for m in mlp for w in ("linear_fc1", "linear_fc2")]

    experts = [f"{EXPERTS}.{w}" for w in ("linear_fc1", "linear_fc2")]
    mtp = []
    for k in range(arch.mtp):  # the MTP layer takes the last decoder layer's spec; its experts one object each
        at = f"mtp.layers.{k}."
        mtp += [f"{at}{m}._extra_state/shard_0_1"
                for m in ["eh_proj"] + [x.replace("decoder.layers.", "transformer_layer.", 1)
                                        for x in modules(arch.mtp_moe)]]
        if arch.mtp_moe:
            mtp += [f"{m.replace('decoder.layers.', at + 'transformer_layer.', 1)}._extra_state/shard_{e}_{arch.experts}"
                    for m in experts for e in range(arch.experts)]
    if arch.per_layer:
        out = []
        for i in range(arch.layers):
            moe = arch.is_moe(i)
            at = f"decoder.layers.{i}."
            out += [f"{m.replace('decoder.layers.', at, 1)}._extra_state/shard_0_1" for m in modules(moe)]
            if moe:
                out += [f"{m.replace('decoder.layers.', at, 1)}._extra_state/shard_{e}_{arch.experts}"
                        for m in experts for e in range(arch.experts)]
        return out + mtp
    out = [f"{m}._extra_state/shard_{i}_{arch.layers}" for m in modules(bool(arch.experts)) for i in range(arch.layers)]
    if arch.experts:
        out += [f"{m}._extra_state/shard_{i}.{e}_{arch.layers}.{arch.experts}"
                for m in experts for i in range(arch.layers) for e in range(arch.experts)]
    return out + mtp
