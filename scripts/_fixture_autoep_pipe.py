"""AutoEP (expert-parallel MoE) inside a ``deepspeed.pipe.PipelineModule``: the training entry point of
the AutoEP x pipeline fixture, launched by ``scripts/make_fixtures.py`` through the DeepSpeed launcher::

    deepspeed --num_gpus N --no_local_rank --master_port PORT scripts/_fixture_autoep_pipe.py --spec SPEC.json

``SPEC.json`` holds ``_fixture_train.py``'s keys; ``model_config`` is a Mixtral config plus
``pipeline_stages``. The model: an embedding, ``num_hidden_layers`` blocks (LayerNorm, then transformers'
``MixtralSparseMoeBlock`` as ``mlp``, residual) and a head (LayerNorm, Linear), cut into
``pipeline_stages`` stages uniformly; the ``PipelineModule`` carries the Mixtral config as ``.config``
(AutoEP reads ``num_local_experts``/``num_experts_per_tok`` there). ``ds_config.expert_parallel`` names
the blocks with ``moe_layer_pattern`` ``\\d+\\.mlp`` (a pipeline names its layers by index, so the mixtral
preset's ``model\\.layers\\.\\d+\\.mlp`` matches nothing). Every weight of rank >= 2 is drawn from a
generator seeded by the seed and its name (transformers 5 leaves the fused experts ``torch.empty`` until
a ``PreTrainedModel``'s ``_init_weights``, which a bare block never runs).

What DeepSpeed 0.19.8 writes (its ``_save_moe_checkpoint`` bypasses ``PipelineEngine.module_state_dict``):
no ``layer_XX-model_states.pt`` files, one ``mp_rank_0S_model_states.pt`` per stage S holding that stage's
module and its own ``ds_autoep_layers`` (``moe_layer_id`` counted from 0 on each stage), and per-expert files
``layer_<stage-local id>_expert_<e>_mp_rank_0S_model_states.pt``. ``engine.load_checkpoint`` reads it back
(``PipelineEngine.load_module_state_dict`` takes the model-state dict when ``has_moe_layers``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _fixture_autoep  # noqa: E402,F401  (registers transformers_can_record_registry_default)
import _fixture_train  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402


def build(model_config: dict, seed: int):
    from deepspeed.pipe import LayerSpec, PipelineModule
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = dict(model_config)
    stages = int(cfg.pop("pipeline_stages"))
    config = MixtralConfig(**cfg)
    vocab, hidden = config.vocab_size, config.hidden_size

    class Embed(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(vocab, hidden)

        def forward(self, ids):
            return self.tok(ids)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(hidden)
            self.mlp = MixtralSparseMoeBlock(config)

        def forward(self, x):
            out = self.mlp(self.ln(x))
            return x + (out[0] if isinstance(out, tuple) else out)

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_f = nn.LayerNorm(hidden)
            self.lm_head = nn.Linear(hidden, vocab, bias=False)

        def forward(self, x):
            return self.lm_head(self.ln_f(x))

    def loss_fn(logits, labels):
        return nn.functional.cross_entropy(logits.float().reshape(-1, vocab), labels.reshape(-1))

    layers = [LayerSpec(Embed)] + [LayerSpec(Block) for _ in range(config.num_hidden_layers)] + [LayerSpec(Head)]
    model = PipelineModule(layers=layers, num_stages=stages, loss_fn=loss_fn, partition_method="uniform")
    model.config = config
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            gen = torch.Generator().manual_seed(seed + sum(map(ord, name)))
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return model


def _write_digests(engine, out: str) -> None:
    """The oracle: right after the native load, every stage digests each of its parameters' whole fp32
    master, Adam moments and module weight (``tests/e2e/resume_train.collect``: experts gathered over
    their EP group and put back with the placement's affine map); rank 0 merges the stages and writes
    ``{"digests": ..., "global_steps": ...}``, after checking that the DP replicas of a stage agree."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "e2e"))
    from resume_train import TPGather, collect, link_optimizer_state_views

    link_optimizer_state_views(engine)
    mine = collect(engine, TPGather({}))
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, (int(engine.stage_id), mine))
    if torch.distributed.get_rank() != 0:
        return
    merged: dict = {}
    for stage, digests in every:
        for name, entry in digests.items():
            if name in merged and merged[name] != entry:
                raise RuntimeError(f"stage {stage}: the replicas of {name} differ")
            merged[name] = entry
    with open(out, "w") as f:
        json.dump({"global_steps": int(engine.global_steps), "digests": merged}, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    args = parser.parse_args()
    with open(args.spec) as f:
        spec = json.load(f)

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True, warn_only=True)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    for patch in spec.get("patches", []):
        _fixture_train.PATCHES[patch]()
    seed = int(spec["seed"])
    _fixture_train._seed_everything(seed)
    model = build(spec["model_config"], seed)
    t0 = time.time()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                           config=spec["ds_config"])
    rank = torch.distributed.get_rank()
    dp_rank, dp_world = engine.grid.get_data_parallel_rank(), engine.grid.get_data_parallel_world_size()
    if spec.get("load_dir"):
        load_path, _ = engine.load_checkpoint(spec["load_dir"])
        if load_path is None:
            raise RuntimeError(f"load_checkpoint({spec['load_dir']!r}) loaded nothing")
        if spec.get("digests_out"):
            _write_digests(engine, spec["digests_out"])
    ids = _fixture_train.fixed_batch(spec, model.config.vocab_size, dp_rank, dp_world)
    batch = (ids, ids.roll(-1, dims=1))

    class Forever:
        def __iter__(self):
            return self

        def __next__(self):
            return batch

    losses = []
    for step in range(int(spec["steps"])):
        value = float(engine.train_batch(data_iter=Forever()))
        losses.append(value)
        print(f"[fixture-autoep-pipe] rank={rank} stage={engine.stage_id} step={step + 1} loss={value:.8f}",
              flush=True)
    engine.save_checkpoint(spec["save_dir"], tag=spec["tag"])
    torch.distributed.barrier()
    _fixture_train.write_report(spec, engine, rank=rank, world_size=torch.distributed.get_world_size(),
                                dp_rank=dp_rank, dp_world_size=dp_world, tp_rank=0, tp_world_size=1,
                                pp_rank=int(engine.stage_id), losses=losses, train_seconds=time.time() - t0,
                                batch_shape=list(ids.shape))
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
