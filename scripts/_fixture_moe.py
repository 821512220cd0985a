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

Tensor parallelism (``model_config["tp"] > 1``): classic MoE learns its model-parallel groups only
from a Megatron-style ``mpu`` handed to ``deepspeed.initialize(mpu=...)`` (``groups.mpu``); this job
builds one, :class:`Mpu`, over gloo: TP groups of consecutive ranks ``[0, 1], [2, 3]``, DP groups
strided ``[0, 2], [1, 3]``, as Megatron makes them. Each block then also has a dense tensor-parallel
MLP before its ``MoE`` (a column-parallel ``mlp.fc_in``, its weight and bias split over TP by rows,
and a row-parallel ``mlp.fc_out``, its weight split by columns, its bias replicated and added after
the all-reduce), the TP group used for its all-reduces as Megatron's layers do. With
``model_config["expert_tp"]`` the ``MoE`` gets ``enable_expert_tensor_parallelism=True`` and its
expert is tensor-parallel the same way (``fc1`` column-, ``fc2`` row-parallel); without it the
expert is the plain MLP. Every TP-split parameter is drawn whole from a generator seeded by the
seed and its name and this rank's slice taken. After saving, the job writes ``oracle.json`` into
the checkpoint folder: every parameter's whole fp32 master, Adam moments and module weight,
digested (``tests/e2e/digest.py``) under its *global* name (TP shards joined over the TP group,
an expert named by its global index), every replica checked equal; plus each rank's groups.
"""

from __future__ import annotations

import argparse
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
from _fixture_train import write_report
from torch import nn


class Mpu:
    """A Megatron-style model-parallel unit over gloo: TP groups of consecutive ranks, DP groups
    strided (the methods DeepSpeed's engine, ``utils/groups.py`` and ``utils/bwc.py`` call)."""

    def __init__(self, tp: int):
        dist = torch.distributed
        world, rank = dist.get_world_size(), dist.get_rank()
        self.tp, self.dp = tp, world // tp
        self.tp_rank, self.dp_rank = rank % tp, rank // tp
        self.tp_group = self.dp_group = None
        for start in range(0, world, tp):  # every rank creates every group, in one order
            ranks = list(range(start, start + tp))
            g = dist.new_group(ranks)
            if rank in ranks:
                self.tp_group = g
        for t in range(tp):
            ranks = list(range(t, world, tp))
            g = dist.new_group(ranks)
            if rank in ranks:
                self.dp_group, self.dp_ranks = g, ranks

    def get_model_parallel_rank(self):
        return self.tp_rank

    def get_model_parallel_world_size(self):
        return self.tp

    def get_model_parallel_group(self):
        return self.tp_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_tensor_model_parallel_src_rank(self):
        return torch.distributed.get_rank() - self.tp_rank

    def get_data_parallel_rank(self):
        return self.dp_rank

    def get_data_parallel_world_size(self):
        return self.dp

    def get_data_parallel_group(self):
        return self.dp_group

    def get_data_parallel_group_ranks(self):
        return self.dp_ranks

    def get_pipeline_model_parallel_world_size(self):
        return 1

    def get_pipeline_model_parallel_rank(self):
        return 0


def gloo_flat_all_gather() -> None:
    """Let ``all_gather_into_tensor`` take a flat output buffer on gloo, as NCCL does.

    DeepSpeed's ``moe/mappings.py`` ``_gather_tokens`` (run whenever the mpu's TP size is > 1) gathers
    into a 1-D buffer of ``world * numel`` elements; gloo's ``allgather_into_tensor`` wants it shaped
    ``[world * d0, *rest]`` ("invalid tensor size at index 0"). The same buffer is passed as a view of
    that shape (same storage, so DeepSpeed reads the gathered values from its own buffer). No value
    or saved byte changes; patched before ``deepspeed.init_distributed`` binds the function."""
    dist = torch.distributed
    orig = dist.all_gather_into_tensor

    def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
        if (output_tensor.dim() == 1 and input_tensor.dim() > 1 and output_tensor.is_contiguous()
                and output_tensor.numel() % input_tensor.numel() == 0):
            output_tensor = output_tensor.view(-1, *input_tensor.shape[1:])
        return orig(output_tensor, input_tensor, group=group, async_op=async_op)

    dist.all_gather_into_tensor = all_gather_into_tensor


class TP:
    """This rank's tensor-parallel group (set from the :class:`Mpu` before the model is built)."""

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


def _tp_param(shape: list[int], dim: int | None, seed: int, key: str, std: float) -> nn.Parameter:
    """A parameter drawn whole from a generator seeded by ``seed`` and ``key``, this TP rank's slice
    along ``dim`` kept (``None``: replicated); ``tp_dim`` records the split for the oracle."""
    full = list(shape)
    if dim is not None:
        full[dim] *= TP.size
    gen = torch.Generator().manual_seed(seed * 1000003 + zlib.crc32(key.encode()))
    whole = torch.randn(full, generator=gen) * std
    p = nn.Parameter(whole if dim is None else whole.chunk(TP.size, dim=dim)[TP.rank].clone())
    p.tp_dim = dim
    if dim is not None:
        p.tensor_model_parallel = True  # Megatron's marker: DeepSpeed's grad norm counts it on every TP rank
    return p


class ParallelMLP(nn.Module):
    """Megatron's MLP: column-parallel ``fc_in`` (+ bias), row-parallel ``fc_out`` (bias replicated)."""

    def __init__(self, hidden: int, ffn: int, seed: int, key: str, out_bias: bool = True):
        super().__init__()
        self.fc_in_weight = _tp_param([ffn // TP.size, hidden], 0, seed, f"{key}.fc_in.weight", 0.2)
        self.fc_in_bias = _tp_param([ffn // TP.size], 0, seed, f"{key}.fc_in.bias", 0.02)
        self.fc_out_weight = _tp_param([hidden, ffn // TP.size], 1, seed, f"{key}.fc_out.weight", 0.2)
        self.fc_out_bias = _tp_param([hidden], None, seed, f"{key}.fc_out.bias", 0.02) if out_bias else None

    def forward(self, x):
        h = nn.functional.gelu(nn.functional.linear(_Copy.apply(x), self.fc_in_weight, self.fc_in_bias))
        out = _Reduce.apply(nn.functional.linear(h, self.fc_out_weight))
        return out if self.fc_out_bias is None else out + self.fc_out_bias


def uc_info(cfg: dict) -> dict:
    """``universal_checkpoint_info`` for the TP model: the dense MLP's ``fc_out`` (and the TP expert's)
    row-parallel, ``fc_in`` column-parallel (the default), everything else of the dense part
    replicated. Classic experts without expert TP are named by neither (each is one EP rank's)."""
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_VERSION_VALUE

    return {"universal_checkpoint_version": UNIVERSAL_CHECKPOINT_VERSION_VALUE,
            "tp_replicated_parameter_patterns": [r"embed\.weight", r"blocks\.\d+\.ln2?\.(weight|bias)",
                                                 r"blocks\.\d+\.mlp\.fc_out_bias",
                                                 r"blocks\.\d+\.moe\.deepspeed_moe\.gate\.wg\.weight",
                                                 r"ln_f\.(weight|bias)", r"head\.weight"],
            "parameter_with_row_parallelism_patterns": [r".*\.fc_out_weight"]}


def build(cfg: dict, seed: int = 0) -> nn.Module:
    from deepspeed.moe.layer import MoE

    vocab, hidden, ffn = cfg["vocab"], cfg["hidden"], cfg["ffn"]
    tp, expert_tp = int(cfg.get("tp", 1)), bool(cfg.get("expert_tp", False))
    # the TP model's dense MLP also at TP 1 ("mpu": the TP model run through an mpu of TP 1)
    dense = tp > 1 or bool(cfg.get("mpu", False))

    class Expert(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(hidden, ffn)
            self.fc2 = nn.Linear(ffn, hidden, bias=False)

        def forward(self, x):
            return self.fc2(nn.functional.gelu(self.fc1(x)))

    class Block(nn.Module):
        def __init__(self, i: int):
            super().__init__()
            self.ln = nn.LayerNorm(hidden)
            if dense:  # a dense tensor-parallel MLP before the MoE, as a Megatron user's block has
                self.mlp = ParallelMLP(hidden, ffn, seed, f"blocks.{i}.mlp")
                self.ln2 = nn.LayerNorm(hidden)
            expert = ParallelMLP(hidden, ffn, seed, f"blocks.{i}.expert", out_bias=False) if expert_tp else Expert()
            # capacity_factor large enough that no token is dropped: routing depends only on the gate
            self.moe = MoE(hidden, expert, num_experts=cfg["num_experts"], ep_size=cfg["ep_size"], k=cfg["k"],
                           capacity_factor=4.0, eval_capacity_factor=4.0, min_capacity=4, use_rts=False,
                           drop_tokens=True, enable_expert_tensor_parallelism=expert_tp)

        def forward(self, x):
            if dense:
                x = x + self.mlp(self.ln(x))
                out, aux, _ = self.moe(self.ln2(x))
            else:
                out, aux, _ = self.moe(self.ln(x))
            return x + out, aux

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, hidden)
            self.blocks = nn.ModuleList(Block(i) for i in range(cfg["layers"]))
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


def _oracle(engine, cfg: dict, mpu: Mpu | None) -> dict:
    """``{"digests": {global name: {kind: digest}}, "groups": [...]}`` (rank 0; ``{}`` elsewhere):
    every parameter's whole fp32 master, Adam moments and module weight, TP shards joined over the TP
    group, experts under their global index; the replicas of one name checked equal."""
    from deepspeed.utils import groups, safe_get_full_fp32_param, safe_get_full_optimizer_state

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "e2e"))
    from digest import digest

    dist = torch.distributed
    name_ep = f"ep_size_{cfg['ep_size']}"
    ep_rank = groups._get_expert_parallel_rank(name_ep)
    local = cfg["num_experts"] // cfg["ep_size"]
    # DeepSpeed links each parameter's view into the Adam state once, at the first step; a flat group
    # whose state did not exist yet then has none (ValueError "exp_avg not found"): link again now
    opt = engine.optimizer
    if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
    mine: dict = {}
    for name, p in engine.module.named_parameters():
        tensors = {"module": p.data.detach().clone(), "fp32": safe_get_full_fp32_param(p)}
        for key in ("exp_avg", "exp_avg_sq"):
            try:
                tensors[key] = safe_get_full_optimizer_state(p, key)
            except ValueError as e:
                raise RuntimeError(f"{name}: {e} (rank {dist.get_rank()})") from None
        # by name: DeepSpeed's Experts deep-copies the expert module, and the copies lose tp_dim
        dim = 0 if ".fc_in_" in name else 1 if name.endswith(".fc_out_weight") else None
        if dim is not None and TP.size > 1:  # join the TP shards (a collective of the TP group)
            for kind, t in tensors.items():
                parts = [torch.empty_like(t) for _ in range(TP.size)]
                dist.all_gather(parts, t.contiguous(), group=TP.group)
                tensors[kind] = torch.cat(parts, dim=dim)
        m = re.match(r"^(.+\.deepspeed_experts)\.(\d+)\.(.+)$", name)
        gname = name if m is None else f"{m[1]}.{ep_rank * local + int(m[2])}.{m[3]}"
        mine[gname] = {kind: digest(gname, t) for kind, t in tensors.items()}
    me = {"rank": dist.get_rank(), "tp_rank": TP.rank, "dp_rank": mpu.dp_rank if mpu else dist.get_rank(),
          "ep_rank": ep_rank, "ep_group": list(groups._get_expert_parallel_group_ranks(name_ep)),
          "edp_group": list(groups._get_expert_data_parallel_group_ranks(name_ep)),
          "dp_group": list(mpu.dp_ranks) if mpu else list(range(dist.get_world_size()))}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (me, mine))
    merged: dict = {}
    for who, digests in every:
        for name, entry in digests.items():
            if name in merged and merged[name] != entry:
                kinds = sorted(k for k in entry if merged[name].get(k) != entry[k])
                raise RuntimeError(f"rank {who['rank']}: the replicas of {name} differ ({kinds})")
            merged[name] = entry
    return {"global_steps": int(engine.global_steps), "groups": [w for w, _ in every], "digests": merged}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    args = parser.parse_args()
    with open(args.spec) as f:
        spec = json.load(f)

    torch.set_num_threads(1)
    if int(spec["model_config"].get("tp", 1)) > 1:
        gloo_flat_all_gather()
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    deepspeed.init_distributed(dist_backend="gloo")
    seed = int(spec["seed"])
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    cfg = spec["model_config"]
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    mpu = None
    if int(cfg.get("tp", 1)) > 1 or cfg.get("mpu"):
        mpu = Mpu(int(cfg.get("tp", 1)))
        TP.size, TP.rank, TP.group = mpu.tp, mpu.tp_rank, mpu.tp_group
    dp_rank, dp_world = (mpu.dp_rank, mpu.dp) if mpu else (rank, world)
    model = build(cfg, seed)
    if mpu is not None:
        # how each parameter splits over TP ranks. DeepSpeed's MoE save path refuses it in client_state
        # (a reserved key) and records the module's own attribute instead (engine._save_moe_checkpoint)
        model.universal_checkpoint_info = uc_info(cfg)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": [p for p in model.parameters() if p.requires_grad], "name": "dense"})
    t0 = time.time()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=spec["ds_config"], mpu=mpu)
    if spec.get("load_dir"):  # a resume (tests/formats/deepspeed/test_moe_tp.py): digests right after the load
        load_path, _ = engine.load_checkpoint(spec["load_dir"], tag=spec.get("load_tag"))
        if load_path is None:
            raise RuntimeError(f"load_checkpoint({spec['load_dir']!r}) loaded nothing")
        loaded = _oracle(engine, cfg, mpu)
        if rank == 0:
            os.makedirs(spec["report_dir"], exist_ok=True)
            with open(Path(spec["report_dir"]) / "loaded.json", "w") as f:
                json.dump({"load_path": load_path, **loaded}, f, indent=1)
    micro = int(spec["micro_batch"])
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, cfg["vocab"], (micro * dp_world, spec["seq_len"]), generator=gen)
    mine = ids[dp_rank * micro:(dp_rank + 1) * micro]
    losses = []
    for step in range(int(spec["steps"])):
        loss = engine(mine, mine.roll(-1, dims=1))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
        print(f"[fixture-moe] rank={rank} step={step + 1} loss={float(loss):.8f}", flush=True)
    if spec.get("save_dir"):
        engine.save_checkpoint(spec["save_dir"], tag=spec["tag"])
    torch.distributed.barrier()
    if mpu is not None and spec.get("save_dir"):  # the oracle, written by the job that saved (TP fixtures only: older ones have none)
        oracle = _oracle(engine, cfg, mpu)
        if rank == 0:
            with open(Path(spec["save_dir"]) / "oracle.json", "w") as f:
                json.dump({"what": "written by the job that saved this checkpoint (scripts/_fixture_moe.py "
                                   "_oracle), right after save_checkpoint: every parameter's whole fp32 master, "
                                   "Adam moments and module weight (safe_get_full_fp32_param / "
                                   "safe_get_full_optimizer_state, TP shards joined over the mpu's TP group, "
                                   "experts under their global index), tests/e2e/digest.py digests", **oracle},
                          f, indent=1)
    write_report(spec, engine, rank=rank, world_size=world, dp_rank=dp_rank, dp_world_size=dp_world,
                 tp_rank=TP.rank, tp_world_size=TP.size, losses=losses, train_seconds=time.time() - t0,
                 batch_shape=list(mine.shape))
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
