"""One Megatron fixture job, one process per rank under ``torchrun`` (run by
``make_megatron_fixtures.py`` in the Megatron venv; not part of reshard's environment).

    torchrun --standalone --nproc-per-node N scripts/_fixture_megatron.py SPEC.json

``SPEC.json``: ``{"mlm_argv": [...Megatron-LM command line...], "steps": 3, "report_dir": DIR}``.
Each rank trains ``steps`` steps with Megatron-LM's ``train_step`` and then calls Megatron-LM's
``save_checkpoint(steps, ...)`` (which writes to ``--save``); it writes ``DIR/rank<R>.json``
(its parallel ranks and the losses it saw).

The ``if __name__ == "__main__"`` guard is needed: the ``torch_dist`` save starts a spawn-mode
``multiprocessing`` manager, which re-imports this file.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _mark(what: str, t0: list) -> None:
    now = time.monotonic()
    print(f"[fixture] {what}: {now - t0[0]:.1f}s", file=sys.stderr, flush=True)
    t0[0] = now


EXPERT_BIAS_SEED = 2025  # make_megatron_fixtures.EXPERT_BIAS_SEED


def set_expert_bias(model, std: float) -> None:
    """Every router's ``expert_bias`` buffer set to ``N(0, std^2)`` from a generator seeded by the
    global layer number (an MTP layer's router: its MTP layer number + num_layers; the same on every
    rank holding that router): three steps of
    ``moe_router_bias_update_rate`` leave it at a few 1e-3, too small to move this model's routing,
    so a converter dropping it would go unseen."""
    import torch
    from megatron.core.transformer.moe.router import TopKRouter

    for chunk in model:
        for name, module in chunk.named_modules():
            if isinstance(module, TopKRouter) and getattr(module, "expert_bias", None) is not None:
                layer = module.layer_number if getattr(module, "layer_number", None) is not None else \
                    int(name.split("layers.")[1].split(".")[0])
                if getattr(module, "is_mtp_layer", False):  # numbered after the decoder, as the router's aux loss
                    layer = int(layer) + module.config.num_layers
                g = torch.Generator().manual_seed(EXPERT_BIAS_SEED + int(layer))
                with torch.no_grad():
                    module.expert_bias.copy_(torch.randn(module.expert_bias.shape, generator=g) * std)


def main(spec_path: str) -> None:
    t0 = [time.monotonic()]
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _megatron_cpu

    _megatron_cpu.install()
    import _megatron_common as C
    import torch

    with open(spec_path) as f:
        spec = json.load(f)
    _mark("imports", t0)
    args = C.start_megatron(spec["mlm_argv"])
    _mark("start", t0)
    model, optimizer, scheduler = C.setup()
    _mark("setup", t0)
    steps = int(spec["steps"])
    losses = C.train(model, optimizer, scheduler, steps)
    _mark("train", t0)

    from megatron.training.checkpointing import save_checkpoint
    from megatron.training.training import num_floating_point_operations

    if spec.get("expert_bias_std") is not None:
        set_expert_bias(model, float(spec["expert_bias_std"]))
    flops = steps * num_floating_point_operations(args, args.global_batch_size)
    save_checkpoint(steps, model, optimizer, scheduler, flops)
    _mark("save", t0)

    info = C.rank_info()
    info["losses"] = losses
    info["num_floating_point_operations_so_far"] = flops
    os.makedirs(spec["report_dir"], exist_ok=True)
    with open(os.path.join(spec["report_dir"], f"rank{info['rank']}.json"), "w") as f:
        json.dump(info, f, indent=1)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
