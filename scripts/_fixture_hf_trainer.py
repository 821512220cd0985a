"""Hugging Face ``Trainer`` + DeepSpeed job of the HF fixtures, launched (one process per rank) by
``scripts/make_hf_fixtures.py``; not meant to be run by hand::

    deepspeed --num_gpus 2 --no_local_rank --master_port PORT \
        scripts/_fixture_hf_trainer.py --spec SPEC.json

``SPEC.json``: ``{"recipe": {...}, "output_dir": ..., "reference_dir": ..., "report_path": ...}``
with the recipe of ``_fixture_hf_recipe.trainer_recipe``.

The job is an ordinary Trainer run: ``Trainer(model, args, train_dataset, processing_class=
tokenizer).train()`` with ``TrainingArguments(use_cpu=True, ddp_backend="gloo", deepspeed=...)``
planned for ``max_steps`` steps, saving every ``save_steps``. One callback (:class:`Reference`)
runs after every save (``on_save``, all ranks: the gathers are collective), writes the live
state's reference tensors for that checkpoint, and stops the run once the checkpoint of step
``stop_at`` is written, so the output folder holds what an interrupted run leaves.

Reference tensors, ``reference_dir/checkpoint-<N>/`` (safetensors, written by rank 0):

* ``model.safetensors``: every key of the live module's ``state_dict()`` by HF name, in the
  module's dtype (bf16 under bf16 training); ZeRO-3 parameters gathered with
  ``deepspeed.zero.GatheredParameters``. Tied keys are separate copies.
* ``fp32.safetensors``, ``exp_avg.safetensors``, ``exp_avg_sq.safetensors``: DeepSpeed's fp32
  master and Adam moments per parameter (``named_parameters()`` names, i.e. without tied
  duplicates), from ``deepspeed.utils.safe_get_full_fp32_param`` /
  ``safe_get_full_optimizer_state`` on the live engine.
* ``logits.safetensors``: ``input_ids`` (the recipe's probe batch) and ``logits`` of the live
  module on it (eval mode, no grad), in the module's dtype.
"""

# ruff: noqa: E402
import argparse
import json
import os
import sys
import time

T0 = time.time()

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _fixture_hf_recipe as R


def _name(o) -> str:
    return f"{type(o).__module__}.{type(o).__qualname__}"


def full_state(model, zero3: bool) -> dict[str, torch.Tensor]:
    """The live module's whole ``state_dict`` by HF name (ZeRO-3 parameters gathered), cloned."""
    import deepspeed

    params = dict(model.named_parameters(remove_duplicate=False))
    out = {}
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None, enabled=zero3):
        for key, value in model.state_dict().items():
            tensor = params[key].data if key in params else value
            out[key] = tensor.detach().clone().cpu().contiguous()
    return out


def optimizer_state(model) -> dict[str, dict[str, torch.Tensor]]:
    """fp32 master and Adam moments per (deduplicated) parameter, gathered by DeepSpeed."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {"fp32": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for name, param in model.named_parameters():
        fp32 = safe_get_full_fp32_param(param)
        if fp32 is None:
            raise RuntimeError(f"safe_get_full_fp32_param({name}) returned None")
        out["fp32"][name] = fp32.detach().clone().cpu().contiguous()
        for key in ("exp_avg", "exp_avg_sq"):
            value = safe_get_full_optimizer_state(param, key)
            if value is None:
                raise RuntimeError(f"safe_get_full_optimizer_state({name}, {key}) returned None")
            out[key][name] = value.detach().clone().cpu().contiguous()
    return out


def live_logits(model, ids: torch.Tensor) -> torch.Tensor:
    was_training = model.training
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids.to(next(model.parameters()).device), use_cache=False).logits
    model.train(was_training)
    return logits.detach().clone().cpu().contiguous()


def make_callback(recipe: dict, reference_dir: str):
    from safetensors.torch import save_file
    from transformers import TrainerCallback

    class Reference(TrainerCallback):
        """After each save: reference tensors of the live state; stop after step ``stop_at``."""

        def __init__(self):
            self.trainer = None
            self.saved = []

        def on_save(self, args, state, control, **kwargs):
            trainer = self.trainer
            model = trainer.model  # the HF module (DeepSpeed's engine.module)
            zero3 = trainer.accelerator.state.deepspeed_plugin.zero_stage == 3
            weights = full_state(model, zero3)
            optim = optimizer_state(model)
            logits = live_logits(model, R.probe_ids(recipe))
            if args.process_index == 0:
                out = os.path.join(reference_dir, f"checkpoint-{state.global_step}")
                os.makedirs(out, exist_ok=True)
                meta = {"global_step": str(state.global_step)}
                save_file(weights, os.path.join(out, "model.safetensors"), metadata=meta)
                for key, tensors in optim.items():
                    save_file(tensors, os.path.join(out, f"{key}.safetensors"), metadata=meta)
                save_file({"input_ids": R.probe_ids(recipe), "logits": logits},
                          os.path.join(out, "logits.safetensors"), metadata=meta)
            self.saved.append(state.global_step)
            if state.global_step >= int(recipe["stop_at"]):
                control.should_training_stop = True
            return control

    return Reference()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    spec = json.load(open(ap.parse_args().spec))
    recipe = spec["recipe"]

    R.offline_env()
    R.deterministic_torch()
    import deepspeed
    from transformers import Trainer, default_data_collator

    # Before TrainingArguments: under ZeRO-3 transformers builds the model inside
    # deepspeed.zero.Init (TrainingArguments registers the DeepSpeed config), which reads the
    # world size from deepspeed.comm.
    deepspeed.init_distributed(dist_backend="gloo")
    args = R.training_arguments(recipe, spec["output_dir"])
    model = R.build_model(recipe)
    tokenizer = R.build_tokenizer()
    callback = make_callback(recipe, spec["reference_dir"])
    trainer = Trainer(model=model, args=args, train_dataset=R.build_dataset(recipe),
                      data_collator=default_data_collator, processing_class=tokenizer, callbacks=[callback])
    callback.trainer = trainer
    t_train = time.time()
    trainer.train()
    train_s = time.time() - t_train

    engine = trainer.model_wrapped
    if args.process_index == 0:
        report = {
            "world_size": args.world_size,
            "log_history": trainer.state.log_history,
            "saved_steps": callback.saved,
            "ds_config_final": trainer.accelerator.state.deepspeed_plugin.hf_ds_config.config,
            "engine": {
                "class": _name(engine),
                "zero_stage": int(engine.zero_optimization_stage()),
                "module_dtype": str(next(trainer.model.parameters()).dtype),
                "optimizer_class": _name(engine.optimizer),
                "basic_optimizer_class": _name(getattr(engine.optimizer, "optimizer", engine.optimizer)),
                "lr_scheduler_class": _name(engine.lr_scheduler),
                "trainer_lr_scheduler_class": _name(trainer.lr_scheduler),
                "global_steps": int(engine.global_steps),
            },
            "seconds": {"total": time.time() - T0, "train": train_s},
        }
        with open(spec["report_path"], "w") as f:
            json.dump(report, f, indent=1, default=str)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
