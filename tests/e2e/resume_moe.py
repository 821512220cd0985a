"""Resume classic ``deepspeed.moe.layer.MoE`` checkpoints (the ``moe_ep2`` model of
``scripts/_fixture_moe.py``), one after another, in a real (gloo, CPU) DeepSpeed job and report
what was loaded, with digests named by *global* expert.

Launched by ``tests/e2e/launch.py`` (``resume_moe_many``); not meant to be run by hand::

    deepspeed --num_gpus N --no_local_rank --master_port PORT tests/e2e/resume_moe.py --spec SPEC.json

``SPEC.json`` holds ``report_path`` (written by rank 0) and ``loads``, a list of::

    {
      "name": "reshard:ep4",                        # key of this load in the report
      "model_config": {..., "ep_size": 4},          # _fixture_moe.build's config, at the target EP
      "seed": 1234, "seq_len": 16, "micro_batch": 2,
      "ref_dp": 2,                                  # the batch recipe's DP size (below)
      "ds_config": {...},                           # the fixture's config
      "load_dir": "...", "tag": null,               # engine.load_checkpoint(load_dir, tag)
      "steps": 2,
      "save_dir": null,                             # or: engine.save_checkpoint there right after the load
      "fresh_save_dir": null                        # or: engine.save_checkpoint there (tag "fresh") before
    }                                               # the load: DeepSpeed's own layout at this topology

Each load builds the model as the fixture did (``torch.manual_seed(seed)``, ``_fixture_moe.build``,
``split_params_into_different_moe_groups_for_optimizer`` groups), hands it to
``deepspeed.initialize`` and loads the checkpoint natively (``engine.load_checkpoint``).

**The batch** keeps the fixture's global token set whatever the world size: ``micro_batch *
ref_dp`` rows from ``torch.Generator().manual_seed(seed + 1)``; rank ``r`` takes the rows of
reference rank ``r % ref_dp`` (``[d * micro_batch, (d + 1) * micro_batch)``, labels the rows rolled by
one). At ``dp = k * ref_dp`` every reference rank's batch runs on ``k`` ranks: each rank's loss and
gate statistics (the aux loss, the capacity) are a reference rank's, and since DeepSpeed divides
every gradient by the DP size before summing it over the (expert-)data-parallel group, the
averaged gradients are the reference's up to the order of the float additions.

**Digests** (``digest.py``) right after the load and after the steps, per parameter, of the fp32
master (``safe_get_full_fp32_param``), the Adam moments (``safe_get_full_optimizer_state``) and the
module weight. An expert parameter ``<prefix>.deepspeed_experts.<j>.<sub>`` of EP rank ``e`` is
named by its global expert ``e * L + j`` (``L`` local experts), so the digests do not depend on
EP, EDP or DP. Every rank digests its own parameters; rank 0 gathers them all and checks that
the ranks holding the same parameter agree.
"""

# ruff: noqa: E402
import time

T_START = time.time()

import argparse
import gc
import json
import os
import random
import re
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "scripts"))
from _fixture_moe import build
from digest import digest
from resume_train import link_optimizer_state_views, optimizer_steps

EXPERT_RE = re.compile(r"^(?P<prefix>.+\.deepspeed_experts)\.(?P<local>\d+)\.(?P<sub>.+)$")


def global_name(name, param, local_experts):
    """An expert parameter's name with its global expert index (others: unchanged)."""
    from deepspeed.moe.utils import is_moe_param
    from deepspeed.utils import groups

    m = EXPERT_RE.match(name)
    if m is None or not is_moe_param(param):
        return name
    e = groups._get_expert_parallel_rank(param.group_name)
    return f"{m['prefix']}.{e * local_experts + int(m['local'])}.{m['sub']}"


def collect(engine, local_experts):
    """{global name: {kind: digest}} of this rank's parameters."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for name, p in engine.module.named_parameters():
        tensors = {"module": p.data, "fp32": safe_get_full_fp32_param(p)}
        for key in ("exp_avg", "exp_avg_sq"):
            try:
                tensors[key] = safe_get_full_optimizer_state(p, key)
            except (KeyError, ValueError):
                tensors[key] = None
        gname = global_name(name, p, local_experts)
        out[gname] = {k: digest(gname, t) for k, t in tensors.items() if t is not None}
    return out


def merge(per_rank):
    """One ``{name: {kind: digest}}`` from every rank's; names held by several ranks must agree."""
    merged, disagree = {}, []
    for r, digests in enumerate(per_rank):
        for name, entry in digests.items():
            if name in merged and merged[name] != entry:
                disagree.append((r, name))
            merged.setdefault(name, entry)
    return dict(sorted(merged.items())), disagree


def resume_one(load):
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from deepspeed.utils import groups

    t0 = time.time()
    seed, cfg = int(load["seed"]), load["model_config"]
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model = build(cfg)
    param_groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": [p for p in model.parameters() if p.requires_grad], "name": "dense"})
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups, config=load["ds_config"])
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    local_experts = cfg["num_experts"] // cfg["ep_size"]

    if load.get("fresh_save_dir"):
        engine.save_checkpoint(load["fresh_save_dir"], tag="fresh")
    load_path, _ = engine.load_checkpoint(load["load_dir"], tag=load.get("tag"))
    if load_path is None:
        raise RuntimeError(f"load_checkpoint({load['load_dir']!r}, tag={load.get('tag')!r}) loaded nothing")
    if load.get("save_dir"):
        engine.save_checkpoint(load["save_dir"], tag=os.path.basename(os.path.dirname(load_path)))
    link_optimizer_state_views(engine)
    group_names = [g.get("name") for g in engine.optimizer.optimizer.param_groups]
    global_steps_after_load = int(engine.global_steps)
    opt_steps_after_load = optimizer_steps(engine)
    after_load = collect(engine, local_experts)

    micro, ref_dp = int(load["micro_batch"]), int(load["ref_dp"])
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, cfg["vocab"], (micro * ref_dp, int(load["seq_len"])), generator=gen)
    d = rank % ref_dp
    mine = ids[d * micro:(d + 1) * micro]
    losses = []
    for _ in range(int(load["steps"])):
        loss = engine(mine, mine.roll(-1, dims=1))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach().item()))
    after_steps = collect(engine, local_experts)

    everyone = [None] * world
    torch.distributed.all_gather_object(everyone, {"rank": rank, "losses": losses, "after_load": after_load,
                                                   "after_steps": after_steps, "group_names": group_names,
                                                   "opt_steps": opt_steps_after_load})
    report = None
    if rank == 0:
        load_digests, bad_load = merge([r["after_load"] for r in everyone])
        step_digests, bad_steps = merge([r["after_steps"] for r in everyone])
        report = {
            "topology": {"world_size": world, "ep": groups._get_expert_parallel_world_size(f"ep_size_{cfg['ep_size']}"),
                         "zero_stage": int(engine.zero_optimization_stage())},
            "load_path": load_path,
            "losses_per_rank": {str(r["rank"]): r["losses"] for r in everyone},
            "global_steps_after_load": global_steps_after_load,
            "optimizer_step_after_load": sorted({s for r in everyone for s in r["opt_steps"]}),
            "param_group_names": sorted({tuple(r["group_names"]) for r in everyone}),
            "ranks_disagree": bad_load + bad_steps,
            "digests": {"after_load": load_digests, "after_steps": step_digests},
            "seconds": time.time() - t0,
        }
    engine.destroy()
    del engine, model
    gc.collect()
    torch.distributed.barrier()
    return report


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    args = parser.parse_args()
    with open(args.spec) as f:
        spec = json.load(f)
    torch.set_num_threads(1)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    reports = {}
    for load in spec["loads"]:
        report = resume_one(load)
        if report is None:
            continue
        reports[load["name"]] = report
        tmp = spec["report_path"] + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"loads": reports, "seconds": time.time() - T_START}, f, indent=1)
        os.replace(tmp, spec["report_path"])
    torch.distributed.barrier()
    try:
        deepspeed.comm.destroy_process_group()
    except Exception:
        pass


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
