"""Training entry point launched (one process per rank) by ``scripts/make_fixtures.py``.

Not meant to be run by hand.  Usage (through the ``deepspeed`` launcher)::

    deepspeed --num_gpus N --no_local_rank --master_port PORT \
        scripts/_fixture_train.py --spec SPEC.json

``SPEC.json`` holds::

    {
      "model_type": "llama",              # transformers model type (AutoConfig.for_model)
      "model_config": {...},              # kwargs for the config class
      "ds_config": {...},                 # DeepSpeed config dict
      "steps": 3,
      "seed": 1234,
      "seq_len": 16,
      "micro_batch": 2,                   # per data-parallel rank
      "save_dir": "/tmp/.../ckpt",        # engine.save_checkpoint(save_dir, tag=tag)
      "tag": "global_step3",
      "report_dir": "/tmp/.../report",    # each rank writes rank_<r>.json here
      "load_dir": null,                   # or: engine.load_checkpoint(load_dir) before the steps
      "frozen": []                        # parameter names set requires_grad_(False) before initialize
    }                                     # (a universal one with ds_config checkpoint.load_universal)

The batch is synthetic and fixed: a global batch of ``micro_batch * dp_world_size``
sequences drawn from ``torch.Generator().manual_seed(seed + 1)``; each data-parallel rank
takes its own slice, tensor-parallel peers take the same slice.  The same batch is used at
every step.  Labels are the input ids (causal-LM loss computed inside the HF model).
"""

import argparse
import json
import os
import random
import time

import numpy as np
import torch


def _seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _patch_gpt_bigcode_empty_query_shard():
    """Let HF GPT-BigCode (MQA) run on an AutoTP rank that holds no query heads.

    DeepSpeed 0.19.8 AutoTP splits the fused ``c_attn`` query rows by the key/value head count,
    which is 1 under multi-query attention, so with TP=2 rank 1 gets 0 query rows (and the whole
    replicated k/v block) and its row-parallel ``c_proj`` gets 0 input columns.  DeepSpeed says
    that is fine ("ranks beyond the head count hold no attention shard"; the all-reduce in
    ``c_proj`` sums an empty contribution), but the HF modelling code crashes on it in
    ``eager_attention_forward``::

        RuntimeError: The size of tensor a (0) must match the size of tensor b (4) at
        non-singleton dimension 1

    This patch only touches that case: on a rank whose ``c_attn`` output is just the k/v block,
    the attention output is an empty ``(batch, seq, 0)`` tensor fed to the sharded ``c_proj``
    (which still joins the all-reduce).  ``c_attn`` is still applied and tied into the graph with
    a zero weight so its parameters get a (zero) gradient as they would from a real empty
    attention.  Ranks that hold query heads run the unmodified HF forward.
    """
    from transformers.models.gpt_bigcode import modeling_gpt_bigcode as m

    original = m.GPTBigCodeAttention.forward

    def forward(self, hidden_states, layer_past=None, attention_mask=None, encoder_hidden_states=None,
                encoder_attention_mask=None, use_cache=False, output_attentions=False, **kwargs):
        weight = self.c_attn.weight
        if (self.multi_query and not self.is_cross_attention and layer_past is None
                and weight.shape[0] == 2 * self.kv_dim):
            kv = self.c_attn(hidden_states)
            empty = hidden_states.new_zeros(*hidden_states.shape[:-1], 0) + 0.0 * kv.sum()
            out = self.resid_dropout(self.c_proj(empty))
            return out, None
        return original(self, hidden_states, layer_past=layer_past, attention_mask=attention_mask,
                        encoder_hidden_states=encoder_hidden_states,
                        encoder_attention_mask=encoder_attention_mask, use_cache=use_cache,
                        output_attentions=output_attentions, **kwargs)

    m.GPTBigCodeAttention.forward = forward


PATCHES = {"gpt_bigcode_empty_query_shard": _patch_gpt_bigcode_empty_query_shard}


def setup(spec: dict) -> torch.nn.Module:
    """Process setup shared by every DeepSpeed job of the fixtures and the end-to-end tests:
    deterministic single-threaded kernels, the gloo process group, the spec's model patches, and
    the model built from its ``transformers`` config after seeding (random init, no download)."""
    # Deterministic CPU kernels where torch offers them; single intra-op thread so that
    # reductions inside matmuls do not depend on the thread split.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True, warn_only=True)

    import deepspeed
    from transformers import AutoConfig, AutoModelForCausalLM

    deepspeed.init_distributed(dist_backend="gloo")
    for patch in spec.get("patches", []):
        PATCHES[patch]()
    _seed_everything(int(spec["seed"]))
    config = AutoConfig.for_model(spec["model_type"], **spec["model_config"])
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    model.train()
    # frozen parameters (a fine-tuning job's): DeepSpeed keeps them out of the optimizer and records
    # them apart (frozen_param_shapes / frozen_param_fragments at ZeRO-2/3)
    for name in spec.get("frozen", []):
        model.get_parameter(name).requires_grad_(False)
    return model


def fixed_batch(spec: dict, vocab_size: int, dp_rank: int, dp_world: int) -> torch.Tensor:
    """This DP rank's rows of the fixed synthetic batch: ``micro_batch * dp_world`` sequences
    drawn from ``Generator().manual_seed(seed + 1)``, DP rank ``d`` taking its own slice."""
    micro, seq_len = int(spec["micro_batch"]), int(spec["seq_len"])
    gen = torch.Generator().manual_seed(int(spec["seed"]) + 1)
    global_ids = torch.randint(0, vocab_size, (micro * dp_world, seq_len), generator=gen)
    return global_ids[dp_rank * micro:(dp_rank + 1) * micro].contiguous()


def write_report(spec: dict, engine, **fields) -> None:
    """``report_dir/rank_<rank>.json``: what the launch did, plus what the engine says about
    itself (steps, ZeRO stage, dtype, optimizer classes)."""
    name = lambda o: f"{type(o).__module__}.{type(o).__qualname__}"  # noqa: E731
    report = dict(
        fields,
        global_steps=int(engine.global_steps),
        zero_stage=int(engine.zero_optimization_stage()),
        param_dtype=str(next(engine.module.parameters()).dtype),
        optimizer_class=name(engine.optimizer),
        basic_optimizer_class=name(getattr(engine.optimizer, "optimizer", engine.optimizer)),
    )
    os.makedirs(spec["report_dir"], exist_ok=True)
    with open(os.path.join(spec["report_dir"], f"rank_{fields['rank']}.json"), "w") as f:
        json.dump(report, f, indent=1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    args = parser.parse_args()
    with open(args.spec) as f:
        spec = json.load(f)

    import deepspeed
    from deepspeed.utils import groups

    model = setup(spec)
    rank = torch.distributed.get_rank()
    world_size = torch.distributed.get_world_size()

    ds_config = spec["ds_config"]
    t0 = time.time()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    # Data-parallel coordinates, as DeepSpeed sees them.
    try:
        dp_rank = groups.get_data_parallel_rank()
        dp_world = groups.get_data_parallel_world_size()
    except Exception:  # pragma: no cover - older group helpers
        dp_rank = engine.dp_rank if hasattr(engine, "dp_rank") else rank
        dp_world = engine.dp_world_size
    try:
        tp_rank = groups.get_tensor_model_parallel_rank()
        tp_world = groups.get_tensor_model_parallel_world_size()
    except Exception:  # pragma: no cover
        tp_rank, tp_world = 0, 1

    if spec.get("load_dir"):
        # a fixture that is DeepSpeed's own native save of a loaded state (steps 0: load, then save)
        load_path, _ = engine.load_checkpoint(spec["load_dir"])
        if load_path is None:
            raise RuntimeError(f"load_checkpoint({spec['load_dir']!r}) loaded nothing")

    input_ids = fixed_batch(spec, model.config.vocab_size, dp_rank, dp_world).to(engine.device)

    losses = []
    for step in range(int(spec["steps"])):
        out = engine(input_ids=input_ids, labels=input_ids, use_cache=False)
        loss = out.loss
        engine.backward(loss)
        engine.step()
        value = float(loss.detach().float().item())
        losses.append(value)
        print(f"[fixture-train] rank={rank} step={step + 1} loss={value:.8f}", flush=True)

    engine.save_checkpoint(spec["save_dir"], tag=spec["tag"])
    torch.distributed.barrier()

    write_report(spec, engine, rank=rank, world_size=world_size, dp_rank=dp_rank, dp_world_size=dp_world,
                 tp_rank=tp_rank, tp_world_size=tp_world, losses=losses, train_seconds=time.time() - t0,
                 batch_shape=list(input_ids.shape))

    torch.distributed.barrier()
    try:
        deepspeed.comm.destroy_process_group()
    except Exception:
        pass


if __name__ == "__main__":
    main()
