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
