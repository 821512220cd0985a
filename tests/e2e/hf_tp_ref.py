"""transformers' own tensor-parallel load of Hugging Face folders, the reference for reshard's TP
layout of an HF folder: run under ``torchrun --nproc_per_node TP`` (CPU, gloo)::

    torchrun --nproc_per_node 2 tests/e2e/hf_tp_ref.py OUT FOLDER [FOLDER ...]

Each folder is loaded with ``from_pretrained(..., distributed_config=DistributedConfig(tp_size=TP))``
(the successor of ``tp_plan="auto"``), and each rank saves the local tensor of every parameter
(``named_parameters(remove_duplicate=False)``, so a tied head is there too) to
``OUT/<folder name>/rank<r>.pt``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig


def main() -> None:
    out, folders = Path(sys.argv[1]), sys.argv[2:]
    world = int(os.environ["WORLD_SIZE"])
    for folder in folders:
        model = AutoModelForCausalLM.from_pretrained(folder, distributed_config=DistributedConfig(tp_size=world),
                                                     dtype=torch.float32)
        rank = torch.distributed.get_rank()
        local = {n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone().contiguous()
                 for n, p in model.named_parameters(remove_duplicate=False)}
        (out / Path(folder).name).mkdir(parents=True, exist_ok=True)
        torch.save(local, out / Path(folder).name / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
