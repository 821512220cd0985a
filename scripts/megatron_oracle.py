#!/usr/bin/env python
"""Megatron's own reading of a Megatron checkpoint, dumped as plain full tensors (opt-in tool).

Loads a checkpoint folder written by Megatron-LM / Megatron-Core (``torch_dist`` or the legacy
``torch`` format: the folder that holds ``latest_checkpointed_iteration.txt``) with Megatron-LM's
own ``load_checkpoint`` (through ``setup_model_and_optimizer``) at the topology asked for, then
gathers what every rank holds into full tensors and writes them, so a test can compare a
checkpoint that reshard wrote -- loaded by Megatron -- with Megatron's own reload of the source.

It needs the Megatron venv (torch 2.13 CPU + megatron-core 0.19.2; see
``scripts/make_megatron_fixtures.py --venv-help``), not reshard's environment::

    /work/venvs/megatron/bin/python scripts/megatron_oracle.py CKPT --out DIR [--tp 1 --pp 1 --dp 1]
        [--ep 1] [--no-optim] [--buckets] [--forward] [--venv /work/venvs/megatron]

World size is ``tp * pp * dp``; above 1 it re-launches itself under ``torchrun --standalone``.
The model and optimizer arguments come from the checkpoint (Megatron-LM's
``--use-checkpoint-args``, plus the vocabulary, optimizer and schedule settings read from the
saved ``args``); only the parallel sizes are the caller's.

What lands in ``DIR`` (plain tensors only; ``safetensors`` files, readable without pickle):

- ``model.safetensors``: every model weight as a full tensor, keyed by its TP=1/PP=1 state-dict
  name (``decoder.layers.<global i>.self_attention.linear_qkv.weight``, ...; layer and expert
  numbers global);
- ``optimizer.safetensors`` (unless ``--no-optim`` or Megatron cannot load the optimizer at that
  topology): the Adam moments in model space, full tensors keyed ``exp_avg.<name>`` and
  ``exp_avg_sq.<name>`` (and ``param.<name>``, the fp32 main parameter, for the distributed
  optimizer);
- ``buckets.safetensors`` (``--buckets``, distributed optimizer only): the ``dp_reshardable``
  view at this topology, keyed by the ShardedTensor keys Megatron would save
  (``optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(...).bucket_idx_0.exp_avg``, ...);
- ``forward.safetensors`` (``--forward``): ``input_ids`` (a fixed ``(2, seq_length)`` batch of
  random token ids, seed ``FORWARD_SEED``) and ``logits`` (``(2, seq_length, padded_vocab)``,
  fp32) of the reloaded model's forward pass (no labels);
- ``oracle.json``: how it was made, the topology, the iteration, ``name -> [ShardedTensor key,
  index along the stacked axes]`` for every weight (so ``model.safetensors`` doubles as the
  ShardedTensor-keyed view: ``full[key][index] == model[name]``), the global shape of every key,
  the optimizer's param groups and the scheduler's state as Megatron reloaded them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_VENV = os.environ.get("MEGATRON_VENV", "/work/venvs/megatron")
FORWARD_SEED = 2024
FORWARD_BATCH = 2


# --------------------------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------------------------


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ckpt", help="checkpoint folder (holds latest_checkpointed_iteration.txt)")
    p.add_argument("--out", required=True, help="folder to write the dump into")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1, help="expert model parallel size (divides tp*dp)")
    p.add_argument("--etp", type=int, default=None, help="expert tensor parallel size (default: --tp)")
    p.add_argument("--no-optim", action="store_true", help="load and dump the model only")
    p.add_argument("--buckets", action="store_true", help="also dump the dp_reshardable bucket view")
    p.add_argument("--forward", action="store_true", help="also run a forward pass on a fixed batch")
    p.add_argument("--venv", default=DEFAULT_VENV, help="the Megatron venv (default $MEGATRON_VENV or %(default)s)")
    p.add_argument("--timeout", type=int, default=600)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def launch(opts) -> int:
    """Run the worker under ``torchrun`` from the Megatron venv; returns its exit status."""
    world = opts.tp * opts.pp * opts.dp
    os.makedirs(opts.out, exist_ok=True)
    cmd = [
        os.path.join(opts.venv, "bin", "torchrun"), "--standalone", f"--nproc-per-node={world}",
        os.path.abspath(__file__), "--worker", os.path.abspath(opts.ckpt), "--out", os.path.abspath(opts.out),
        "--tp", str(opts.tp), "--pp", str(opts.pp), "--dp", str(opts.dp), "--ep", str(opts.ep),
    ]
    if opts.etp is not None:
        cmd += ["--etp", str(opts.etp)]
    cmd += [f for f, on in (("--no-optim", opts.no_optim), ("--buckets", opts.buckets),
                            ("--forward", opts.forward)) if on]
    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1", OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, timeout=opts.timeout)
    print(f"megatron_oracle: exit {proc.returncode} after {time.monotonic() - t0:.1f}s -> {opts.out}", flush=True)
    return proc.returncode


# --------------------------------------------------------------------------------------------
# worker (one process per rank, Megatron venv)
# --------------------------------------------------------------------------------------------


def read_checkpoint_args(ckpt: str):
    """The ``args`` Namespace and iteration a checkpoint was saved with (Megatron's own readers)."""
    import torch
    from megatron.core import dist_checkpointing
    from megatron.training.checkpointing import (
        find_checkpoint_rank_0,
        get_checkpoint_tracker_filename,
        read_metadata,
    )

    iteration, release = read_metadata(get_checkpoint_tracker_filename(ckpt))
    where = find_checkpoint_rank_0(ckpt, iteration, release)
    if where is None:
        raise SystemExit(f"megatron_oracle: no checkpoint found for iteration {iteration} in {ckpt}")
    if dist_checkpointing.check_is_distributed_checkpoint(where):
        common = dist_checkpointing.load_common_state_dict(where)
        fmt = "torch_dist"
    else:
        common = torch.load(where, map_location="cpu", weights_only=False)
        fmt = "torch"
    return common["args"], iteration, fmt


def oracle_argv(ck, opts, fmt: str) -> list[str]:
    """A Megatron-LM command line that reloads ``opts.ckpt`` at the requested topology."""
    argv = [
        "--use-checkpoint-args", "--load", opts.ckpt, "--ckpt-format", fmt, "--exit-on-missing-checkpoint",
        "--no-load-rng", "--dist-ckpt-strictness", "log_all", "--use-checkpoint-opt-param-scheduler",
        "--tensor-model-parallel-size", str(opts.tp), "--pipeline-model-parallel-size", str(opts.pp),
        "--expert-model-parallel-size", str(opts.ep),
        "--vocab-size", str(ck.vocab_size), "--tokenizer-type", "NullTokenizer",
        "--make-vocab-size-divisible-by", str(ck.make_vocab_size_divisible_by),
        "--seq-length", str(ck.seq_length), "--micro-batch-size", "1",
        "--global-batch-size", str(ck.global_batch_size),
        "--train-iters", str(ck.train_iters), "--lr", repr(ck.lr), "--min-lr", repr(ck.min_lr),
        "--lr-decay-style", ck.lr_decay_style, "--weight-decay", repr(ck.weight_decay),
        "--adam-beta1", repr(ck.adam_beta1), "--adam-beta2", repr(ck.adam_beta2), "--adam-eps", repr(ck.adam_eps),
        "--clip-grad", repr(ck.clip_grad), "--seed", str(ck.seed), "--optimizer", ck.optimizer,
        "--init-method-std", repr(ck.init_method_std),
        "--transformer-impl", "local", "--use-cpu-initialization", "--distributed-backend", "gloo",
        "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion",
        "--no-rope-fusion", "--no-bias-dropout-fusion", "--no-persist-layer-norm",
    ]
    # what --use-checkpoint-args does not restore
    if getattr(ck, "qk_layernorm", False):
        argv.append("--qk-layernorm")
    if getattr(ck, "multi_latent_attention", False):  # MLA's shape is not restored by --use-checkpoint-args
        argv += ["--multi-latent-attention", "--kv-lora-rank", str(ck.kv_lora_rank), "--qk-head-dim",
                 str(ck.qk_head_dim), "--qk-pos-emb-head-dim", str(ck.qk_pos_emb_head_dim), "--v-head-dim",
                 str(ck.v_head_dim), "--kv-channels", str(ck.kv_channels), "--norm-epsilon",
                 repr(getattr(ck, "layernorm_epsilon", None) or ck.norm_epsilon)]
        if ck.q_lora_rank is not None:
            argv += ["--q-lora-rank", str(ck.q_lora_rank)]
        if getattr(ck, "rope_type", None):
            argv += ["--rope-type", ck.rope_type]
    if getattr(ck, "moe_shared_expert_gate", False):
        argv.append("--moe-shared-expert-gate")
    if getattr(ck, "moe_router_group_topk", None):  # group-limited routing: not restored either
        argv += ["--moe-router-num-groups", str(ck.moe_router_num_groups),
                 "--moe-router-group-topk", str(ck.moe_router_group_topk)]
    if opts.etp is not None:
        argv += ["--expert-tensor-parallel-size", str(opts.etp)]
    if opts.tp > 1 and getattr(ck, "sequence_parallel", False):
        argv.append("--sequence-parallel")
    if getattr(ck, "moe_token_dispatcher_type", None):
        argv += ["--moe-token-dispatcher-type", ck.moe_token_dispatcher_type]
    if ck.use_distributed_optimizer:
        argv.append("--use-distributed-optimizer")
    # the DDP bucket layout (a dp_reshardable optimizer keys its state per bucket): not restored either
    if getattr(ck, "overlap_grad_reduce", False):
        argv.append("--overlap-grad-reduce")
        for flag, field in (("--ddp-bucket-size", "ddp_bucket_size"), ("--ddp-num-buckets", "ddp_num_buckets")):
            if getattr(ck, field, None) is not None:
                argv += [flag, str(getattr(ck, field))]
    if getattr(ck, "dist_ckpt_optim_fully_reshardable", False):
        argv.append("--dist-ckpt-optim-fully-reshardable")
    if opts.pp == ck.pipeline_model_parallel_size > 1:  # at the saved PP, its virtual / uneven stages too
        for flag, field in (("--num-layers-per-virtual-pipeline-stage", "num_layers_per_virtual_pipeline_stage"),
                            ("--num-virtual-stages-per-pipeline-rank", "num_virtual_stages_per_pipeline_rank"),
                            ("--decoder-first-pipeline-num-layers", "decoder_first_pipeline_num_layers"),
                            ("--decoder-last-pipeline-num-layers", "decoder_last_pipeline_num_layers")):
            if getattr(ck, field, None) is not None:
                argv += [flag, str(getattr(ck, field))]
    if opts.no_optim:
        argv.append("--no-load-optim")
    if ck.bf16:
        argv.append("--bf16")
    return argv


def _is_main(replica_id) -> bool:
    from megatron.core.dist_checkpointing.mapping import is_main_replica

    return is_main_replica(replica_id)


def _pieces(sharded_sd, with_names: bool):
    """(name, key, global_shape, global_offset, prepend, data) for each main-replica ShardedTensor."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory, apply_factories

    out = []

    def visit(name, v):
        if isinstance(v, ShardedTensorFactory):
            raise AssertionError("factories should be applied")
        if isinstance(v, ShardedTensor):
            if _is_main(v.replica_id):
                out.append((name, v.key, tuple(v.global_shape), tuple(v.global_offset), v.prepend_axis_num,
                            v.data.detach().clone()))
        elif isinstance(v, dict):
            for k, x in v.items():
                visit(k if with_names and name is None else name, x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                visit(name, x)

    apply_factories(sharded_sd)
    visit(None, sharded_sd)
    return out


def _global_name(local_name: str, key: str, offset: tuple, prepend: int) -> str:
    """The TP=1/PP=1 state-dict name of a local name (global layer and expert numbers): the
    stacked axes are (layer[, expert]), or -- per-layer keys (mixed dense / MoE layers), whose key
    names the global layer -- (expert)."""
    name = local_name
    axes = list(offset[:prepend])
    per_layer = re.search(r"\blayers\.(\d+)\.", key)
    layer = per_layer.group(1) if per_layer else (axes.pop(0) if axes else None)
    if layer is not None:
        name = re.sub(r"^(.*?\blayers\.)\d+\.", lambda m: f"{m.group(1)}{layer}.", name, count=1)
    if axes:
        if re.search(r"local_experts\.\d+\.", name):
            name = re.sub(r"local_experts\.\d+\.", f"local_experts.{axes[0]}.", name, count=1)
        else:  # grouped experts: weight<e>
            name = re.sub(r"(weight|bias)\d+$", lambda m: f"{m.group(1)}{axes[0]}", name)
    return name


def _gather(pieces):
    """All pieces of all ranks, on rank 0 (None elsewhere)."""
    import torch

    world = torch.distributed.get_world_size()
    got = [None] * world if torch.distributed.get_rank() == 0 else None
    torch.distributed.gather_object(pieces, got, dst=0)
    return None if got is None else [p for rank_pieces in got for p in rank_pieces]


def _assemble(pieces):
    """{key: full tensor} from pieces; checks every element is written once."""
    import torch

    full, seen, shapes = {}, {}, {}
    for _name, key, gshape, goff, prepend, data in pieces:
        if key not in full:
            full[key] = torch.zeros(gshape, dtype=data.dtype)
            seen[key] = torch.zeros(gshape, dtype=torch.int32)
            shapes[key] = list(gshape)
        local_shape = [1] * prepend + list(data.shape)
        sl = tuple(slice(o, o + s) for o, s in zip(goff, local_shape))
        full[key][sl] = data.reshape(local_shape)
        seen[key][sl] += 1
    for key, s in seen.items():
        if not bool((s == 1).all()):
            raise AssertionError(f"{key}: elements written {int(s.min())}..{int(s.max())} times, not once")
    return full, shapes


def _names(pieces):
    """{global name: [key, stacked index]} from the model pieces."""
    names = {}
    for local_name, key, _gshape, goff, prepend, _data in pieces:
        name = _global_name(local_name, key, goff, prepend)
        idx = list(goff[:prepend])
        if name in names and names[name] != [key, idx]:
            raise AssertionError(f"{name}: both {names[name]} and {[key, idx]}")
        names[name] = [key, idx]
    return names


def _by_name(full, names):
    return {n: full[k][tuple(i)].contiguous() for n, (k, i) in sorted(names.items())}


def _optimizers(optimizer):
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _param_groups(optimizer):
    groups = []
    for sub in _optimizers(optimizer):
        inner = getattr(sub, "optimizer", sub)
        for g in inner.param_groups:
            groups.append({k: (v if isinstance(v, (int, float, bool, str, type(None))) else list(v) if
                               isinstance(v, tuple) else repr(type(v).__name__))
                           for k, v in g.items() if k != "params"})
    return groups


def _optim_model_space(optimizer, model, metadata):
    """Model-space optimizer pieces: for the distributed optimizer through its fully_reshardable
    view (at any topology), else through the plain optimizer's sharded_state_dict."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    out = []
    for sub in _optimizers(optimizer):
        msd = _model_sd(model, metadata)
        if isinstance(sub, DistributedOptimizer) and _several_buckets(sub):
            out.extend(_optim_gathered(sub, model, metadata))
            continue
        if isinstance(sub, DistributedOptimizer):
            md = dict(metadata, distrib_optim_sharding_type="fully_reshardable",
                      distrib_optim_fully_reshardable_mem_efficient=False)
        else:
            md = metadata
        osd = sub.sharded_state_dict(msd, is_loading=False, metadata=md)
        out.extend(_pieces(osd, with_names=False))
    return out


def _several_buckets(sub) -> bool:
    return any(len(b.buckets) > 1 for b in getattr(sub, "buffers", []))


def _optim_gathered(sub, model, metadata):
    """Model-space pieces of a distributed optimizer with several buckets per DDP buffer, read from
    its own shards (``_get_main_param_and_optimizer_states``, each rank's range of each parameter,
    summed over the DP group into whole local tensors). Megatron 0.19.2's ``fully_reshardable``
    view cannot be used there: ``sharded_param_state_fully_reshardable`` slices the buckets'
    unpadded parts laid back to back (``get_parameter_state_dp_zero``) at the positions the padded
    buffer gives (``param_index_map``), so every bucket after the first one with end padding is
    read shifted."""
    from dataclasses import replace

    import torch
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    msd, factories = extract_sharded_tensors_and_factories(_model_sd(model, metadata))
    meta = {sh.data: sh for sh in nested_values(msd)}
    owned = {p: prm["param"] for maps in sub.gbuf_ranges for per_bucket in maps.values() for rmap in per_bucket
             for p, prm in rmap["param_map"].items()}
    state = {}
    for buffer in sub.buffers:
        for p in buffer.param_index_map:
            mine = sub._get_main_param_and_optimizer_states(p) if p in owned else None
            sh = meta[p]
            for k in ("param", "exp_avg", "exp_avg_sq"):
                t = torch.zeros(p.numel(), dtype=torch.float32)
                if mine is not None:
                    r = owned[p]
                    t[r.start:r.end] = mine[k].detach().float().reshape(-1)
                torch.distributed.all_reduce(t, group=sub.data_parallel_group)
                kw = dict(key=f"optimizer.state.{k}.{sh.key}", data=t.view(p.shape))
                if not isinstance(sh, ShardedTensorFactory):
                    kw["dtype"] = t.dtype
                state[len(state)] = replace(sh, **kw)
    return _pieces(state, with_names=False)


def _optim_buckets(optimizer, model, metadata):
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    out = []
    for sub in _optimizers(optimizer):
        if isinstance(sub, DistributedOptimizer):
            md = dict(metadata, distrib_optim_sharding_type="dp_reshardable")
            out.extend(_pieces(sub.sharded_state_dict(_model_sd(model, metadata), is_loading=False, metadata=md),
                               with_names=False))
    return out


def _model_sd(model, metadata):
    """The model's sharded state dict; with virtual stages ``{'model0': ..., 'model1': ...}``, one per
    model chunk, as Megatron-LM's ``generate_state_dict`` hands it to the optimizer."""
    from megatron.core.utils import unwrap_model

    chunks = unwrap_model(model)
    if len(chunks) == 1:
        return chunks[0].sharded_state_dict(metadata=metadata)
    return {f"model{i}": m.sharded_state_dict(metadata=metadata) for i, m in enumerate(chunks)}


def _model_pieces(model, metadata):
    """Each model chunk's pieces (their names count layers from 0 per chunk; offsets are global)."""
    from megatron.core.utils import unwrap_model

    return [p for m in unwrap_model(model) for p in _pieces(m.sharded_state_dict(metadata=metadata), with_names=True)]


def _optim_key_to_name(key: str, key_names: dict) -> str | None:
    """``optimizer.state.exp_avg.<model key>`` -> ``exp_avg``, model key (None if not one)."""
    m = re.match(r"^optimizer\.state\.(\w+)\.(.+)$", key)
    if not m or m.group(2) not in key_names:
        return None
    return m.group(1), m.group(2)


def _forward(model, args):
    """Logits of the reloaded model on the fixed batch, on rank 0 (None elsewhere)."""
    from functools import partial

    import _megatron_common as C
    import torch
    from megatron.core import mpu
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    g = torch.Generator().manual_seed(FORWARD_SEED)
    ids = torch.randint(0, args.vocab_size, (FORWARD_BATCH, args.seq_length + 1), generator=g)
    batch = C.make_inputs(ids)

    def keep(output_tensor, non_loss_data=False):
        return gather_from_tensor_model_parallel_region(output_tensor).detach().clone()

    def step(data_iterator, m):
        b = next(data_iterator)
        out = m(b["tokens"], b["position_ids"], b["attention_mask"])
        return out, partial(keep)

    for m in model:
        m.eval()
    # the interleaved (virtual pipeline) schedule reads one iterator per model chunk and wants at
    # least PP micro-batches: then one sequence each
    micro = [batch] if len(model) == 1 else [C.make_inputs(ids[i:i + 1]) for i in range(FORWARD_BATCH)]
    data = iter(micro) if len(model) == 1 else [iter(micro) for _ in model]
    with torch.no_grad():
        data = get_forward_backward_func()(
            forward_step_func=step, data_iterator=data, model=model, num_microbatches=len(micro),
            seq_length=args.seq_length, micro_batch_size=FORWARD_BATCH // len(micro), forward_only=True,
            collect_non_loss_data=True,
        )
    # the last pipeline stage has the logits; ship them to rank 0
    logits = torch.cat(list(data)) if (mpu.is_pipeline_last_stage(ignore_virtual=True) and data) else None
    box = [logits if (logits is not None and mpu.get_tensor_model_parallel_rank() == 0
                      and mpu.get_data_parallel_rank() == 0) else None]
    got = [None] * torch.distributed.get_world_size() if torch.distributed.get_rank() == 0 else None
    torch.distributed.gather_object(box[0], got, dst=0)
    if got is None:
        return None
    found = [x for x in got if x is not None]
    assert found, "no rank produced logits"
    return batch["tokens"], found[0]


def worker(opts) -> None:
    sys.path.insert(0, HERE)
    import _megatron_cpu

    _megatron_cpu.install()
    import _megatron_common as C
    import torch
    from megatron.training import get_args
    from megatron.training.checkpointing import _build_sharded_state_dict_metadata
    from safetensors.torch import save_file

    ck, saved_iteration, fmt = read_checkpoint_args(opts.ckpt)
    C.start_megatron(oracle_argv(ck, opts, fmt))
    model, optimizer, scheduler = C.setup()
    args = get_args()
    rank = torch.distributed.get_rank()
    metadata = _build_sharded_state_dict_metadata(args)

    model_pieces = _model_pieces(model, metadata)
    all_model = _gather(model_pieces)
    load_optim = not opts.no_optim
    optim_pieces = _optim_model_space(optimizer, model, metadata) if load_optim else []
    all_optim = _gather(optim_pieces)
    all_buckets = _gather(_optim_buckets(optimizer, model, metadata) if opts.buckets else [])
    fwd = _forward(model, args) if opts.forward else None

    if rank == 0:
        full, shapes = _assemble(all_model)
        names = _names(all_model)
        save_file(_by_name(full, names), os.path.join(opts.out, "model.safetensors"))
        info = {
            "tool": "scripts/megatron_oracle.py",
            "megatron_core": __import__("megatron.core.package_info", fromlist=["x"]).__version__,
            "torch": torch.__version__,
            "checkpoint_format": fmt,
            "iteration_loaded": args.iteration,
            "iteration_saved": saved_iteration,
            "topology": {"tp": opts.tp, "pp": opts.pp, "dp": opts.dp, "ep": opts.ep,
                         "world": torch.distributed.get_world_size()},
            "saved_topology": {"tp": ck.tensor_model_parallel_size, "pp": ck.pipeline_model_parallel_size,
                               "dp": ck.data_parallel_size, "ep": ck.expert_model_parallel_size,
                               "world": ck.world_size},
            "use_distributed_optimizer": bool(args.use_distributed_optimizer),
            "optimizer_loaded": load_optim,
            "names": names,
            "key_shapes": shapes,
        }
        if load_optim:
            ofull, oshapes = _assemble(all_optim)
            tensors = {}
            key_of_name = {tuple([k, tuple(i)]): n for n, (k, i) in names.items()}
            for okey, t in ofull.items():
                kind, mkey = _optim_key_to_name(okey, shapes) or (None, None)
                if kind is None:
                    raise AssertionError(f"unexpected optimizer key {okey}")
                for (k, idx), n in key_of_name.items():
                    if k == mkey:
                        tensors[f"{kind}.{n}"] = t[idx].contiguous()
            save_file(dict(sorted(tensors.items())), os.path.join(opts.out, "optimizer.safetensors"))
            info["optimizer_key_shapes"] = oshapes
            info["param_groups"] = _param_groups(optimizer)
            info["opt_param_scheduler"] = scheduler.state_dict() if scheduler is not None else None
        if opts.buckets and all_buckets:
            bfull, bshapes = _assemble(all_buckets)
            save_file(bfull, os.path.join(opts.out, "buckets.safetensors"))
            info["bucket_key_shapes"] = bshapes
        if fwd is not None:
            ids, logits = fwd
            save_file({"input_ids": ids.contiguous(), "logits": logits.float().contiguous()},
                      os.path.join(opts.out, "forward.safetensors"))
            info["forward"] = {"seed": FORWARD_SEED, "batch": FORWARD_BATCH, "seq_length": args.seq_length,
                               "input_ids": "torch.randint(0, vocab_size, (batch, seq_length + 1), "
                                            "generator=torch.Generator().manual_seed(seed))[:, :-1]",
                               "logits_shape": list(logits.shape), "mask": "causal (get_ltor_masks_and_position_ids)"}
        with open(os.path.join(opts.out, "oracle.json"), "w") as f:
            json.dump(info, f, indent=1, sort_keys=True)
            f.write("\n")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main(argv=None) -> int:
    opts = _parse(argv)
    if opts.worker:
        worker(opts)
        return 0
    return launch(opts)


if __name__ == "__main__":
    sys.exit(main())
