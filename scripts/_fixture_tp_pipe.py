"""A tiny Megatron-style tensor x pipeline parallel ``deepspeed.pipe.PipelineModule`` on CPU: train
it and save a checkpoint (one fixture), or resume checkpoints of it at other topologies (the
end-to-end tests). Launched through the DeepSpeed launcher::

    deepspeed --num_gpus N --no_local_rank --master_port P scripts/_fixture_tp_pipe.py --spec SPEC.json

The model runs over ``PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)``; its
tensor-parallel layers use the slice group of the module's own grid
(``net.mpu().get_slice_parallel_group()``), as Megatron-DeepSpeed's do:

* layer 0, ``Embed``: a vocabulary-parallel ``word_embeddings`` (rows split over TP ranks) plus a
  replicated learned ``position_embeddings`` table;
* layers 1..L, ``Block``: a replicated ``input_layernorm``, a column-parallel SwiGLU
  ``mlp.dense_h_to_4h`` (weight and bias hold this rank's slice of the gate, then of the up
  projection: two sub-parameters) and a row-parallel ``mlp.dense_4h_to_h`` (its bias replicated,
  added after the all-reduce);
* layer L+1, ``Head``: a replicated ``final_layernorm`` and a vocabulary-parallel ``lm_head``
  whose logits are all-gathered before the loss.

Every parameter is initialised whole, from a generator seeded by the seed and its name, and this
rank's slice taken, so the model does not depend on the topology. ``save_checkpoint`` gets
``client_state={"universal_checkpoint_info": UC_INFO}``, the categories Megatron-DeepSpeed records.

``SPEC.json``:

* ``mode: "train"`` (default): the keys of ``_fixture_pipe.py`` (``ds_config``, ``steps``,
  ``seed``, ``seq_len``, ``micro_batch``, ``save_dir``, ``tag``, ``report_dir``) with
  ``model_config`` holding ``vocab``, ``hidden``, ``ffn``, ``layers`` and the topology: ``stages``
  and ``tp`` (DP is what the world size leaves).
* ``mode: "resume"``: ``report_path`` and ``loads``, each ``{"name", "model_config"`` (its
  ``stages`` and ``tp`` those to run at), ``"seed", "seq_len", "micro_batch", "ds_config",
  "load_dir", "universal", "save_dir"`` (or null), ``"steps"}``. Each load builds a fresh module and engine, loads (through
  ``load_universal`` when ``universal``), saves natively into ``save_dir`` right away if given,
  and takes ``steps`` steps. Rank 0 writes ``{"loads": {name: {"losses", "load_path", "topology", "digests":
  {"after_load"|"after_steps": {param: {"fp32"|"exp_avg"|"exp_avg_sq"|"module": digest}}},
  "ranks_agree", "replica_mismatches"}}}`` (``tests/e2e/digest.py``; each parameter rebuilt whole
  from its TP shards by its category, so digests do not depend on the topology).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import random
import re
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import torch
from _fixture_pipe import fixed_batches
from _fixture_train import write_report
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "e2e"))
from digest import digest  # noqa: E402

# What Megatron-DeepSpeed passes as client_state["universal_checkpoint_info"] for this model:
# every pattern matches some parameter (ds_to_universal's strict check).
UC_INFO_PATTERNS = {
    "vocabulary_parameter_patterns": [r"\d+\.word_embeddings\.weight", r"\d+\.lm_head\.weight"],
    "pipeline_replicated_parameter_patterns": [],
    "tp_replicated_parameter_patterns": [r"\d+\.position_embeddings\.weight", r"\d+\.input_layernorm\.(weight|bias)",
                                         r"\d+\.mlp\.dense_4h_to_h\.bias", r"\d+\.final_layernorm\.(weight|bias)"],
    "parameter_to_average_patterns": [],
    "parameter_with_row_parallelism_patterns": [r"\d+\.mlp\.dense_4h_to_h\.weight"],
    "parameter_with_2_sub_params_cat_dim_0": [r"\d+\.mlp\.dense_h_to_4h\.(weight|bias)"],
}


def uc_info(cfg: dict) -> dict:
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_VERSION_VALUE

    return {"universal_checkpoint_version": UNIVERSAL_CHECKPOINT_VERSION_VALUE,
            "original_vocab_size": cfg["vocab"], "padded_vocab_size": cfg["vocab"], **copy.deepcopy(UC_INFO_PATTERNS)}


def category(name: str) -> str:
    """How ``name`` is split over TP ranks: replicated, row (dim 1), two sub-params, or dim 0."""
    for key, cat in (("tp_replicated_parameter_patterns", "replicated"),
                     ("parameter_with_row_parallelism_patterns", "row"),
                     ("parameter_with_2_sub_params_cat_dim_0", "two")):
        if any(re.match(p, name) for p in UC_INFO_PATTERNS[key]):
            return cat
    return "column"


def tp_slice(name: str, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """TP rank ``rank``'s shard of the whole tensor ``full``, Megatron's way."""
    cat = category(name)
    if cat == "replicated":
        return full.clone()
    if cat == "row":
        return full.chunk(tp, dim=1)[rank].clone()
    if cat == "two":
        return torch.cat([half.chunk(tp, dim=0)[rank] for half in full.chunk(2, dim=0)]).clone()
    return full.chunk(tp, dim=0)[rank].clone()


def tp_join(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The whole tensor from every TP rank's shard (the inverse of :func:`tp_slice`)."""
    cat = category(name)
    if cat == "replicated" or len(shards) == 1:
        return shards[0]
    if cat == "row":
        return torch.cat(shards, dim=1)
    if cat == "two":
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([torch.cat([h[i] for h in halves]) for i in range(2)])
    return torch.cat(shards, dim=0)


class TP:
    """This rank's tensor-parallel slice group (set once the PipelineModule has built its grid)."""

    size = 1
    rank = 0
    group = None


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    if TP.size == 1:
        return x
    x = x.contiguous().clone()
    torch.distributed.all_reduce(x, group=TP.group)
    return x


class _Copy(torch.autograd.Function):
    """Into a column-parallel layer: identity forward, all-reduce of the gradient."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g)


class _Reduce(torch.autograd.Function):
    """Out of a row-parallel layer: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x):
        return _all_reduce(x)

    @staticmethod
    def backward(ctx, g):
        return g


class _Gather(torch.autograd.Function):
    """Logits of every vocabulary slice, end to end; backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x):
        ctx.width = x.shape[-1]
        if TP.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(TP.size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=TP.group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, g):
        return g.narrow(-1, TP.rank * ctx.width, ctx.width).contiguous()


def _init(module: nn.Module, layer: int, seed: int, tp: int, rank: int, std: float) -> None:
    """Every parameter drawn whole (norm weights 1, biases and norm biases small), then sliced."""
    for name, p in module.named_parameters():
        full_name = f"{layer}.{name}"
        full_shape = list(p.shape)
        cat = category(full_name)
        if cat in ("column", "two"):
            full_shape[0] *= tp
        elif cat == "row":
            full_shape[1] *= tp
        gen = torch.Generator().manual_seed(seed * 1000003 + zlib.crc32(full_name.encode()))
        full = torch.randn(full_shape, generator=gen) * (0.02 if p.dim() == 1 else std)
        if "layernorm" in name and name.endswith("weight"):
            full = full + 1.0
        with torch.no_grad():
            p.copy_(tp_slice(full_name, full, tp, rank))
        if cat != "replicated":
            p.tensor_model_parallel = True  # Megatron's marker: DeepSpeed's grad norm counts it on every TP rank


class Embed(nn.Module):
    def __init__(self, cfg: dict, layer: int, tp: int, rank: int):
        super().__init__()
        vocab, hidden = cfg["vocab"], cfg["hidden"]
        self.lo, self.n = rank * vocab // tp, vocab // tp
        self.word_embeddings = nn.Embedding(self.n, hidden)
        self.position_embeddings = nn.Embedding(cfg["seq_len"], hidden)
        _init(self, layer, cfg["seed"], tp, rank, 0.5)

    def forward(self, ids):
        outside = (ids < self.lo) | (ids >= self.lo + self.n)
        local = F.embedding((ids - self.lo).masked_fill(outside, 0), self.word_embeddings.weight)
        local = local.masked_fill(outside.unsqueeze(-1), 0.0)
        return _Reduce.apply(local) + self.position_embeddings.weight


class _Linear(nn.Module):
    def __init__(self, rows: int, cols: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols))
        self.bias = nn.Parameter(torch.empty(rows)) if bias else None


class _MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int, tp: int):
        super().__init__()
        self.dense_h_to_4h = _Linear(2 * ffn // tp, hidden, bias=True)  # [gate | up], column parallel
        self.dense_4h_to_h = _Linear(hidden, ffn // tp, bias=True)  # row parallel, bias replicated


class Block(nn.Module):
    def __init__(self, cfg: dict, layer: int, tp: int, rank: int):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(cfg["hidden"])
        self.mlp = _MLP(cfg["hidden"], cfg["ffn"], tp)
        _init(self, layer, cfg["seed"], tp, rank, 0.3)

    def forward(self, x):
        h = _Copy.apply(self.input_layernorm(x))
        up = self.mlp.dense_h_to_4h
        gate, lin = F.linear(h, up.weight, up.bias).chunk(2, dim=-1)
        down = self.mlp.dense_4h_to_h
        out = _Reduce.apply(F.linear(F.silu(gate) * lin, down.weight))
        return x + out + down.bias


class Head(nn.Module):
    def __init__(self, cfg: dict, layer: int, tp: int, rank: int):
        super().__init__()
        self.final_layernorm = nn.LayerNorm(cfg["hidden"])
        self.lm_head = _Linear(cfg["vocab"] // tp, cfg["hidden"], bias=False)
        _init(self, layer, cfg["seed"], tp, rank, 0.3)

    def forward(self, x):
        h = _Copy.apply(self.final_layernorm(x))
        return _Gather.apply(F.linear(h, self.lm_head.weight))


def build(cfg: dict):
    """The PipelineModule at ``cfg["stages"]`` x ``cfg["tp"]``, DP over the rest of the world;
    sets :class:`TP`."""
    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    pp, tp = int(cfg["stages"]), int(cfg["tp"])
    dp = torch.distributed.get_world_size() // (pp * tp)
    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    rank = topo.get_coord(torch.distributed.get_rank()).model
    vocab = cfg["vocab"]

    def loss_fn(logits, labels):
        return F.cross_entropy(logits.float().reshape(-1, vocab), labels.reshape(-1))

    layers = ([LayerSpec(Embed, cfg, 0, tp, rank)] +
              [LayerSpec(Block, cfg, i + 1, tp, rank) for i in range(cfg["layers"])] +
              [LayerSpec(Head, cfg, cfg["layers"] + 1, tp, rank)])
    net = PipelineModule(layers=layers, topology=topo, loss_fn=loss_fn, partition_method="uniform")
    TP.size, TP.rank, TP.group = tp, net.mpu().get_slice_parallel_rank(), net.mpu().get_slice_parallel_group()
    assert TP.rank == rank
    return net


def _engine(spec: dict, ds_config: dict):
    import deepspeed

    cfg = dict(spec["model_config"], seq_len=spec["seq_len"], seed=spec["seed"])
    net = build(cfg)
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=[p for p in net.parameters()
                                                                          if p.requires_grad], config=ds_config)
    return engine, net


def train(spec: dict) -> None:
    seed = int(spec["seed"])
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    t0 = time.time()
    engine, _ = _engine(spec, spec["ds_config"])
    rank = torch.distributed.get_rank()
    data, mine = fixed_batches(spec, engine)
    losses = []
    for step in range(int(spec["steps"])):
        losses.append(float(engine.train_batch(data_iter=data)))
        print(f"[fixture-tp-pipe] rank={rank} stage={engine.stage_id} step={step + 1} loss={losses[-1]:.8f}",
              flush=True)
    cfg = spec["model_config"]
    engine.save_checkpoint(spec["save_dir"], tag=spec["tag"], client_state={"universal_checkpoint_info": uc_info(cfg)})
    torch.distributed.barrier()
    grid = engine.grid
    write_report(spec, engine, rank=rank, world_size=torch.distributed.get_world_size(),
                 dp_rank=grid.get_data_parallel_rank(), dp_world_size=grid.get_data_parallel_world_size(),
                 tp_rank=grid.get_slice_parallel_rank(), tp_world_size=grid.get_slice_parallel_world_size(),
                 pp_rank=int(engine.stage_id), model_parallel_rank=grid.get_model_parallel_rank(), losses=losses,
                 train_seconds=time.time() - t0, batch_shape=list(mine.shape))
    torch.distributed.barrier()


# -- resuming (the end-to-end tests) --------------------------------------------------------------


def _link_optimizer_state_views(engine) -> None:
    """After a native ZeRO-1/2 load DeepSpeed links the Adam state views lazily, at the next step;
    link them now so ``safe_get_full_optimizer_state`` works (as ``tests/e2e/resume_train.py``)."""
    opt = engine.optimizer
    if hasattr(opt, "_lazy_init_hp_params_optimizer_state") and any(
            getattr(p, "_hp_mapping", None) is not None and p._hp_mapping.optim_fragment is None
            for p in engine.module.parameters()):
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()


def _digests(engine, mismatches: list) -> dict:
    """``{param: {kind: digest}}`` of this rank's stage, each tensor whole (TP shards joined)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for name, p in engine.module.named_parameters():
        tensors = {"module": p.data, "fp32": safe_get_full_fp32_param(p)}
        for key in ("exp_avg", "exp_avg_sq"):
            tensors[key] = safe_get_full_optimizer_state(p, key)
        entry = {}
        for kind, t in tensors.items():
            shards = [t.detach().cpu().contiguous()]
            if TP.size > 1:
                shards = [None] * TP.size
                torch.distributed.all_gather_object(shards, t.detach().cpu().contiguous(), group=TP.group)
            if category(name) == "replicated" and not all(torch.equal(shards[0], s) for s in shards[1:]):
                mismatches.append([name, kind])
            entry[kind] = digest(name, tp_join(name, shards))
        out[name] = entry
    return out


def _gathered(mine: dict) -> tuple[dict, bool]:
    """Every stage's digests merged on every rank, and whether ranks holding the same
    parameter agree."""
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, mine)
    merged, agree = {}, True
    for d in every:
        for name, entry in d.items():
            agree = agree and merged.setdefault(name, entry) == entry
    return dict(sorted(merged.items(), key=lambda kv: (int(kv[0].split(".")[0]), kv[0]))), agree


def resume_one(load: dict) -> dict:
    torch.manual_seed(int(load["seed"]))
    ds_config = copy.deepcopy(load["ds_config"])
    ds_config.pop("train_batch_size", None)
    ds_config["checkpoint"] = {"load_universal": bool(load["universal"])}
    engine, net = _engine(load, ds_config)
    path, _ = engine.load_checkpoint(load["load_dir"])
    if path is None:
        raise RuntimeError(f"nothing loaded from {load['load_dir']}")
    if load.get("save_dir"):
        cfg = load["model_config"]
        engine.save_checkpoint(load["save_dir"], tag=os.path.basename(os.path.dirname(path)),
                               client_state={"universal_checkpoint_info": uc_info(cfg)})
    _link_optimizer_state_views(engine)
    mismatches: list = []
    after_load, agree_load = _gathered(_digests(engine, mismatches))
    data, _ = fixed_batches(load, engine)
    losses = [float(engine.train_batch(data_iter=data)) for _ in range(int(load["steps"]))]
    after_steps, agree_steps = _gathered(_digests(engine, mismatches))
    grid = engine.grid
    report = {"losses": losses, "load_path": path,
              "topology": {"pp": engine.num_stages, "tp": grid.get_slice_parallel_world_size(),
                           "dp": grid.get_data_parallel_world_size()},
              "digests": {"after_load": after_load, "after_steps": after_steps},
              "ranks_agree": agree_load and agree_steps, "replica_mismatches": mismatches}
    engine.destroy()
    del engine, net
    gc.collect()
    torch.distributed.barrier()
    return report


def resume(spec: dict) -> None:
    reports = {}
    for load in spec["loads"]:
        reports[load["name"]] = resume_one(load)
        if torch.distributed.get_rank() == 0:
            tmp = spec["report_path"] + ".tmp"
            Path(tmp).write_text(json.dumps({"loads": reports}))
            os.replace(tmp, spec["report_path"])
    torch.distributed.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    spec = json.loads(Path(parser.parse_args().spec).read_text())
    torch.set_num_threads(1)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    if spec.get("mode", "train") == "resume":
        resume(spec)
    else:
        train(spec)


if __name__ == "__main__":
    main()
