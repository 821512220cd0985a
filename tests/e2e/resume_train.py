"""Resume DeepSpeed checkpoints, one after another, in a real (gloo, CPU) job and report what was
loaded.

Launched (one process per rank) by ``tests/e2e/launch.py``; not meant to be run by hand::

    deepspeed --num_gpus N --no_local_rank --master_port PORT \
        tests/e2e/resume_train.py --spec SPEC.json

``SPEC.json`` holds ``report_path`` (written by rank 0) and ``loads``, a list of::

    {
      "name": "reshard:llama_tp2_dp2:tp2dp1",         # key of this load in the report
      "model_type": "llama", "model_config": {...},   # as in a fixture's fixture.json
      "patches": [],                                  # names from scripts/_fixture_train.PATCHES
      "seed": 1234, "seq_len": 16, "micro_batch": 2,  # the fixture's data recipe
      "ds_config": {...},                             # already adjusted to the target topology
      "load_dir": "...",                              # parent of the tag folder
      "tag": null,                                    # null: DeepSpeed reads latest[_universal]
      "steps": 2,
      "save_dir": null,                               # or: engine.save_checkpoint there right after
                                                      # the load (DeepSpeed's own native files)
      "param_groups": null                            # or: the optimizer groups the files record
    }                                                 # (launch.recorded_groups), names in order

Each load gets a fresh engine, as a fresh job would: the model is built exactly as the fixtures
were (``AutoModelForCausalLM.from_config`` after ``torch.manual_seed(seed)``, eager attention,
fp32), handed to ``deepspeed.initialize``, and its weights overwritten by
``engine.load_checkpoint``; the engine is destroyed before the next load. Paying the process
start, imports and process group once for several loads is what keeps the suite fast. All loads of
one job run on the same ranks, so they share the world size; DeepSpeed keeps its tensor-parallel
groups for the life of the process, so the launcher orders TP=1 loads first and allows one TP size
above 1 per job (see ``launch.check_tp_order``). The batch follows the fixture recipe for the
*target* DP size: ``micro_batch * dp`` sequences from ``torch.Generator().manual_seed(seed + 1)``,
DP rank ``d`` takes rows ``[d * micro_batch, (d + 1) * micro_batch)``, labels = input ids, same
batch each step.

Digests (see ``tests/e2e/digest.py``) are taken right after the load and after the steps, per
parameter, of: the fp32 master (``safe_get_full_fp32_param``), the Adam moments
(``safe_get_full_optimizer_state``) and the module weight. Those helpers all-reduce over the
parameter's ZeRO data-parallel group and return this TP rank's shard; the shards are then
all-gathered over the TP group and put back into the logical tensor with the parameter's AutoTP
affine map (``ds_autotp_universal_checkpoint_meta``), so the digest does not depend on the
topology. Every rank computes every digest; rank 0 checks all ranks agree and writes the report,
``{"loads": {name: report}, "import_torch_seconds", "seconds", "versions"}``, rewritten after
every load; each load's report has its own ``seconds`` and ``timings`` (build, initialize, load,
digests, steps).
"""

# ruff: noqa: E402  (the clock starts before the heavy imports, to time them)
import time

T_START = time.time()

import argparse
import gc
import json
import math
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "scripts"))
import _fixture_autoep  # noqa: F401  (registers the AutoEP fixtures' transformers patch)
from _fixture_train import fixed_batch, setup
from digest import digest, summary


class TPGather:
    """Rebuilds the logical tensor of a parameter from its tensor-parallel shards."""

    def __init__(self, logical_shapes):
        from deepspeed.utils import groups

        self.logical_shapes = logical_shapes
        try:
            self.tp_world = groups.get_tensor_model_parallel_world_size()
            self.tp_rank = groups.get_tensor_model_parallel_rank()
            self.group = groups.get_tensor_model_parallel_group() if self.tp_world > 1 else None
        except Exception:  # no TP groups at all
            self.tp_world, self.tp_rank, self.group = 1, 0, None
        self.layouts = {}  # name -> how it was put together
        self.replica_mismatches = []  # (name, kind) whose TP replicas differ

    def full(self, name, param, local, kind):
        from deepspeed.checkpoint.affine import SCALE_POWER_BY_STATE, ParamAffineMap
        from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META

        local = local.detach().cpu().contiguous()
        ep_meta = _autoep_meta(param)
        if ep_meta is not None:  # an AutoEP expert: this EP rank's experts, gathered over EP
            self.layouts[name] = "autoep"
            return _autoep_full(param, local, ep_meta, kind)
        # a parameter AutoEP created (its router) is not in the model as built: its own shape
        want = self.logical_shapes.get(name, tuple(local.shape))
        if self.tp_world == 1:
            self.layouts[name] = "whole"
            out = local
        else:
            shards = [None] * self.tp_world
            torch.distributed.all_gather_object(shards, local, group=self.group)
            meta = getattr(param, DS_AUTOTP_UC_META, None)
            amap = (meta or {}).get("conversion", {}).get("affine_map")
            if amap is not None:
                power = 1 if kind == "module" else SCALE_POWER_BY_STATE.get(kind, 1)
                try:
                    out = ParamAffineMap.from_dict(amap).rebuild(dict(enumerate(shards)), scale_power=power)
                except ValueError as e:  # replicated block that differs between TP ranks
                    self.replica_mismatches.append((name, kind, str(e)))
                    out = shards[0]
                self.layouts[name] = "affine_map"
            elif not meta:  # AutoTP left it alone: replicated on every TP rank
                if not all(torch.equal(shards[0], s) for s in shards[1:]):
                    self.replica_mismatches.append((name, kind, "replicas differ"))
                out = shards[0]
                self.layouts[name] = "replicated"
            elif meta.get("partition_dim") is not None:
                out = torch.cat(shards, dim=meta["partition_dim"])
                self.layouts[name] = f"concat(dim={meta['partition_dim']})"
            else:
                raise RuntimeError(f"{name}: AutoTP metadata without an affine map or partition dim: {meta}")
        if tuple(out.shape) != tuple(want):
            raise RuntimeError(f"{name} ({kind}): rebuilt shape {tuple(out.shape)} != logical {tuple(want)}")
        return out


def _autoep_meta(param):
    from deepspeed.checkpoint.constants import DS_AUTOEP_UC_META

    return getattr(param, DS_AUTOEP_UC_META, None)


def _autoep_full(param, local, meta, kind):
    """An AutoEP expert parameter's logical ``[num_experts, ...]`` tensor: every EP rank's local
    experts (all-gathered over the expert-parallel group, in EP rank order) put back with the
    placement's affine map, so the digest does not depend on the EP degree."""
    from deepspeed.checkpoint.affine import ParamAffineMap
    from deepspeed.checkpoint.constants import AFFINE_MAP
    from deepspeed.utils import groups

    group = groups._get_expert_parallel_group(param.group_name)
    shards = [None] * torch.distributed.get_world_size(group=group)
    torch.distributed.all_gather_object(shards, local, group=group)
    out = ParamAffineMap.from_dict(meta[AFFINE_MAP]).rebuild(dict(enumerate(shards)))
    want = tuple(meta["logical_shape"]) if "logical_shape" in meta else None
    if want is not None and tuple(out.shape) != want:
        raise RuntimeError(f"AutoEP expert ({kind}): rebuilt shape {tuple(out.shape)} != logical {want}")
    return out


def link_optimizer_state_views(engine):
    """Make ``safe_get_full_optimizer_state`` work right after a *native* ZeRO-1/2 load.

    DeepSpeed 0.19.8's ``load_checkpoint`` (non-universal) re-creates every parameter's
    ``_hp_mapping`` with ``optim_fragment=None``; the views into the Adam state are only linked
    lazily at the next ``step()``, so until then ``safe_get_full_optimizer_state`` fails with
    ``TypeError: argument of type 'NoneType' is not iterable``. Run the same lazy linking now (it
    only creates views of the existing state tensors). Returns whether anything was linked."""
    opt = engine.optimizer
    if not hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
        return False
    stale = any(getattr(p, "_hp_mapping", None) is not None and p._hp_mapping.optim_fragment is None
                for p in engine.module.parameters())
    if not stale:
        return False
    opt._hp_optimizer_states_linked = False
    opt._lazy_init_hp_params_optimizer_state()
    return True


def collect(engine, gather):
    """{param: {kind: digest}} for the fp32 master, Adam moments and module weight."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for name, p in engine.module.named_parameters():
        entry = {}
        if hasattr(p, "ds_id"):  # ZeRO-3: the module holds only this rank's partition
            with deepspeed.zero.GatheredParameters([p]):
                tensors = {"module": p.data.detach().clone()}
        else:
            tensors = {"module": p.data}
        if p.requires_grad:
            tensors["fp32"] = safe_get_full_fp32_param(p)
            for key in ("exp_avg", "exp_avg_sq"):
                try:
                    tensors[key] = safe_get_full_optimizer_state(p, key)
                except (KeyError, ValueError):  # no such state (yet)
                    tensors[key] = None
        for kind, t in tensors.items():
            if t is None:
                continue
            entry[kind] = digest(name, gather.full(name, p, t, kind))
        out[name] = entry
    return out


def optimizer_steps(engine):
    """Sorted distinct values of the basic optimizer's per-group ``step`` on this rank."""
    basic = getattr(engine.optimizer, "optimizer", engine.optimizer)
    steps = set()
    for state in getattr(basic, "state", {}).values():
        s = state.get("step") if isinstance(state, dict) else None
        if s is not None:
            steps.add(float(s))
    return sorted(steps)


def param_groups(model, groups):
    """The optimizer's parameter groups: the model's parameters as one group where ``groups`` is
    None, else the groups a checkpoint's files record (``launch.recorded_groups``: each group's
    parameter names in the files' order, and its hyper-parameters), as the job that wrote them
    built its optimizer. A ZeRO-1/2 engine flattens each group in its list's order and loads the
    files' flat partitions group by group, by position; every trainable parameter in one group."""
    if groups is None:
        return model.parameters()
    named = dict(model.named_parameters())
    out, seen = [], set()
    for g in groups:
        unknown = [n for n in g["params"] if n not in named]
        if unknown:
            raise RuntimeError(f"recorded group names {unknown[:3]}, which the model does not hold")
        seen.update(g["params"])
        out.append({**{k: v for k, v in g.items() if k != "params"}, "params": [named[n] for n in g["params"]]})
    missing = [n for n, p in named.items() if p.requires_grad and n not in seen]
    if missing or sum(len(g["params"]) for g in groups) != len(seen):
        raise RuntimeError(f"recorded groups leave out {missing[:3]} or name a parameter twice")
    return out


def resume_one(load, timings):
    """Build a fresh model and engine, load ``load``'s checkpoint, take its steps; rank 0 gets the
    load's report (other ranks None). ``timings`` gets this load's laps."""
    import deepspeed
    from deepspeed.utils import groups

    t0 = mark = time.time()

    def lap(name):
        nonlocal mark
        now = time.time()
        timings[name] = round(now - mark, 3)
        mark = now

    model = setup(load)  # the fixture generator's own setup: same threads, patches, seed, model
    rank = torch.distributed.get_rank()
    world = torch.distributed.get_world_size()
    logical_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    lap("build_model")

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model, load.get("param_groups")),
                                           config=load["ds_config"])
    try:
        dp_rank, dp_world = groups.get_data_parallel_rank(), groups.get_data_parallel_world_size()
    except Exception:  # no TP groups (TP=1): data parallel over the world
        dp_rank, dp_world = rank, world
    gather = TPGather(logical_shapes)
    lap("deepspeed_initialize")

    load_path, _client = engine.load_checkpoint(load["load_dir"], tag=load.get("tag"))
    if load_path is None:
        raise RuntimeError(f"load_checkpoint({load['load_dir']!r}, tag={load.get('tag')!r}) loaded nothing")
    lap("load_checkpoint")
    if load.get("save_dir"):
        # DeepSpeed's own native checkpoint of exactly the state it loaded, under the loaded tag
        engine.save_checkpoint(load["save_dir"], tag=os.path.basename(os.path.dirname(load_path)))
        lap("save_checkpoint")
    linked_views = link_optimizer_state_views(engine)
    global_steps_after_load = int(engine.global_steps)
    opt_steps_after_load = optimizer_steps(engine)
    after_load = collect(engine, gather)
    lap("digests_after_load")

    input_ids = fixed_batch(load, model.config.vocab_size, dp_rank, dp_world).to(engine.device)

    losses = []
    for step in range(int(load["steps"])):
        loss = engine(input_ids=input_ids, labels=input_ids, use_cache=False).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach().float().item()))
        print(f"[e2e-resume] {load['name']} rank={rank} step={step + 1} loss={losses[-1]!r}", flush=True)
    lap("train_steps")
    after_steps = collect(engine, gather)
    lap("digests_after_steps")

    mine = {
        "rank": rank,
        "tp_rank": gather.tp_rank,
        "dp_rank": dp_rank,
        "losses": losses,
        "summary": [summary(after_load), summary(after_steps)],
        "optimizer_step_after_load": opt_steps_after_load,
        "optimizer_step_after_steps": optimizer_steps(engine),
        "replica_mismatches": gather.replica_mismatches,
    }
    everyone = [None] * world
    torch.distributed.all_gather_object(everyone, mine)

    report = None
    if rank == 0:
        dp_losses = {}
        for r in everyone:
            dp_losses.setdefault(r["dp_rank"], r["losses"])
        report = {
            "topology": {"tp": gather.tp_world, "dp": dp_world, "world_size": world,
                         "zero_stage": int(engine.zero_optimization_stage()),
                         "universal": bool(engine.load_universal_checkpoint())},
            "load_dir": load["load_dir"],
            "tag": load.get("tag"),
            "load_path": load_path,
            "save_dir": load.get("save_dir"),
            "steps": int(load["steps"]),
            "batch_shape": list(input_ids.shape),
            "losses": [math.fsum(dp_losses[d][s] for d in sorted(dp_losses)) / len(dp_losses)
                       for s in range(len(losses))],  # mean over DP ranks, per step
            "losses_per_rank": {str(r["rank"]): r["losses"] for r in everyone},
            "losses_per_dp_rank": {str(d): v for d, v in sorted(dp_losses.items())},
            "global_steps_after_load": global_steps_after_load,
            "linked_optimizer_state_views": linked_views,
            "global_steps_after_steps": int(engine.global_steps),
            "optimizer_step_after_load": sorted({s for r in everyone for s in r["optimizer_step_after_load"]}),
            "optimizer_step_after_steps": sorted({s for r in everyone for s in r["optimizer_step_after_steps"]}),
            "ranks_agree": all(r["summary"] == mine["summary"] for r in everyone),
            "tp_peers_same_loss": all(r["losses"] == dp_losses[r["dp_rank"]] for r in everyone),
            "replica_mismatches": [m for r in everyone for m in r["replica_mismatches"]],
            "layouts": gather.layouts,
            "digest_summary": {"after_load": summary(after_load), "after_steps": summary(after_steps)},
            "digests": {"after_load": after_load, "after_steps": after_steps},
            "ds_config": load["ds_config"],
            "optimizer_class": f"{type(engine.optimizer).__module__}.{type(engine.optimizer).__qualname__}",
            "timings": timings,
            "seconds": time.time() - t0,
        }
    # Release this engine (its gradient hooks and optimizer state) before the next one is built.
    engine.destroy()
    del engine, model
    gc.collect()
    torch.distributed.barrier()
    return report


def main():
    import_seconds = round(time.time() - T_START, 3)
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    args = parser.parse_args()
    with open(args.spec) as f:
        spec = json.load(f)

    import deepspeed

    applied = set()
    reports = {}
    for load in spec["loads"]:
        # Model patches replace forward methods: apply each once per process, not once per load.
        todo = [p for p in load.get("patches", []) if p not in applied]
        applied.update(todo)
        report = resume_one(dict(load, patches=todo), {})
        if report is None:
            continue
        reports[load["name"]] = report
        job = {
            "loads": reports,
            "import_torch_seconds": import_seconds,
            "seconds": time.time() - T_START,
            "versions": {"torch": torch.__version__, "deepspeed": deepspeed.__version__},
        }
        tmp = spec["report_path"] + ".tmp"
        with open(tmp, "w") as f:
            json.dump(job, f, indent=1)
        os.replace(tmp, spec["report_path"])

    rank = torch.distributed.get_rank()
    torch.distributed.barrier()
    try:
        deepspeed.comm.destroy_process_group()
    except Exception:
        pass
    print(f"[e2e-resume] rank={rank} done after {time.time() - T_START:.2f}s", flush=True)


if __name__ == "__main__":
    main()
    # The report is written and the process group is gone: skip the interpreter teardown of
    # torch / DeepSpeed / transformers, which takes seconds per rank on a busy machine.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
