"""FSDP2 job of the HF fixtures whose checkpoint Accelerate writes (``accelerate_fsdp_llama``).

Launched by ``scripts/make_hf_fixtures.py``; not meant to be run by hand::

    torchrun --standalone --nproc_per_node 2 scripts/_fixture_hf_fsdp.py --spec SPEC.json

``SPEC.json``: ``{"recipe": {...}, "output_dir": ..., "reference_dir": ..., "report_path": ...}``,
the recipe of ``_fixture_hf_recipe.fsdp_recipe``.

Accelerate on CPU runs DDP for an FSDP config, so the training is torch's own FSDP2
(``fully_shard`` on a 1-D ``init_device_mesh("cpu", (world,))``, gloo), wrapped as Accelerate's
FSDP2 path wraps a transformers model (each decoder layer, then the root). The checkpoint is then
written by Accelerate's own functions with the arguments HF ``Trainer`` passes them
(``Trainer._save_optimizer_and_scheduler`` for FSDP, transformers 5.24)::

    save_fsdp_model(plugin, PartialState(cpu=True), model, output_dir, adapter_only=True)
    save_fsdp_optimizer(plugin, state, optimizer, model, output_dir)

with ``plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")``:
``output_dir/pytorch_model_fsdp_0/`` (DCP of ``{"model": get_model_state_dict(model)}``) and
``output_dir/optimizer_0/`` (DCP of ``{"optimizer": get_optimizer_state_dict(model, optimizer)}``).
Next to them ``scheduler.pt`` is ``torch.save(lr_scheduler.state_dict())`` as Trainer writes it.
Trainer's ``save_model`` writes nothing for ``SHARDED_STATE_DICT`` (no config, no tokenizer), so
the checkpoint folder holds only these; with ``hf_files_dir`` in the spec, rank 0 writes the
model's ``config.json`` / ``generation_config.json`` and the tokenizer there, apart from it.

Training follows Trainer's recipe: ``torch.optim.AdamW`` over Trainer's two parameter groups
(weight decay for all but biases and norms, ``Trainer.get_decay_parameter_names``), the linear
schedule with one warm-up step planned for ``max_steps`` (``transformers.get_scheduler``), gradient
clipping at ``max_grad_norm``. Step ``k`` uses the dataset rows ``[k*W*b, (k+1)*W*b)`` in order, rank
``r`` its ``b`` rows at ``r*b``; HF's causal-LM loss per rank, gradients averaged by FSDP.

Rank 0 writes the reference tensors (``reference_dir``): ``model.safetensors`` (full fp32 weights
by HF name, ``DTensor.full_tensor()``), ``exp_avg.safetensors`` / ``exp_avg_sq.safetensors`` (the
full Adam moments) and ``logits.safetensors`` (the live FSDP model on the probe batch).
"""

# ruff: noqa: E402
import argparse
import json
import os
import sys
import time

T0 = time.time()

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _fixture_hf_recipe as R


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().clone().cpu().contiguous()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    spec = json.load(open(ap.parse_args().spec))
    recipe = spec["recipe"]
    R.offline_env()
    R.deterministic_torch()

    from accelerate import PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin, save_fsdp_model, save_fsdp_optimizer
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import get_scheduler
    from transformers.trainer_pt_utils import get_parameter_names

    state = PartialState(cpu=True)  # initialises the gloo process group from torchrun's env
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    model = R.build_model(recipe)
    args = recipe["training_args"]
    # Trainer.get_decay_parameter_names (transformers 5.24)
    decay = set(get_parameter_names(model, [torch.nn.LayerNorm],
                                    [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]))
    layer_cls = type(model.model.layers[0])
    for module in model.modules():
        if isinstance(module, layer_cls):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.train()

    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": args["weight_decay"]},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args["learning_rate"], betas=(args["adam_beta1"], args["adam_beta2"]),
                                  eps=args["adam_epsilon"])
    scheduler = get_scheduler(args["lr_scheduler_type"], optimizer, num_warmup_steps=args["warmup_steps"],
                              num_training_steps=args["max_steps"])

    ids = R.dataset_ids(recipe)
    b = int(args["per_device_train_batch_size"])
    losses, grad_norms, lrs = [], [], []
    for step in range(int(recipe["stop_at"])):
        rows = ids[(step * world + rank) * b:(step * world + rank + 1) * b]
        out = model(input_ids=rows, labels=rows, use_cache=False)
        out.loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args["max_grad_norm"])
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        loss = out.loss.detach().clone()
        dist.all_reduce(loss)
        losses.append(float(loss / world))
        grad_norms.append(float(full(norm)))

    out_dir = spec["output_dir"]
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    t_save = time.time()
    save_fsdp_model(plugin, state, model, out_dir, adapter_only=True)
    save_fsdp_optimizer(plugin, state, optimizer, model, out_dir)
    if rank == 0:
        torch.save(scheduler.state_dict(), os.path.join(out_dir, "scheduler.pt"))
    save_s = time.time() - t_save
    if rank == 0 and spec.get("hf_files_dir"):
        # not part of the checkpoint (Trainer's save_model writes nothing for SHARDED_STATE_DICT):
        # what from_pretrained needs besides the weights
        model.config.save_pretrained(spec["hf_files_dir"])
        model.generation_config.save_pretrained(spec["hf_files_dir"])
        R.build_tokenizer().save_pretrained(spec["hf_files_dir"])

    # reference tensors of the live state
    weights = {k: full(v) for k, v in model.state_dict().items()}
    moments = {"exp_avg": {}, "exp_avg_sq": {}}
    for name, p in model.named_parameters():
        for key in moments:
            moments[key][name] = full(optimizer.state[p][key])
    adam_step = {name: float(optimizer.state[p]["step"]) for name, p in model.named_parameters()}
    model.eval()
    with torch.no_grad():
        logits = full(model(input_ids=R.probe_ids(recipe), use_cache=False).logits)
    if rank == 0:
        ref = spec["reference_dir"]
        os.makedirs(ref, exist_ok=True)
        meta = {"global_step": str(recipe["stop_at"])}
        save_file(weights, os.path.join(ref, "model.safetensors"), metadata=meta)
        for key, tensors in moments.items():
            save_file(tensors, os.path.join(ref, f"{key}.safetensors"), metadata=meta)
        save_file({"input_ids": R.probe_ids(recipe), "logits": logits}, os.path.join(ref, "logits.safetensors"),
                  metadata=meta)
        report = {
            "world_size": world,
            "losses": losses,
            "grad_norms": grad_norms,
            "learning_rates": lrs,
            "adam_step": sorted(set(adam_step.values())),
            "param_groups": [{"weight_decay": g["weight_decay"], "params": [n for n, p in named if any(p is q for q in g["params"])]}
                             for g in groups],
            "scheduler_state": {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"},
            "plugin": {"fsdp_version": plugin.fsdp_version, "state_dict_type": str(plugin.state_dict_type)},
            "seconds": {"total": time.time() - T0, "save": save_s},
        }
        with open(spec["report_path"], "w") as f:
            json.dump(report, f, indent=1, default=str)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
