"""A PyTorch DCP checkpoint of an HF model folder's weights, written by PyTorch itself: 2 ranks (gloo,
CPU) load MODEL_DIR with transformers, shard it with FSDP2 (``fully_shard`` per decoder layer, then
the root, on a 1-D mesh), and save ``{"model": msd, "optim": osd}`` (``get_state_dict`` of the model
and an AdamW that has not stepped) with ``torch.distributed.checkpoint.save`` -- what a training
job's checkpoint holds, with exactly the weights of MODEL_DIR.

    python tests_vllm/make_dcp.py MODEL_DIR OUT_DIR
"""

from __future__ import annotations

import argparse
import os

WORLD = 2


def worker(rank: int, port: int, model_dir: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    a = ap.parse_args()
    import torch.multiprocessing as mp

    from reshard.execute.group import free_port

    os.makedirs(a.out, exist_ok=True)
    mp.start_processes(worker, args=(free_port(), a.model, a.out), nprocs=WORLD, start_method="spawn")


if __name__ == "__main__":
    main()
