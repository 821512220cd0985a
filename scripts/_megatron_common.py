"""What the Megatron fixture job and the oracle job share: Megatron-LM's own startup, model
builder and training step, run on CPU under ``torchrun`` (``gloo``).

Everything here runs inside the Megatron venv (``/work/venvs/megatron``, see
``make_megatron_fixtures.py --venv-help``), never in reshard's own environment. Import
``_megatron_cpu`` and call ``install()`` before importing this module.

The pieces, and where they come from:

- arguments: ``megatron.training.arguments.parse_and_validate_args`` on a Megatron-LM command line
  (``sys.argv``), which also builds the ``NullTokenizer`` and sets ``args.padded_vocab_size``;
- start-up: ``megatron.training.initialize.initialize_megatron(allow_no_cuda=True)``. With no GPU
  it would skip ``mpu.initialize_model_parallel`` and ``model_parallel_cuda_manual_seed``
  (both sit behind ``torch.cuda.device_count() > 0``), so it runs with ``device_count`` answering
  1 and ``set_device`` a no-op; ``_compile_dependencies`` (it builds the C++ dataset helpers,
  unused here) is skipped;
- model: :func:`model_provider` builds ``GPTModel`` the way Megatron-LM's ``gpt_builders.py``
  does for ``--transformer-impl local`` (``get_gpt_layer_local_spec``, or
  ``get_gpt_decoder_block_spec`` with ``--num-experts``);
- model + DDP + optimizer + scheduler (+ ``load_checkpoint`` when ``--load`` is given):
  ``megatron.training.training.setup_model_and_optimizer``;
- a step: ``megatron.training.training.train_step`` with Megatron's
  ``get_forward_backward_func()`` schedule, after the ``config`` hooks ``train()`` sets;
- saving: ``megatron.training.checkpointing.save_checkpoint``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
from functools import partial

import torch

SEQ_LEN = 16
DATA_SEED = 4321


@contextlib.contextmanager
def _hopper_properties():
    """``validate_args`` asks the compute capability when TP > 1 (below 10 it requires
    ``CUDA_DEVICE_MAX_CONNECTIONS=1``, which the launcher sets); answer as a Hopper would."""
    saved = torch.cuda.get_device_properties
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(major=9, minor=0)
    try:
        yield
    finally:
        torch.cuda.get_device_properties = saved


@contextlib.contextmanager
def _one_pretend_gpu():
    saved = torch.cuda.device_count, torch.cuda.set_device
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda *a, **k: None
    try:
        yield
    finally:
        torch.cuda.device_count, torch.cuda.set_device = saved


def start_megatron(mlm_argv: list[str]):
    """Parse ``mlm_argv`` as Megatron-LM's command line and initialize Megatron on this rank."""
    sys.argv = ["pretrain_gpt.py", *mlm_argv]
    from megatron.training import initialize
    from megatron.training.arguments import parse_and_validate_args

    with _hopper_properties():
        args = parse_and_validate_args()
    initialize._compile_dependencies = lambda: None
    with _one_pretend_gpu():
        initialize.initialize_megatron(allow_no_cuda=True)
    return args


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """``GPTModel`` as Megatron-LM's ``gpt_builders.gpt_builder`` builds it for the local spec."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    if config is None:
        config = core_transformer_config_from_args(args)
    assert args.transformer_impl == "local"
    if args.num_experts:
        layer_spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=False, normalization=args.normalization,
            qk_l2_norm=args.qk_l2_norm, vp_stage=vp_stage,
        )
    else:
        layer_spec = get_gpt_layer_local_spec(
            args.num_experts,
            args.moe_grouped_gemm,
            args.qk_layernorm,
            args.multi_latent_attention,
            normalization=args.normalization,
            qk_l2_norm=args.qk_l2_norm,
        )
    if args.multi_latent_attention:
        _mla_core_attention(layer_spec)
    mtp = None
    if args.mtp_num_layers:  # as gpt_builders: the MTP block's layers take the decoder's (last) layer spec
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        mtp = get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=False, vp_stage=vp_stage)
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        mtp_block_spec=mtp,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )


def _mla_dot_product_attention():
    """The local ``DotProductAttention`` taking MLA's ``k_channels`` / ``v_channels`` (the head
    dims of q·k and of v; Megatron 0.19.2's local class lacks them, TE's takes them). It holds no
    parameters; its output reshape uses ``kv_channels * heads``, so the recipe sets
    ``--kv-channels`` to ``--v-head-dim``."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        def __init__(self, *a, k_channels=None, v_channels=None, **kw):
            super().__init__(*a, **kw)

    return MLADotProductAttention


def _mla_core_attention(layer_spec) -> None:
    """Every layer spec of ``layer_spec`` (one layer's, or a block's) gets that core attention."""
    cls = _mla_dot_product_attention()
    specs = getattr(layer_spec, "layer_specs", None) or [layer_spec]
    for spec in specs:
        spec.submodules.self_attention.submodules.core_attention = cls


def setup():
    """``setup_model_and_optimizer``, then (with ``--load``) ``load_checkpoint`` as it would run it.

    With the distributed optimizer and no Apex / Transformer Engine (so torch's Adam), Megatron
    0.19.2 cannot load ``torch_dist`` optimizer state into a fresh optimizer: ``DistributedOptimizer.state_dict``
    reads every Adam state's ``step`` and asserts they agree, but a fresh optimizer has none
    (``assert len(steps) == 1`` fails). Then the model and optimizer are built first and given
    state by Megatron's own ``_init_optimizer_states_with_dummy_values`` (one zero-gradient
    step, as Megatron does before an ``fsdp_dtensor`` load), and ``load_checkpoint`` runs after,
    overwriting weights, main parameters and moments alike.

    The load runs under ``torch.no_grad()``: with fp32 parameters the distributed optimizer's
    main parameters are views of the model's (leaves that require grad), and
    ``load_parameter_state_from_dp_reshardable`` -- unlike its siblings, not decorated with
    ``@torch.no_grad()`` in 0.19.2 -- copies into them in place, which autograd refuses.
    """
    from megatron.core.enums import ModelType
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.training import get_args
    from megatron.training.checkpointing import load_checkpoint
    from megatron.training.training import setup_model_and_optimizer

    args = get_args()
    if args.load is None:
        return setup_model_and_optimizer(ModelType.encoder_or_decoder, model_provider)
    load, args.load = args.load, None
    model, optimizer, scheduler = setup_model_and_optimizer(ModelType.encoder_or_decoder, model_provider)
    args.load = load
    if args.use_distributed_optimizer and not args.no_load_optim and args.ckpt_format == "torch_dist":
        for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
            if isinstance(sub, DistributedOptimizer):
                sub._init_optimizer_states_with_dummy_values()
    with torch.no_grad():
        args.iteration, args.num_floating_point_operations_so_far = load_checkpoint(model, optimizer, scheduler)
    return model, optimizer, scheduler


def global_batch(step: int, global_batch_size: int, vocab_size: int, seq_len: int = SEQ_LEN) -> torch.Tensor:
    """The token ids of step ``step``: ``(global_batch_size, seq_len + 1)``, fixed by ``DATA_SEED``."""
    g = torch.Generator().manual_seed(DATA_SEED + step)
    return torch.randint(0, vocab_size, (global_batch_size, seq_len + 1), generator=g)


def microbatches(step: int, args) -> list[dict]:
    """This DP rank's microbatches of step ``step`` (rows ``[dp_rank * n, (dp_rank + 1) * n)``)."""
    from megatron.core import mpu

    tokens = global_batch(step, args.global_batch_size, args.vocab_size, args.seq_length)
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    per_rank = args.global_batch_size // dp
    mine = tokens[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    return [
        make_inputs(mine[i : i + args.micro_batch_size]) for i in range(0, per_rank, args.micro_batch_size)
    ]


def make_inputs(tokens_plus_one: torch.Tensor) -> dict:
    from megatron.training.utils import get_ltor_masks_and_position_ids

    tokens = tokens_plus_one[:, :-1].contiguous()
    labels = tokens_plus_one[:, 1:].contiguous()
    attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
        tokens, eod_token=-1, pad_token=-1, reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, pad_mask_loss=False,
    )
    return dict(tokens=tokens, labels=labels, loss_mask=loss_mask, attention_mask=attention_mask,
                position_ids=position_ids)


def loss_func(loss_mask, output_tensor):
    """Megatron-LM ``pretrain_gpt.loss_func``'s shape: (sum, token count, report)."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.view(1).float()])
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def train(model, optimizer, opt_param_scheduler, steps: int) -> list[float]:
    """``steps`` calls of Megatron-LM's ``train_step``; returns the reported 'lm loss' per step
    (on the last pipeline stage; empty elsewhere)."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.rerun_state_machine import RerunDataIterator
    from megatron.core.utils import get_model_config
    from megatron.training import get_args, get_timers
    from megatron.training.training import train_step

    args = get_args()
    config = get_model_config(model[0])
    config.grad_scale_func = optimizer.scale_loss
    config.timers = get_timers()
    if config.finalize_model_grads_func is None:
        config.finalize_model_grads_func = finalize_model_grads
    for m in model:
        m.train()
    fwd_bwd = get_forward_backward_func()
    losses = []
    for step in range(steps):
        # the interleaved (virtual pipeline) schedule reads one iterator per model chunk
        its = [RerunDataIterator(iter(microbatches(step, args))) for _ in model]
        it = its[0] if len(its) == 1 else its
        out = train_step(forward_step, it, model, optimizer, opt_param_scheduler, config, fwd_bwd, iteration=step)
        loss_dict, skipped = out[0], out[1]
        assert not skipped, f"step {step} was skipped"
        args.consumed_train_samples = getattr(args, "consumed_train_samples", 0) + args.global_batch_size
        if loss_dict:
            losses.append(float(loss_dict["lm loss"]))
    return losses


def rank_info() -> dict:
    from megatron.core import mpu

    return dict(
        rank=torch.distributed.get_rank(),
        tp=mpu.get_tensor_model_parallel_rank(),
        pp=mpu.get_pipeline_model_parallel_rank(),
        dp=mpu.get_data_parallel_rank(),
        ep=mpu.get_expert_model_parallel_rank(),
    )


def env_world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))
