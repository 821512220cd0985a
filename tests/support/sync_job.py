"""The processes of ``tests/execute/test_sync.py``: one gloo job of 6 ranks runs every phase in turn
(spawning 6 processes is the expensive part on a small machine), each rank writing one JSON line
per phase that the tests assert on.

* **disjoint** -- a tiny HF Llama trained by FSDP2 (``fully_shard`` per decoder layer and the root,
  AdamW, fp32) on ranks 0-3; a vLLM-style TP=2 engine in plain torch (``vllm_ref``) on ranks 4-5
  holding bf16 tensors; after each of 3 optimizer steps a ``push()``. The engine's tensors are
  compared bit for bit with ``engine_slices`` of the trainer's full weights cast to bf16, and its
  TP forward (float64, over the engine's group) with HF's float64 forward on the same
  bf16-rounded weights. Pushes 2 and 3 run under ``torch.profiler`` (``profile_memory``) and a
  count of planner calls.
* **colocated** -- a second trainer on ranks 2-5 and a TP=4 engine (key/value heads replicated)
  on the same ranks, the sync over a sub-group ``[2, 3, 4, 5]`` (group ranks differ from global).
* **refusal** -- the disjoint sync handed a source of another dtype on rank 1, then an engine
  tensor of another shape on rank 5: every rank raises ``ShardError``; then a good push.
* **kill** -- rank 2 kills itself (SIGKILL) in the middle of a push: every other rank must raise
  ``TransferError``; rank 2's exit code is -9.
"""

from __future__ import annotations

import json
import os
import signal
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch

WORLD = 6
TRAINER, ENGINE = [0, 1, 2, 3], [4, 5]
COLO = [2, 3, 4, 5]
STEPS = 3
PG_TIMEOUT_S = 10  # a stuck collective of a sync errors out after this: the kill phase's bound
WORLD_TIMEOUT_S = 120
VICTIM = 2
LR = 1e-2


def config():
    from transformers import LlamaConfig

    # sizes pairwise distinct where it matters; vocab 101 pads to 128 rows (64 per TP=2 rank)
    return LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=44, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=False, attn_implementation="eager")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16) if t.element_size() == 2 else t.contiguous().view(torch.int32)


class Trainer:
    """An HF Llama under FSDP2 on ``ranks`` (this rank among them), trained a step at a time."""

    def __init__(self, ranks: list[int], mesh, seed: int) -> None:
        from torch.distributed.fsdp import fully_shard
        from transformers import LlamaForCausalLM

        torch.manual_seed(seed)
        self.model = LlamaForCausalLM(config())
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR)
        self.ranks, self.seed = ranks, seed

    def step(self, k: int) -> None:
        g = torch.Generator().manual_seed(1000 * self.seed + 10 * k + self.ranks.index(torch.distributed.get_rank()))
        ids = torch.randint(0, config().vocab_size, (2, 12), generator=g)
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.opt.step()
        self.opt.zero_grad()

    def full(self) -> dict[str, torch.Tensor]:
        return {n: p.full_tensor().detach().clone() for n, p in self.model.named_parameters()}


def source_maps(ranks: list[int]):
    """The trainer's maps as a rank that holds no trainer computes them: from the config's
    shapes and FSDP2's placement (``Shard(0)`` over ``ranks``)."""
    from torch.distributed.tensor import Shard
    from transformers import LlamaForCausalLM

    from reshard.execute.sources import dtensor_map

    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in LlamaForCausalLM(config()).named_parameters()}
    return {n: dtensor_map(s, ranks, [Shard(0)], name=n) for n, s in shapes.items()}, shapes


def targets(shapes, tp: int, ranks: list[int]):
    from reshard.layouts.arch import LLAMA_VLLM, inference_targets

    cfg = config()
    return inference_targets(LLAMA_VLLM, shapes, tp=tp, num_heads=cfg.num_attention_heads,
                             num_kv_heads=cfg.num_key_value_heads, ranks=ranks)


def engine_tensors(tg, rank: int) -> dict[str, torch.nn.Parameter]:
    """The engine's own parameters (bf16, garbage-filled: every element must be written)."""
    from reshard.layouts.inference import engine_shapes

    return {n: torch.nn.Parameter(torch.full(s, 3.0, dtype=torch.bfloat16)) for n, s in engine_shapes(tg, rank).items()}


def _profiled(fn) -> tuple[list, int]:
    """(the ops that allocated, with their bytes; the bytes) torch's CPU allocator reported while
    ``fn`` ran."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    allocs = [(e.name, e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage > 0]
    return allocs, sum(n for _, n in allocs)


def check_engine(rank: int, ranks: list[int], engine, full, group, *, previous=None) -> dict:
    """This engine rank's tensors against plain-torch slicing of ``full`` in bf16 (bits), and its
    TP forward against HF's (float64, same bf16 weights; and, for contrast, the previous step's)."""
    from transformers import LlamaForCausalLM

    from tests.support.vllm_ref import engine_slices, tp_forward

    cfg, tp, local = config(), len(ranks), ranks.index(rank)
    want = engine_slices({n: t.to(torch.bfloat16) for n, t in full.items()}, cfg, tp, local)
    errors = [n for n, t in want.items() if not torch.equal(_bits(engine[n].detach()), _bits(t))]
    errors += [f"{n}: not an engine tensor" for n in set(engine) ^ set(want)]
    ids = torch.randint(0, cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(7))
    got = tp_forward({n: t.detach() for n, t in engine.items()}, ids, cfg, tp, local, group)

    def hf(weights):
        ref = LlamaForCausalLM(cfg).to(torch.float64)
        ref.load_state_dict({n: t.to(torch.bfloat16).to(torch.float64) for n, t in weights.items()})
        return ref(input_ids=ids).logits.detach()

    rec = {"errors": errors, "logits_diff": (got - hf(full)).abs().max().item()}
    if previous is not None:
        rec["logits_diff_previous"] = (got - hf(previous)).abs().max().item()
    return rec


def _push_record(sync, push, profile: bool, planned) -> dict:
    """Run one push; what it allocated (under the profiler) and planned, and its byte counts."""
    before = planned[0]
    if profile:
        allocs, nbytes = _profiled(push)
    else:
        push()
        allocs, nbytes = None, None
    return {"allocs": allocs, "alloc_bytes": nbytes, "planner_calls": planned[0] - before,
            "stats": dict(sync.stats), "workspace": sync.workspace.nbytes}


def phase_disjoint(rank: int, workdir: Path, mesh, sync_group, engine_group, planned) -> tuple:
    from reshard.execute.sources import fsdp2_sources
    from reshard.execute.sync import WeightSync

    maps, shapes = source_maps(TRAINER)
    trainer = Trainer(TRAINER, mesh, seed=1) if rank in TRAINER else None
    local = {}
    if trainer is not None:
        mine, local = fsdp2_sources(trainer.model)
        assert all(mine[n] == maps[n] for n in maps), "fsdp2_sources and dtensor_map disagree"
    tg = targets(shapes, 2, ENGINE)
    engine = engine_tensors(tg, rank) if rank in ENGINE else None
    ptrs = {n: t.data_ptr() for n, t in (engine or {}).items()}
    calls = planned[0]
    sync = WeightSync(maps, tg, torch.bfloat16, group=sync_group)
    rec: dict = {"construct_planner_calls": planned[0] - calls, "pushes": [], "checks": []}
    previous = None
    for k in range(STEPS):
        if trainer is not None:
            trainer.step(k)
        rec["pushes"].append(_push_record(sync, lambda: sync.push(local, into=engine), k > 0, planned))
        if trainer is not None:
            full = trainer.full()
            if rank == TRAINER[0]:
                torch.save(full, workdir / f"disjoint{k}.pt")
        torch.distributed.barrier()
        if engine is not None:
            full = torch.load(workdir / f"disjoint{k}.pt")
            rec["checks"].append(check_engine(rank, ENGINE, engine, full, engine_group, previous=previous))
            previous = full
    rec["in_place"] = all(t.data_ptr() == ptrs[n] for n, t in (engine or {}).items())
    return rec, (sync, local, engine, trainer, tg)


def phase_colocated(rank: int, workdir: Path, mesh, colo_group, planned) -> dict:
    from reshard.execute.sources import fsdp2_sources
    from reshard.execute.sync import WeightSync

    if rank not in COLO:
        return {"skipped": True}
    trainer = Trainer(COLO, mesh, seed=2)
    maps, local = fsdp2_sources(trainer.model)
    shapes = {n: tuple(p.shape) for n, p in trainer.model.named_parameters()}
    tg = targets(shapes, 4, COLO)
    engine = engine_tensors(tg, rank)
    calls = planned[0]
    sync = WeightSync(maps, tg, torch.bfloat16, group=colo_group)
    rec: dict = {"construct_planner_calls": planned[0] - calls, "pushes": [], "checks": []}
    previous = None
    for k in range(STEPS):
        trainer.step(k)
        rec["pushes"].append(_push_record(sync, lambda: sync.push(local, into=engine), k > 0, planned))
        full = trainer.full()
        rec["checks"].append(check_engine(rank, COLO, engine, full, colo_group, previous=previous))
        previous = full
    return rec


def _raises(fn) -> dict:
    t = time.perf_counter()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the type is the result
        return {"raised": type(e).__name__, "message": str(e), "seconds": time.perf_counter() - t}
    return {"raised": None, "seconds": time.perf_counter() - t}


def phase_refusal(rank: int, workdir: Path, state, engine_group) -> dict:
    sync, local, engine, trainer, tg = state
    q = "model.layers.1.self_attn.q_proj.weight"
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    bad_dtype = {**local, q: local[q].to(torch.bfloat16)} if rank == 1 else local
    rec = {"dtype": _raises(lambda: sync.push(bad_dtype, into=engine))}
    bad_shape = engine
    if rank == 5:
        t = engine[qkv]
        bad_shape = {**engine, qkv: torch.empty(t.shape[0] + 1, t.shape[1], dtype=t.dtype)}
    rec["shape"] = _raises(lambda: sync.push(local, into=bad_shape))
    rec["after"] = _raises(lambda: sync.push(local, into=engine))
    rec.update(_bounded_and_disagreeing(rank, local, engine, tg))
    if trainer is not None:
        full = trainer.full()
        if rank == TRAINER[0]:
            torch.save(full, workdir / "refusal.pt")
    torch.distributed.barrier()
    if engine is not None:
        rec["check"] = check_engine(rank, ENGINE, engine, torch.load(workdir / "refusal.pt"), engine_group)
    return rec


def _bounded_and_disagreeing(rank: int, local, engine, tg) -> dict:
    """A sync whose rounds are bounded (4 KiB in flight per rank) fills a second copy of the engine
    with the same bits; a sync for which rank 3 holds other target maps is refused everywhere."""
    from reshard.execute.sync import WeightSync

    maps, shapes = source_maps(TRAINER)
    bounded = WeightSync(maps, tg, torch.bfloat16, max_inflight_bytes=4096)
    copy = engine_tensors(tg, rank) if engine is not None else None
    bounded.push(local, into=copy)
    same = all(torch.equal(_bits(copy[n].detach()), _bits(t.detach())) for n, t in (engine or {}).items())
    other = targets(shapes, 2, ENGINE[::-1]) if rank == 3 else tg
    return {"bounded_same": same, "bounded_rounds": bounded.stats["rounds"],
            "bounded_staging": bounded.stats["staging_bytes"],
            "disagree": _raises(lambda: WeightSync(maps, other, torch.bfloat16))}


def phase_kill(rank: int, state) -> dict:
    """Rank ``VICTIM`` dies (SIGKILL) right after it has posted the first send of a push."""
    from reshard.execute import live

    sync, local, engine, trainer, _ = state
    if trainer is not None:
        trainer.step(STEPS)
    if rank == VICTIM:
        real = live._Wire.send

        def dying(self, buf, peer):
            real(self, buf, peer)
            time.sleep(0.05)  # let the bytes leave
            os.kill(os.getpid(), signal.SIGKILL)

        live._Wire.send = dying
    rec = _raises(lambda: sync.push(local, into=engine))
    rec["again"] = _raises(lambda: sync.push(local, into=engine))  # refused at once, no collective
    return rec


def worker(rank: int, workdir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from reshard.plan import planner

    torch.set_num_threads(1)
    # the world's own timeout is long (phases are unbalanced on a small machine); the syncs run
    # on groups with a short one, which bounds how long a dead peer can keep a rank waiting
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=WORLD_TIMEOUT_S))
    planned = [0]
    real = planner.Planner.plan

    def counting(self, *args, **kw):  # every parameter any rank plans goes through here
        planned[0] += 1
        return real(self, *args, **kw)

    planner.Planner.plan = counting
    short = timedelta(seconds=PG_TIMEOUT_S)
    sync_group = dist.new_group(list(range(WORLD)), timeout=short)
    engine_group, colo_group = dist.new_group(ENGINE), dist.new_group(COLO, timeout=short)
    mesh_a, mesh_b = DeviceMesh("cpu", torch.tensor(TRAINER)), DeviceMesh("cpu", torch.tensor(COLO))
    out = Path(workdir)
    with open(out / f"rank{rank}.jsonl", "w") as log:
        def write(name, fn):
            try:
                rec = fn()
            except Exception:  # noqa: BLE001 - reported to the parent, which fails the test
                rec = {"crashed": traceback.format_exc()}
            log.write(json.dumps({"phase": name, **rec}) + "\n")
            log.flush()
            return rec

        state = []
        write("disjoint", lambda: _keep(state, phase_disjoint(rank, out, mesh_a, sync_group, engine_group, planned)))
        write("colocated", lambda: phase_colocated(rank, out, mesh_b, colo_group, planned))
        if state:
            dist.barrier()
            write("refusal", lambda: phase_refusal(rank, out, state[0], engine_group))
            dist.barrier()
            write("kill", lambda: phase_kill(rank, state[0]))
    os._exit(0)  # the group is broken after the kill phase: no destroy_process_group


def _keep(state: list, result: tuple) -> dict:
    rec, kept = result
    state.append(kept)
    return rec
