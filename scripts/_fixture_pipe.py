"""Train a tiny ``deepspeed.pipe.PipelineModule`` with DeepSpeed on CPU and save a checkpoint
(one pipeline-parallel fixture). Launched by ``make_fixtures.py`` through the DeepSpeed launcher::

    deepspeed --num_gpus N --no_local_rank --master_port P scripts/_fixture_pipe.py --spec SPEC.json

``SPEC.json`` holds the same keys as for ``_fixture_train.py`` (``ds_config``, ``steps``, ``seed``,
``seq_len``, ``micro_batch``, ``save_dir``, ``tag``, ``report_dir``) plus ``model_config`` with
``vocab``, ``hidden``, ``layers`` and ``stages``. The model is an embedding (token table and a
learned position table), ``layers`` residual MLP blocks (LayerNorm, Linear with bias, Linear
without) and a head (LayerNorm, Linear), cut into ``stages`` pipeline stages uniformly. DeepSpeed
writes one ``layer_XX-model_states.pt`` per layer and names parameters ``"<layer>.<name>"``.
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


def build(cfg: dict):
    from deepspeed.pipe import LayerSpec, PipelineModule

    vocab, hidden, seq = cfg["vocab"], cfg["hidden"], cfg["seq_len"]

    class Embed(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(vocab, hidden)
            self.pos = nn.Parameter(torch.randn(seq, hidden) * 0.02)

        def forward(self, ids):
            return self.tok(ids) + self.pos

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(hidden)
            self.fc1 = nn.Linear(hidden, 2 * hidden)
            self.fc2 = nn.Linear(2 * hidden, hidden, bias=False)

        def forward(self, x):
            return x + self.fc2(nn.functional.gelu(self.fc1(self.ln(x))))

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_f = nn.LayerNorm(hidden)
            self.lm_head = nn.Linear(hidden, vocab, bias=False)

        def forward(self, x):
            return self.lm_head(self.ln_f(x))

    def loss_fn(logits, labels):
        return nn.functional.cross_entropy(logits.float().reshape(-1, vocab), labels.reshape(-1))

    layers = [LayerSpec(Embed)] + [LayerSpec(Block) for _ in range(cfg["layers"])] + [LayerSpec(Head)]
    return PipelineModule(layers=layers, num_stages=cfg["stages"], loss_fn=loss_fn, partition_method="uniform")


def fixed_batches(spec: dict, engine):
    """The same batch forever: ``micro_batch * dp`` rows of random token ids (generator seeded
    with ``seed + 1``), DP rank ``d`` taking rows ``[d * micro_batch, (d + 1) * micro_batch)``,
    labels the ids shifted by one. Returns the iterator and this rank's ids."""
    cfg = spec["model_config"]
    micro, dp_rank = int(spec["micro_batch"]), engine.grid.get_data_parallel_rank()
    gen = torch.Generator().manual_seed(int(spec["seed"]) + 1)
    ids = torch.randint(0, cfg["vocab"], (micro * engine.grid.get_data_parallel_world_size(), spec["seq_len"]),
                        generator=gen)
    mine = ids[dp_rank * micro:(dp_rank + 1) * micro]
    batch = (mine, mine.roll(-1, dims=1))

    class Forever:
        def __iter__(self):
            return self

        def __next__(self):
            return batch

    return Forever(), mine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    args = parser.parse_args()
    with open(args.spec) as f:
        spec = json.load(f)

    torch.set_num_threads(1)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    seed = int(spec["seed"])
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    cfg = dict(spec["model_config"], seq_len=spec["seq_len"])
    model = build(cfg)
    t0 = time.time()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                            if p.requires_grad],
                                           config=spec["ds_config"])
    rank = torch.distributed.get_rank()
    dp_rank = engine.grid.get_data_parallel_rank()
    dp_world = engine.grid.get_data_parallel_world_size()
    data, mine = fixed_batches(spec, engine)
    losses = []
    for step in range(int(spec["steps"])):
        value = float(engine.train_batch(data_iter=data))
        losses.append(value)
        print(f"[fixture-pipe] rank={rank} stage={engine.stage_id} step={step + 1} loss={value:.8f}", flush=True)
    engine.save_checkpoint(spec["save_dir"], tag=spec["tag"])
    torch.distributed.barrier()

    write_report(spec, engine, rank=rank, world_size=torch.distributed.get_world_size(), dp_rank=dp_rank,
                 dp_world_size=dp_world, tp_rank=0, tp_world_size=1, pp_rank=int(engine.stage_id), losses=losses,
                 train_seconds=time.time() - t0, batch_shape=list(mine.shape))
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
