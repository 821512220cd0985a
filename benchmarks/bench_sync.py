"""Weight sync, RL-style: a ~215M-parameter Llama-shaped model's fp32 shards (FSDP2's dim-0 chunks
over 2 trainer ranks) pushed into a vLLM-style TP=2 engine in bf16 on 2 other ranks, 4 gloo
processes on this machine. ``WeightSync.push`` against

(a) the common path (verl, OpenRLHF): per parameter, the trainer casts its shard to bf16,
    all-gathers the full tensor, trainer rank 0 broadcasts it to the engine ranks, which slice
    their part into their tensors (every buffer preallocated: the path at its best);
(b) the wire floor (``benchmarks.wire_floor.Floor``): the same bytes between the same peers, one
    pre-packed buffer per peer, plain ``isend``/``irecv``;

all in the same run, interleaved. ``--gpu`` (no-op without CUDA) times the GPU side of a push
for a 7B-shaped model on one device instead: every rank's gather/cast/scatter of a simulated
FSDP=8 -> TP=8 push and a colocated FSDP=1 -> TP=1 one, against a ``torch.cuda`` copy of the
same bytes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import timedelta
from pathlib import Path

from benchmarks.common import spawn_ranks

TRAINER, ENGINE = [0, 1], [2, 3]
WORLD = 4
REPEAT = 7
SMALL = {"layers": 10, "hidden": 1024, "heads": 16, "kv": 4, "inter": 4096, "vocab": 32000}  # ~215M
SEVEN_B = {"layers": 32, "hidden": 4096, "heads": 32, "kv": 8, "inter": 11008, "vocab": 32000}  # ~6.7B
BOUND = 64 << 20


def hf_llama_shapes(layers: int, hidden: int, heads: int, kv: int, inter: int, vocab: int) -> dict[str, tuple]:
    """Hugging Face Llama parameter names and shapes (untied head)."""
    d = hidden // heads
    out = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (heads * d, hidden), p + "self_attn.k_proj.weight": (kv * d, hidden),
                    p + "self_attn.v_proj.weight": (kv * d, hidden), p + "self_attn.o_proj.weight": (hidden, heads * d),
                    p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                    p + "mlp.down_proj.weight": (hidden, inter), p + "input_layernorm.weight": (hidden,),
                    p + "post_attention_layernorm.weight": (hidden,)})
    out["model.norm.weight"] = (hidden,)
    out["lm_head.weight"] = (vocab, hidden)
    return out


def layout(sizes: dict, trainer: list[int], engine: list[int]):
    """(source maps: FSDP2's Shard(0) over ``trainer``; engine targets: vLLM TP over ``engine``)."""
    from torch.distributed.tensor import Shard

    from reshard.execute.sources import dtensor_map
    from reshard.layouts.arch import LLAMA_VLLM, inference_targets

    shapes = hf_llama_shapes(**sizes)
    src = {n: dtensor_map(s, trainer, [Shard(0)]) for n, s in shapes.items()}
    tg = inference_targets(LLAMA_VLLM, shapes, tp=len(engine), num_heads=sizes["heads"], num_kv_heads=sizes["kv"],
                           ranks=engine)
    return src, tg, shapes


# -- (a): all-gather on the trainer, broadcast, slice ------------------------------------------------


class GatherBroadcast:
    """The common path, every buffer allocated once: per parameter, cast the shard to bf16, all-gather
    the (padded) chunks on the trainer, broadcast the full tensor from trainer rank 0 to the engine,
    and on the engine copy its part of every piece into its tensors."""

    def __init__(self, src, tg, shapes, rank: int, local, engine, gather_group, bcast_group, dtype) -> None:
        import torch

        from reshard.ir.piece import prod

        self.steps = []
        t = len(TRAINER)
        for n in sorted(shapes):
            shape = shapes[n]
            chunk = -(-shape[0] // t) * prod(shape[1:])
            # room for the engine's padded vocabulary rows too (zero): its pieces read them
            full = torch.zeros(max(chunk * t, tg[n].map.numel), dtype=dtype)
            gathered = full[:chunk * t]
            mine = torch.zeros(chunk, dtype=dtype) if rank in TRAINER else None
            parts = []
            if rank in ENGINE:
                p = tg[n]
                out = engine[p.into].view(-1)
                for piece in p.map.shard(rank).pieces:
                    dest = type(piece.dest)(piece.dest.offset + p.offsets[rank], piece.dest.strides)
                    parts.append((out, dest, piece.source, piece.shape))
            self.steps.append((n, local.get(n), mine, gathered, full, parts))
        self.rank, self.gather_group, self.bcast_group = rank, gather_group, bcast_group

    def __call__(self) -> None:
        import torch.distributed as dist

        from reshard.ir.apply import view_of

        for _, shard, mine, gathered, full, parts in self.steps:
            if self.rank in TRAINER:
                mine[:shard.numel()].copy_(shard.view(-1))
                dist.all_gather_into_tensor(gathered, mine, group=self.gather_group)
            if self.rank == TRAINER[0] or self.rank in ENGINE:
                dist.broadcast(gathered, TRAINER[0], group=self.bcast_group)
            for out, dest, source, shape in parts:
                view_of(out, shape, dest).copy_(view_of(full, shape, source))


class FloorWithCast:
    """The floor plus the cast no cast-on-the-way sync avoids: each send buffer is filled from an fp32
    buffer of as many elements (``copy_``, the cast) just before it is posted, so casting one
    overlaps the wire of the ones before, as a push does."""

    def __init__(self, links, rank: int) -> None:
        import torch

        from benchmarks.wire_floor import Floor

        self.floor = Floor(links, rank)
        self.sources = [torch.randn(buf.numel() // 2) for _, buf in self.floor.sends]

    def __call__(self) -> None:
        import torch
        import torch.distributed as dist

        works = [dist.irecv(buf, peer) for peer, buf in self.floor.recvs]
        for (peer, buf), src in zip(self.floor.sends, self.sources):
            buf.view(torch.bfloat16).copy_(src)
            works.append(dist.isend(buf, peer))
        for w in works:
            w.wait()


# -- timing --------------------------------------------------------------------------------------------


def _timed(fns: dict, dist) -> dict[str, float]:
    """Best wall time of each collective step (barrier, step, barrier), interleaved; ``<name>_cpu``:
    this rank's median CPU seconds per step."""
    def step(fn):
        dist.barrier()
        t, c = time.perf_counter(), time.process_time()
        fn()
        c = time.process_time() - c
        dist.barrier()
        return time.perf_counter() - t, c

    for fn in fns.values():
        step(fn)
    walls: dict[str, list[float]] = {n: [] for n in fns}
    cpus: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(REPEAT):
        for n, fn in fns.items():
            w, c = step(fn)
            walls[n].append(w)
            cpus[n].append(c)
    return {**{n: min(w) for n, w in walls.items()}, **{f"{n}_cpu": statistics.median(c) for n, c in cpus.items()}}


def _worker(rank: int, workdir: str) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.wire_floor import Floor, link_bytes
    from reshard.execute.sync import WeightSync
    from reshard.layouts.inference import engine_shapes
    from reshard.layouts.tp import replicated

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=600))
    gather_group, bcast_group = dist.new_group(TRAINER), dist.new_group([TRAINER[0], *ENGINE])
    src, tg, shapes = layout(SMALL, TRAINER, ENGINE)
    gen = torch.Generator().manual_seed(rank)
    local = {n: torch.randn(m.shard(rank).shape, generator=gen) for n, m in src.items() if rank in m.shards}
    engine = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in engine_shapes(tg, rank).items()}
    t = time.perf_counter()
    sync = WeightSync(src, tg, torch.bfloat16)
    res = {"plan_s": time.perf_counter() - t, "numel": sum(m.numel for m in src.values())}
    sync.push(local, into=engine)
    bounded = WeightSync(src, tg, torch.bfloat16, max_inflight_bytes=BOUND)
    bounded.push(local, into=engine)
    tiny = WeightSync({"x": replicated((1,), TRAINER)}, {"x": replicated((1,), ENGINE)}, torch.bfloat16)
    tiny_in = {"x": torch.ones(1)} if rank in TRAINER else {}
    tiny_out = {"x": torch.zeros(1, dtype=torch.bfloat16)} if rank in ENGINE else None
    common = GatherBroadcast(src, tg, shapes, rank, local, engine, gather_group, bcast_group, torch.bfloat16)
    links = link_bytes(sync.plan, dict.fromkeys(sync.plan.params, 2))
    floor, floor_cast = Floor(links, rank), FloorWithCast(links, rank)
    local16 = {n: t.to(torch.bfloat16) for n, t in local.items()}  # a trainer holding bf16 weights
    sync16 = WeightSync(src, tg, torch.bfloat16)
    sync16.push(local16, into=engine)
    res.update(_timed({"floor_s": floor, "floor_cast_s": floor_cast, "push_s": lambda: sync.push(local, into=engine),
                       "push16_s": lambda: sync16.push(local16, into=engine),
                       "push_bounded_s": lambda: bounded.push(local, into=engine),
                       "common_s": common, "tiny_s": lambda: tiny.push(tiny_in, into=tiny_out)}, dist))
    res["stats"], res["bounded_stats"], res["floor_bytes"] = sync.stats, bounded.stats, floor.nbytes
    res["stats16"] = sync16.stats
    sync.push(local, into=engine)
    ours = {n: t.clone() for n, t in engine.items()}
    common()
    res["same"] = all(torch.equal(ours[n].view(torch.int16), t.view(torch.int16)) for n, t in engine.items())
    every: list = [None] * WORLD
    dist.all_gather_object(every, res)
    if rank == 0:
        (Path(workdir) / "result.json").write_text(json.dumps(every))
    dist.destroy_process_group()


def _lines(every: list[dict]) -> list[str]:
    r0 = every[0]
    mib = 2**20
    wire = sum(e["stats"]["sent_bytes"] for e in every)
    floor_wire = sum(e["floor_bytes"][0] for e in every)
    common_wire = (len(TRAINER) - 1 + len(ENGINE)) * r0["numel"] * 2  # all-gather, then one copy per engine rank
    push, common, floor = r0["push_s"], r0["common_s"], r0["floor_s"]
    cpu = {k: sum(e[f"{k}_cpu"] for e in every) for k in ("push_s", "push16_s", "common_s", "floor_s", "floor_cast_s")}
    bounded = f"push with max_inflight_bytes={BOUND >> 20} MiB ({r0['bounded_stats']['rounds']} rounds)"
    return [
        f"model: Llama-shaped {SMALL}, {r0['numel'] / 1e6:.0f}M parameters; fp32 FSDP2 chunks on ranks {TRAINER} -> "
        f"vLLM TP={len(ENGINE)} bf16 on ranks {ENGINE}; 4 gloo processes; planning {r0['plan_s']:.2f} s (once)",
        f"{'WeightSync.push (steady state)':<58} {push:>9.4f} s",
        f"{'(a) cast, all-gather on the trainer, broadcast, slice':<58} {common:>9.4f} s  = {common / push:>5.2f}x "
        f"the push (goal >= 3x)",
        f"{'(b) wire floor: same bytes, same peers, pre-packed':<58} {floor:>9.4f} s  push = {push / floor:>5.2f}x "
        f"the floor (goal <= 1.3x)",
        f"{'(b+cast) the floor, each send buffer cast from fp32 first':<58} {r0['floor_cast_s']:>9.4f} s  push = "
        f"{push / r0['floor_cast_s']:>5.2f}x (the least a cast on the sender costs here)",
        f"{'push from bf16 sources (no cast on the way)':<58} {r0['push16_s']:>9.4f} s  = "
        f"{r0['push16_s'] / floor:>5.2f}x the floor; packed/unpacked MiB per rank "
        + ", ".join(f"{e['stats16']['packed_bytes'] / mib:.0f}/{e['stats16']['unpacked_bytes'] / mib:.0f}" for e in every),
        f"{bounded:<58} {r0['push_bounded_s']:>9.4f} s  = {r0['push_bounded_s'] / floor:>5.2f}x the floor",
        f"{'per-push overhead: push of a 1-element model':<58} {r0['tiny_s'] * 1e3:>9.3f} ms (the check and end "
        f"all-reduces, one message)",
        f"  bytes on the wire: push {wire / mib:.0f} MiB = floor {floor_wire / mib:.0f} MiB: {wire == floor_wire} "
        f"(bf16: half the fp32 masters); the common path moves {common_wire / mib:.0f} MiB "
        f"(all-gather + broadcast to {len(ENGINE)} ranks)",
        f"  engine tensors bit-identical after a push and after the common path, every rank: "
        f"{all(e['same'] for e in every)}",
        f"  CPU s, all ranks: push {cpu['push_s']:.3f} (bf16 sources {cpu['push16_s']:.3f}), common path "
        f"{cpu['common_s']:.3f}, floor {cpu['floor_s']:.3f} (with the cast {cpu['floor_cast_s']:.3f}); "
        f"per rank packed/unpacked MiB: "
        + ", ".join(f"{e['stats']['packed_bytes'] / mib:.0f}/{e['stats']['unpacked_bytes'] / mib:.0f}" for e in every),
    ]


def main() -> list[str]:
    res = spawn_ranks(_worker, WORLD, 900, "bench_sync")
    return [res] if isinstance(res, str) else _lines(res)


# -- --gpu ---------------------------------------------------------------------------------------------


def _device_time(fn, device, repeat: int = 10) -> float:
    """Best wall time of ``fn`` with the device drained before and after (CUDA events on a GPU)."""
    import torch

    cuda = device.type == "cuda"
    fn()
    if cuda:
        torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeat):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
    return best


def _gpu_case(dev, f: int, t: int, sizes: dict = SEVEN_B) -> str:
    import torch

    from reshard.execute.sync_program import Loopback
    from reshard.layouts.inference import engine_shapes

    trainer = list(range(f))
    engine = list(range(f, f + t)) if f > 1 else [0]
    t0 = time.perf_counter()
    src, tg, _ = layout(sizes, trainer, engine)
    sources = {r: {n: torch.randn(m.shard(r).shape, device=dev) for n, m in src.items() if r in m.shards}
               for r in trainer}
    into = {r: {n: torch.empty(s, dtype=torch.bfloat16, device=dev) for n, s in engine_shapes(tg, r).items()}
            for r in engine}
    job = Loopback(src, tg, torch.bfloat16, sources, into)
    setup = time.perf_counter() - t0
    ours = _device_time(job.run, dev, 5)
    moved = sum(p.sent_bytes + p.local_bytes for p in job.programs.values())
    bufs = [torch.empty(moved, dtype=torch.uint8, device=dev) for _ in range(2)]
    copy = _device_time(lambda: bufs[1].copy_(bufs[0]), dev)
    what = (f"FSDP={f} -> TP={t} (every rank's pack/cast, wire as D2D copies, unpack)" if f > 1
            else "colocated FSDP=1 -> TP=1 (cast-copies into fused engine tensors)")
    return (f"{what}: push {ours * 1e3:.1f} ms, torch.cuda copy of the same {moved / 2**30:.2f} GiB "
            f"{copy * 1e3:.1f} ms = {ours / copy:.2f}x (setup {setup:.1f} s, not timed)")


def gpu_main(fsdp: int = 8, tp: int = 8) -> list[str]:
    """The GPU side of a push of a 7B-shaped model on one CUDA device (module docstring)."""
    import torch

    if not torch.cuda.is_available():
        return ["bench_sync --gpu: no CUDA device, nothing run"]
    dev = torch.device("cuda", torch.cuda.current_device())
    lines = [f"device: {torch.cuda.get_device_name(dev)}; model {SEVEN_B}"]
    for f, t in ((fsdp, tp), (1, 1)):
        lines.append(_gpu_case(dev, f, t))
        torch.cuda.empty_cache()
    return lines


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", action="store_true", help="time the GPU side of a 7B push on one CUDA device")
    print("\n".join(gpu_main() if ap.parse_args().gpu else main()))
