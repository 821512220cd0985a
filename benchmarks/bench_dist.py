"""Distributed transfer: a ~100M-parameter Llama-shaped model TP=4 -> TP=2 x DP=2 (target global
rank = dp * 2 + tp) across 4 gloo processes on this machine, ``reshard.execute.live.transfer`` vs
(a) the wire floor (``benchmarks.wire_floor``: the same bytes between the same peers, one
pre-packed buffer per peer, plain ``isend``/``irecv``), (b) all-gathering every full parameter
then slicing locally and (c) DTensor ``redistribute`` on the layouts DTensor can express, all
in the same run, interleaved."""

from __future__ import annotations

import json
import logging
import statistics
import time
from datetime import timedelta
from pathlib import Path

from benchmarks.common import spawn_ranks

WORLD = 4
DTYPE = "bfloat16"
SIZES = {"layers": 6, "hidden": 1024, "kv": 256, "inter": 2816, "vocab": 16000}  # ~100M parameters
REPEAT = 9
BOUND = 16 << 20  # max_inflight_bytes for the bounded run
# Parameters whose layout DTensor can state: even splits of one dim, and replication. Fused
# qkv and gate_up are sub-parameters split one by one, which no Shard/Replicate placement says.
DTENSOR_KINDS = {"embed.weight": 0, "lm_head.weight": 0, "o_proj.weight": 1, "down.weight": 1, "norm.weight": None}


def _maps():
    from benchmarks.models import llama_maps
    from reshard.layouts import replicate_over

    src = llama_maps(4, **SIZES)
    tgt = {n: replicate_over(m, {0: [0, 2], 1: [1, 3]}) for n, m in llama_maps(2, **SIZES).items()}
    return src, tgt


def _dtensor_dim(name: str) -> int | None | bool:
    """Shard dim DTensor would use (None: replicated), or False where it cannot express it."""
    for suffix, dim in DTENSOR_KINDS.items():
        if name.endswith(suffix):
            return dim
    return False


def _timed(fns: dict, dist) -> dict[str, float]:
    """Best wall time of each collective step (all ranks started together and finished
    together), the contenders interleaved round by round so that a noisy spell on this shared
    machine hits them alike; and, as ``<name>_cpu`` and ``<name>_faults``, this rank's median CPU
    time (every thread: gloo moves bytes on its own threads) and page faults for the step."""
    import resource

    def step(fn):
        dist.barrier()
        t, c, f = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        result = fn()  # freed after the step: what a caller does with it is not the contender's cost
        c, f = time.process_time() - c, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f
        dist.barrier()
        wall = time.perf_counter() - t
        del result
        return wall, (c, f)

    for fn in fns.values():
        step(fn)  # warm-up: lazy connections, first allocations
    walls: dict[str, list[float]] = {name: [] for name in fns}
    cpus: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(REPEAT):
        for name, fn in fns.items():
            wall, cpu = step(fn)
            walls[name].append(wall)
            cpus[name].append(cpu)
    out = {n: min(w) for n, w in walls.items()}
    for n, c in cpus.items():
        out[f"{n}_cpu"] = statistics.median(x[0] for x in c)
        out[f"{n}_faults"] = statistics.median(x[1] for x in c)
    return out


def _all_gather_then_slice(src, tgt, local, rank, dist):
    """Baseline (a): every rank gathers each full parameter, rebuilds F, cuts its target shard."""
    import torch

    out = {}
    for name in sorted(src):
        mine = local[name]
        parts = [torch.empty_like(mine) for _ in range(WORLD)]
        dist.all_gather(parts, mine)
        full = src[name].rebuild(dict(enumerate(parts)), verify=False)
        out[name] = tgt[name].extract(full, rank)
    return out


def _dtensor_setup(names, local):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    plans = {}
    for n in names:
        dim = _dtensor_dim(n)
        if dim is None:
            plans[n] = ((Replicate(), Replicate()), (Replicate(), Replicate()))
        else:  # TP=4 rank r = dp * 2 + tp holds quarter r: nested Shard(dim) over (dp, tp)
            plans[n] = ((Shard(dim), Shard(dim)), (Replicate(), Shard(dim)))

    def run():
        return {n: DTensor.from_local(local[n], mesh, src_p, run_check=False).redistribute(mesh, dst_p).to_local()
                for n, (src_p, dst_p) in plans.items()}

    return run


def _bits(t):
    import torch

    return t.view(torch.int16) if t.element_size() == 2 else t


def _same(a: dict, b: dict, names) -> bool:
    import torch

    return all(n in a and n in b and torch.equal(_bits(a[n].contiguous()), _bits(b[n].contiguous())) for n in names)


def _floors(plan, rank: int, dtype, local, targets):
    """The bare wire floor, and the floor with the copies the target layout forces."""
    from benchmarks.wire_floor import Floor, FloorWithCopies, link_bytes

    esizes = dict.fromkeys(plan.params, dtype.itemsize)
    mine = {n: t.clone() for n, t in targets.items() if n in plan.params}  # touched, not transfer's
    return (Floor(link_bytes(plan, esizes), rank),
            FloorWithCopies(plan, esizes, rank, {n: local[n] for n in plan.params}, mine))


def _worker(rank: int, workdir: str) -> None:
    import torch
    import torch.distributed as dist

    from reshard.execute.live import Workspace, transfer
    from reshard.plan.planner import plan_for_rank, plan_model

    torch.set_num_threads(1)
    # DTensor logs a warning per redistribute of nested shards; the result says what it does
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=300))
    dtype = getattr(torch, DTYPE)
    src, tgt = _maps()
    t = time.perf_counter()
    mplan = plan_model(src, tgt)
    plan_s = time.perf_counter() - t
    gen = torch.Generator().manual_seed(1234)  # same F on every rank, so replicas agree
    local = {n: m.extract(torch.randn(m.logical_shape, generator=gen, dtype=dtype), rank)
             for n, m in sorted(src.items())}
    numel = sum(m.numel for m in src.values())
    res: dict = {"numel": numel, "plan_s": plan_s}

    stats: dict = {}
    ours = transfer(mplan, local, stats=stats)
    bounded: dict = {}
    transfer(mplan, local, max_inflight_bytes=BOUND, stats=bounded)
    res["bounded_rounds"] = bounded["rounds"]
    res["peak_staged"] = stats["peak_staged_bytes"]
    res["bounded_peak_staged"] = bounded["peak_staged_bytes"]
    gathered = _all_gather_then_slice(src, tgt, local, rank, dist)
    res["same_as_allgather"] = _same(ours, gathered, list(src))
    del gathered
    ws = Workspace()
    targets = {n: torch.empty_like(t) for n, t in ours.items()}  # the live case: the model exists
    transfer(mplan, local, workspace=ws, out=targets)
    res["same_into_out"] = _same(ours, targets, list(ours))
    t = time.perf_counter()
    mine = plan_for_rank(src, tgt, rank)  # what this rank sends and receives, nothing else
    res["plan_rank_s"] = time.perf_counter() - t
    res["same_per_rank"] = _same(ours, transfer(mine, local), list(ours))
    floor, floor_copies = _floors(mplan, rank, dtype, local, targets)
    res["floor_bytes"] = floor.nbytes
    res["floor_copied"] = floor_copies.copied_bytes
    times = _timed({
        "floor_s": floor,
        "floor_copies_s": floor_copies,
        "ours_out_s": lambda: transfer(mplan, local, workspace=ws, out=targets),
        "ours_rank_out_s": lambda: transfer(mine, local, workspace=ws, out=targets),
        "ours_ws_s": lambda: transfer(mplan, local, workspace=ws),
        "ours_s": lambda: transfer(mplan, local),
        "ours_bounded_s": lambda: transfer(mplan, local, max_inflight_bytes=BOUND),
        "allgather_s": lambda: _all_gather_then_slice(src, tgt, local, rank, dist),
    }, dist)
    res.update(times)

    names = [n for n in sorted(src) if _dtensor_dim(n) is not False]
    sub = plan_model({n: src[n] for n in names}, {n: tgt[n] for n in names})
    res["dtensor_params"] = len(names)
    res["dtensor_numel"] = sum(src[n].numel for n in names)
    sub_local = {n: local[n] for n in names}
    sub_out = {n: targets[n] for n in names if n in targets}
    sub_floor, sub_floor_copies = _floors(sub, rank, dtype, local, targets)
    contenders = {"floor_subset_s": sub_floor, "floor_copies_subset_s": sub_floor_copies,
                  "ours_subset_s": lambda: transfer(sub, sub_local, workspace=ws),
                  "ours_subset_out_s": lambda: transfer(sub, sub_local, workspace=ws, out=sub_out)}
    try:
        run = _dtensor_setup(names, local)
        res["same_as_dtensor"] = _same(ours, run(), names)
        res.update(_timed({**contenders, "dtensor_s": run}, dist))
    except Exception as e:  # noqa: BLE001 - reported, not fatal: DTensor's CPU support varies by version
        res["dtensor_error"] = f"{type(e).__name__}: {str(e)[:160]}"
        res.update(_timed(contenders, dist))

    every: list = [None] * WORLD
    dist.all_gather_object(every, {"stats": stats, "res": res})
    if rank == 0:
        es = torch.empty((), dtype=dtype).element_size()
        res["wire"] = sum(e["stats"]["sent_bytes"] for e in every)
        res["received"] = [e["stats"]["received_bytes"] for e in every]
        res["floor_wire"] = sum(e["res"]["floor_bytes"][0] for e in every)
        res["floor_copied"] = [sum(e["res"]["floor_copied"][i] for e in every) for i in (0, 1)]
        res["floor_received"] = [e["res"]["floor_bytes"][1] for e in every]
        res["plan_remote"] = mplan.stats(es).remote_bytes
        res["allgather_wire"] = sum((WORLD - 1) * m.shard(r).numel * es for m in src.values() for r in range(WORLD))
        res["same_everywhere"] = all(e["res"].get("same_as_allgather") and e["res"]["same_into_out"] for e in every)
        res["same_per_rank_everywhere"] = all(e["res"]["same_per_rank"] for e in every)
        res["plan_rank_s_max"] = max(e["res"]["plan_rank_s"] for e in every)
        res["dtensor_same_everywhere"] = all(e["res"].get("same_as_dtensor") for e in every)
        res["per_rank"] = [{k: e["stats"][k] for k in ("messages_sent", "messages_received", "packed_bytes",
                                                         "unpacked_bytes", "local_bytes")} for e in every]
        res["cpu"] = {k[:-4]: sum(e["res"][k] for e in every) for k in res if k.endswith("_cpu")}
        res["faults"] = {k[:-7]: sum(e["res"][k] for e in every) for k in res if k.endswith("_faults")}
        (Path(workdir) / "result.json").write_text(json.dumps(res))
    dist.destroy_process_group()


def _vs_floor(name: str, ours: float, floor: float, note: str = "", what: str = "floor") -> str:
    return f"{name:<58} {ours:>10.4f} s  {what} {floor:>9.4f} s  = {ours / floor:>5.2f}x the {what} {note}"


def _lines(res: dict) -> list[str]:
    from benchmarks.common import row

    gib, mib = 2**30, 2**20
    cpu = res["cpu"]
    lines = [
        f"model: Llama-shaped {SIZES}, {res['numel'] / 1e6:.0f}M parameters in {DTYPE}; "
        f"4 gloo processes; planning {res['plan_s']:.3f} s (not timed below)",
        _vs_floor("transfer into existing targets (out=), Workspace reused", res["ours_out_s"], res["floor_s"],
                  "(goal <= 1.25x; floor: same bytes and peers, one pre-packed buffer per peer)"),
        _vs_floor("  same with per-rank plans (plan_for_rank on each rank)", res["ours_rank_out_s"], res["floor_s"],
                  f"(planning {res['plan_rank_s_max']:.3f} s on the slowest rank; results identical: "
                  f"{res['same_per_rank_everywhere']})"),
        _vs_floor("transfer allocating its targets, Workspace reused", res["ours_ws_s"], res["floor_s"],
                  "(the floor allocates nothing)"),
        _vs_floor("  same (out=)", res["ours_out_s"], res["floor_copies_s"], "(floor + the copies the layout "
                  f"forces: {res['floor_copied'][0] / mib:.0f} MiB local, {res['floor_copied'][1] / mib:.0f} MiB "
                  "strided out of the received buffers)", what="floor+copies"),
        f"  floor+copies is itself {res['floor_copies_s'] / res['floor_s']:.2f}x the bare floor: the least that "
        "any transfer writing these target shards pays on this machine",
        f"  CPU s, all ranks and threads (median per rank, summed): floor {cpu['floor_s']:.4f}, with copies "
        f"{cpu['floor_copies_s']:.4f}; transfer into out= {cpu['ours_out_s']:.4f}, allocating {cpu['ours_ws_s']:.4f} "
        f"({res['faults']['ours_ws_s']:.0f} page faults, into out= {res['faults']['ours_out_s']:.0f})",
        "  per rank: messages sent/received, MiB packed/unpacked/copied locally: "
        + "; ".join(f"{r['messages_sent']}/{r['messages_received']} {r['packed_bytes'] / mib:.0f}/"
                    f"{r['unpacked_bytes'] / mib:.0f}/{r['local_bytes'] / mib:.0f}" for r in res["per_rank"]),
        row("transfer TP=4 -> TP=2xDP=2, whole model in one call", res["ours_s"], res["allgather_s"],
            note="(fresh staging; peer: all-gather each full param, rebuild, slice; goal >= 2x)"),
        row("  same, staging Workspace reused across calls", res["ours_ws_s"], res["allgather_s"]),
        row(f"  same, max_inflight_bytes={BOUND >> 20} MiB ({res['bounded_rounds']} rounds)", res["ours_bounded_s"],
            res["allgather_s"], note=f"(peak staging {res['bounded_peak_staged'] >> 20} MiB vs "
                                     f"{res['peak_staged'] >> 20} MiB unbounded, rank 0)"),
        f"  bytes on the wire: ours {res['wire']:,} = plan remote {res['plan_remote']:,} = floor "
        f"{res['floor_wire']:,}: {res['wire'] == res['plan_remote'] == res['floor_wire']} "
        f"({res['wire'] / gib:.3f} GiB; all-gather moves {res['allgather_wire'] / gib:.3f} GiB); received per rank "
        f"{res['received']} (floor {res['floor_received']})",
        f"  results bit-identical to the all-gather baseline on every rank (also into out=): {res['same_everywhere']}",
    ]
    share = f"{res['dtensor_params']} params, {res['dtensor_numel'] / 1e6:.0f}M elements"
    lines.append(_vs_floor(f"transfer, DTensor-expressible subset ({share})", res["ours_subset_s"],
                           res["floor_subset_s"], "(allocating its targets)"))
    lines.append(_vs_floor("  same into out=", res["ours_subset_out_s"], res["floor_copies_subset_s"],
                           f"({res['ours_subset_out_s'] / res['floor_subset_s']:.2f}x the bare floor)",
                           what="floor+copies"))
    if "dtensor_s" in res:
        lines.append(row("  same vs DTensor redistribute (S,S) -> (R,S) on a 2x2 mesh", res["ours_subset_s"],
                         res["dtensor_s"], note=f"(Workspace reused; DTensor = {res['dtensor_s'] / res['floor_subset_s']:.2f}x "
                                                "the floor)"))
        lines.append(f"  DTensor results bit-identical to ours: {res['dtensor_same_everywhere']}; fused qkv and "
                     "gate_up (sub-parameters split one by one) have no DTensor placement and are left out")
    else:
        lines.append(f"  DTensor failed: {res['dtensor_error']}")
    return lines


def main() -> list[str]:
    res = spawn_ranks(_worker, WORLD, 600, "bench_dist")
    return [res] if isinstance(res, str) else _lines(res)


if __name__ == "__main__":
    print("\n".join(main()))
