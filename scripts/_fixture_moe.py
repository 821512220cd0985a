"""Train a tiny model with classic ``deepspeed.moe.layer.MoE`` layers (expert parallel) on CPU and
save a checkpoint. Launched by ``make_fixtures.py`` through the DeepSpeed launcher::

    deepspeed --num_gpus N --no_local_rank --master_port P scripts/_fixture_moe.py --spec SPEC.json

``SPEC.json`` holds the keys ``_fixture_train.py`` reads (``ds_config``, ``steps``, ``seed``,
``seq_len``, ``micro_batch``, ``save_dir``, ``tag``, ``report_dir``) plus ``model_config`` with
``vocab``, ``hidden``, ``ffn``, ``layers``, ``num_experts``, ``ep_size`` and ``k``. The model: a
token embedding, ``layers`` residual blocks (LayerNorm, then a ``MoE`` of ``num_experts`` two-layer
MLP experts), a final LayerNorm and a head. ``use_rts=False`` and a fixed capacity keep the routing
(and so the losses) reproducible; the optimizer gets
``split_params_into_different_moe_groups_for_optimizer`` groups, as DeepSpeed asks for MoE.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import numpy as np
import torch
from _fixture_train import write_report
from torch import nn


def build(cfg: dict) -> nn.Module:
    from deepspeed.moe.layer import MoE

    vocab, hidden, ffn = cfg["vocab"], cfg["hidden"], cfg["ffn"]

    class Expert(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(hidden, ffn)
            self.fc2 = nn.Linear(ffn, hidden, bias=False)

        def forward(self, x):
            return self.fc2(nn.functional.gelu(self.fc1(x)))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(hidden)
            # capacity_factor large enough that no token is dropped: routing depends only on the gate
            self.moe = MoE(hidden, Expert(), num_experts=cfg["num_experts"], ep_size=cfg["ep_size"], k=cfg["k"],
                           capacity_factor=4.0, eval_capacity_factor=4.0, min_capacity=4, use_rts=False,
                           drop_tokens=True)

        def forward(self, x):
            out, aux, _ = self.moe(self.ln(x))
            return x + out, aux

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, hidden)
            self.blocks = nn.ModuleList(Block() for _ in range(cfg["layers"]))
            self.ln_f = nn.LayerNorm(hidden)
            self.head = nn.Linear(hidden, vocab, bias=False)

        def forward(self, ids, labels):
            x, aux = self.embed(ids), 0.0
            for b in self.blocks:
                x, a = b(x)
                aux = aux + a
            logits = self.head(self.ln_f(x))
            return nn.functional.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1)) + 0.01 * aux

    return Model()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    args = parser.parse_args()
    with open(args.spec) as f:
        spec = json.load(f)

    torch.set_num_threads(1)
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    deepspeed.init_distributed(dist_backend="gloo")
    seed = int(spec["seed"])
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    cfg = spec["model_config"]
    model = build(cfg)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": [p for p in model.parameters() if p.requires_grad], "name": "dense"})
    t0 = time.time()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=spec["ds_config"])
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    micro = int(spec["micro_batch"])
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, cfg["vocab"], (micro * world, spec["seq_len"]), generator=gen)
    mine = ids[rank * micro:(rank + 1) * micro]
    losses = []
    for step in range(int(spec["steps"])):
        loss = engine(mine, mine.roll(-1, dims=1))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
        print(f"[fixture-moe] rank={rank} step={step + 1} loss={float(loss):.8f}", flush=True)
    engine.save_checkpoint(spec["save_dir"], tag=spec["tag"])
    torch.distributed.barrier()
    write_report(spec, engine, rank=rank, world_size=world, dp_rank=rank, dp_world_size=world, tp_rank=0,
                 tp_world_size=1, losses=losses, train_seconds=time.time() - t0, batch_shape=list(mine.shape))
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
