"""FSDP2 (optionally x TP) training job that saves or loads a PyTorch DCP checkpoint.

Launched one process per rank by ``torchrun`` (CPU, ``gloo``) from ``scripts/make_fixtures.py``
(the DCP fixtures and ``--bench-dcp-200m``) and ``tests/dcp_jobs.py``. Not meant to be run by
hand, but it can be::

    torchrun --standalone --nproc_per_node 2 scripts/_fixture_dcp.py save \
        --dcp-dir /tmp/ckpt --report-dir /tmp/report --steps 3            # FSDP2, 1-D mesh
    torchrun --standalone --nproc_per_node 4 scripts/_fixture_dcp.py save \
        --dcp-dir /tmp/ckpt --report-dir /tmp/report --mesh 2x2           # FSDP x TP
    torchrun --standalone --nproc_per_node 3 scripts/_fixture_dcp.py load \
        --dcp-dir /tmp/ckpt --report-dir /tmp/report --steps 1

The recipe is the DeepSpeed Llama fixtures' (``make_fixtures.py`` / ``_fixture_train.py``): the
same transformers config, seed and initialisation, fixed synthetic batch, ``torch.optim.AdamW``
(lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01), gradient clipping at 1.0 and HF's
causal-LM loss with labels = input ids. So a DCP checkpoint converted from a DeepSpeed fixture
and loaded here continues the same training.

Data: the global batch is ``micro_batch * batch_dp`` rows (``batch_dp`` = 2, the DeepSpeed
fixtures' DP) drawn by ``_fixture_train.fixed_batch``. When the job's DP size divides it, DP rank
``d`` takes its own contiguous slice (at DP=2 exactly DeepSpeed's split); otherwise every rank
takes the whole batch. Either way the averaged gradient is the gradient of the global batch's
mean loss, and the reported loss (mean over DP ranks) is that loss: neither depends on the
world size. TP peers take the same rows.

``save``: train ``--steps`` steps, then ``dcp.save({"model": msd, "optim": osd}, checkpoint_id=
dcp_dir)`` with ``msd, osd = get_state_dict(model, optimizer)``.
``load``: ``get_state_dict`` of a fresh model + optimizer, ``dcp.load`` into it, ``set_state_dict``,
report the loaded state, then train ``--steps`` steps (0 is allowed).

Rank 0 writes ``report_dir/report.json`` (see ``write_report``) and, with ``--save-tensors``,
``report_dir/tensors.pt``: ``{fqn: {"param"|"exp_avg"|"exp_avg_sq": full fp32 tensor}}`` of the
state saved (``save``) or just loaded (``load``), gathered with ``DTensor.full_tensor()``.
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

SCRIPTS = Path(__file__).resolve().parent
REPO = SCRIPTS.parent
sys.path.insert(0, str(SCRIPTS))
sys.path.insert(1, str(REPO))  # tests.e2e.digest: the digests the DeepSpeed resume jobs report

from _fixture_train import _seed_everything, fixed_batch  # noqa: E402
from make_fixtures import LLAMA, LLAMA_200M, MICRO_BATCH, MIXTRAL, SEED, SEQ_LEN, ds_config  # noqa: E402

# name -> (transformers llama config, seq_len, micro_batch): the DeepSpeed fixtures' recipes
MODELS = {
    "tiny": (LLAMA, SEQ_LEN, MICRO_BATCH),
    "200m": (LLAMA_200M, 64, 1),  # make_fixtures.bench_200m_fixture
    "mixtral": (MIXTRAL, SEQ_LEN, MICRO_BATCH),  # mixtral_autoep_ep2's model: its experts fused in memory
}
MODEL_TYPES = {"mixtral": "mixtral"}  # else llama
BATCH_DP = 2  # the DeepSpeed Llama fixtures' DP size: their global batch is micro_batch * 2 rows
GRAD_CLIP = float(ds_config(1)["gradient_clipping"])
ADAMW = {k: v for k, v in ds_config(1)["optimizer"]["params"].items() if k != "torch_adam"}
KINDS = ("exp_avg", "exp_avg_sq")

# TP plan of one decoder layer (Megatron style); its local attention heads follow from the
# column-parallel q/k/v output width, because HF's Llama reshapes with ``view(..., -1, head_dim)``.
TP_PLAN = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}


def log(msg: str) -> None:
    print(f"[fixture-dcp] rank={dist.get_rank()} {msg}", flush=True)


def parse_mesh(text: str | None, world: int) -> tuple[int, int]:
    """``"DPxTP"`` (or None: ``(world, 1)``) checked against the world size."""
    if not text:
        return world, 1
    dp, tp = (int(x) for x in text.lower().split("x"))
    if dp * tp != world:
        raise SystemExit(f"--mesh {text} does not fit {world} ranks")
    return dp, tp


def build_model(model_config: dict, seed: int, model_type: str = "llama") -> torch.nn.Module:
    """The DeepSpeed fixtures' model: seeded random init, eager attention, fp32, full on every rank."""
    from transformers import AutoConfig, AutoModelForCausalLM

    _seed_everything(seed)
    config = AutoConfig.for_model(model_type, **model_config)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    model.train()
    return model


def parallelize(model: torch.nn.Module, dp: int, tp: int):
    """TP (over mesh dim "tp") of every decoder layer's linears, then FSDP2 over "dp": each
    decoder layer, then the root. Returns ``(mesh, dp_mesh)``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if tp == 1:
        mesh = init_device_mesh("cpu", (dp,), mesh_dim_names=("dp",))
        dp_mesh = mesh
    else:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        cfg = model.config
        for what, n in (("num_attention_heads", cfg.num_attention_heads),
                        ("num_key_value_heads", cfg.num_key_value_heads),
                        ("intermediate_size", cfg.intermediate_size)):
            if n % tp:
                raise SystemExit(f"{what}={n} is not divisible by TP={tp}")
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        dp_mesh = mesh["dp"]
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        for layer in model.model.layers:
            parallelize_module(layer, mesh["tp"], {k: styles[v]() for k, v in TP_PLAN.items()})
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return mesh, dp_mesh


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Clip by the global L2 norm. Under FSDP x TP the TP'd parameters live on the 2-D mesh and
    the others on the DP sub-mesh, and ``clip_grad_norm_`` cannot stack norms of DTensors on
    different meshes, so the norm is taken per mesh and the totals are combined."""
    from torch.distributed.tensor import DTensor

    groups: dict[object, list[torch.nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p)
    total_sq = torch.zeros((), dtype=torch.float32)
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type=2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        total_sq = total_sq + norm.float() ** 2
    total = total_sq.sqrt()
    for group in groups.values():  # one foreach multiply per mesh, for the same reason
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return float(total)


def local_batch(model_config: dict, seq_len: int, micro_batch: int, batch_dp: int, dp: int,
                dp_rank: int) -> torch.Tensor:
    """This DP rank's rows of the fixed global batch (see the module docstring)."""
    # fixed_batch draws micro * dp_world rows and slices; one "rank" of it is the whole draw
    spec = {"seed": SEED, "seq_len": seq_len, "micro_batch": micro_batch * batch_dp}
    rows = fixed_batch(spec, model_config["vocab_size"], 0, 1)
    if rows.shape[0] % dp == 0:
        per = rows.shape[0] // dp
        return rows[dp_rank * per:(dp_rank + 1) * per].contiguous()
    return rows


def train(model, optim, ids: torch.Tensor, steps: int, dp_group) -> tuple[list[float], list[float]]:
    """``steps`` AdamW steps on ``ids``; (mean loss over DP ranks, this rank's loss) per step."""
    params = [p for p in model.parameters() if p.requires_grad]
    means, mine = [], []
    for step in range(steps):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        norm = clip_grad_norm(params, GRAD_CLIP)
        optim.step()
        optim.zero_grad(set_to_none=True)
        value = loss.detach().float().reshape(1)
        mine.append(float(value))
        dist.all_reduce(value, group=dp_group)
        means.append(float(value) / dist.get_world_size(dp_group))
        log(f"step={step + 1} loss={mine[-1]:.8f} mean_loss={means[-1]:.8f} grad_norm={norm:.6f}")
    return means, mine


def sha256_fp32(t: torch.Tensor) -> str:
    """sha256 of the fp32 row-major bytes (as ``tests/e2e/digest.py``'s ``sha256``)."""
    x = t.detach().to(torch.float32).contiguous().reshape(-1)
    return hashlib.sha256(x.view(torch.uint8).numpy().tobytes()).hexdigest()


def full(t) -> torch.Tensor:
    """The whole logical tensor (a collective for a DTensor: every rank must call it)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def gather_state(model, optim, digests: str, keep: bool) -> tuple[dict, dict, dict]:
    """``(digests, tensors, info)`` of every parameter's weight and Adam moments: digests
    ``{fqn: {kind: digest}}`` (``digests`` = "full": ``tests/e2e/digest.digest``, "sha": sha256
    only, "none"), full tensors when ``keep`` (rank 0 only), and per-parameter ``info`` (shape,
    placements, Adam step). Every rank must call it."""
    from torch.distributed.tensor import DTensor

    if digests == "full":
        from tests.e2e.digest import digest
    else:
        digest = lambda name, t: {"shape": list(t.shape), "sha256": sha256_fp32(t)}  # noqa: E731
    rank0 = dist.get_rank() == 0
    out, tensors, info = {}, {}, {}
    for name, p in model.named_parameters():
        state = optim.state.get(p, {})
        entry = {"param": full(p.detach())}
        for kind in KINDS:
            if kind in state:
                entry[kind] = full(state[kind])
        if rank0:
            if digests != "none":
                out[name] = {k: digest(name, v) for k, v in entry.items()}
            if keep:
                tensors[name] = {k: v.detach().to(torch.float32).clone() for k, v in entry.items()}
            step = state.get("step")
            info[name] = {
                "shape": list(p.shape),
                "placements": [str(pl) for pl in p.placements] if isinstance(p, DTensor) else None,
                "mesh_dims": list(p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else None,
                "step": None if step is None else float(step),
            }
    return out, tensors, info


def write_report(report_dir: Path, report: dict, tensors: dict) -> None:
    """``report.json`` (and ``tensors.pt`` when there are tensors), written by rank 0 atomically."""
    report_dir.mkdir(parents=True, exist_ok=True)
    if tensors:
        torch.save(tensors, report_dir / "tensors.pt.tmp")
        os.replace(report_dir / "tensors.pt.tmp", report_dir / "tensors.pt")
    tmp = report_dir / "report.json.tmp"
    tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
    os.replace(tmp, report_dir / "report.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("save", "load"))
    ap.add_argument("--dcp-dir", type=Path, required=True, help="checkpoint written (save) or read (load)")
    ap.add_argument("--report-dir", type=Path, required=True)
    ap.add_argument("--mesh", default=None, metavar="DPxTP", help="2-D FSDP x TP mesh (default: 1-D FSDP2)")
    ap.add_argument("--steps", type=int, default=None, help="training steps (save: 3, load: 1)")
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny")
    ap.add_argument("--batch-dp", type=int, default=BATCH_DP, help="global batch = micro_batch * this many rows")
    ap.add_argument("--digests", choices=("full", "sha", "none"), default="full")
    ap.add_argument("--save-tensors", action="store_true", help="rank 0 writes report_dir/tensors.pt")
    ap.add_argument("--allow-partial-load", action="store_true",
                    help="load: dcp.load(planner=DefaultLoadPlanner(allow_partial_load=True))")
    args = ap.parse_args()
    steps = args.steps if args.steps is not None else (3 if args.mode == "save" else 1)

    faulthandler.enable()  # a C++ abort (e.g. in gloo) then shows where Python was
    # Deterministic single-threaded CPU kernels, as the DeepSpeed fixtures.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True, warn_only=True)
    dist.init_process_group("gloo")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    world, rank = dist.get_world_size(), dist.get_rank()
    dp, tp = parse_mesh(args.mesh, world)
    model_config, seq_len, micro_batch = MODELS[args.model]
    t0 = time.time()
    model_type = MODEL_TYPES.get(args.model, "llama")
    model = build_model(model_config, SEED, model_type)
    mesh, dp_mesh = parallelize(model, dp, tp)
    optim = torch.optim.AdamW(model.parameters(), **ADAMW)
    dp_rank = dp_mesh.get_local_rank()
    ids = local_batch(model_config, seq_len, micro_batch, args.batch_dp, dp, dp_rank)
    timings = {"build_seconds": time.time() - t0}
    report = {
        "mode": args.mode, "world_size": world, "mesh": {"dp": dp, "tp": tp}, "model": args.model,
        "model_type": model_type, "model_config": model_config, "seed": SEED, "seq_len": seq_len,
        "micro_batch": micro_batch, "batch_dp": args.batch_dp, "local_batch_rows": int(ids.shape[0]),
        "optimizer": {"class": "torch.optim.AdamW", **ADAMW}, "gradient_clipping": GRAD_CLIP,
        "tp_plan": TP_PLAN if tp > 1 else None, "dcp_dir": str(args.dcp_dir), "steps": steps,
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
    }

    if args.mode == "save":
        t = time.time()
        means, mine = train(model, optim, ids, steps, dp_mesh.get_group())
        timings["train_seconds"] = time.time() - t
        t = time.time()
        msd, osd = get_state_dict(model, optim)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(args.dcp_dir))
        timings["save_seconds"] = time.time() - t
        digests, tensors, info = gather_state(model, optim, args.digests, args.save_tensors)
        report.update(losses=means, losses_rank0=mine, state="saved after training", digests=digests,
                      params=info)
    else:
        t = time.time()
        msd, osd = get_state_dict(model, optim)  # initialises the Adam state (a zero-lr step)
        state = {"model": msd, "optim": osd}
        planner = None
        if args.allow_partial_load:
            from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

            planner = DefaultLoadPlanner(allow_partial_load=True)
        dcp.load(state, checkpoint_id=str(args.dcp_dir), planner=planner)
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        timings["load_seconds"] = time.time() - t
        digests, tensors, info = gather_state(model, optim, args.digests, args.save_tensors)
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optim.param_groups]
        t = time.time()
        means, mine = train(model, optim, ids, steps, dp_mesh.get_group())
        timings["train_seconds"] = time.time() - t
        report.update(losses=means, losses_rank0=mine, state="loaded, before the steps", digests=digests,
                      params=info, param_groups=groups)
    if rank == 0:
        steps_seen = sorted({v["step"] for v in info.values()}, key=str)
        report["adam_step"] = steps_seen[0] if len(steps_seen) == 1 else steps_seen
        report["timings"] = timings
        write_report(args.report_dir, report, tensors)
    dist.barrier()
    del mesh
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Everything is written and the process group is gone: skip interpreter finalisation, where
    # gloo's worker threads can still hold tensors and abort the process ("terminate called
    # without an active exception", seen once in ~30 launches; pytorch/pytorch#179291).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
