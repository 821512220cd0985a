"""The processes of ``tests/execute/test_sync_fp8.py``: one gloo job (its sizes in ``workdir/job.json``)
of FSDP2 trainer ranks (``fully_shard`` on a tiny HF-named model: dim-0 shards whose boundaries cut
blocks) and TP engine ranks (plain torch tensors: column- and row-parallel FP8 payloads, their
``weight_scale_inv``, bf16 for what is not quantized), the sync over the world.

Phases, each rank writing one JSON line per phase:

* **float32** -- ``WeightSync(..., quantize=Fp8Block(block))`` (the offline choice of weights, by
  name), one push; trainer rank 0 saves the full masters, each engine rank its tensors, to ``workdir``.
* **ue8m0** -- a second sync with UE8M0 scales and a predicate that also quantizes ``lm_head``.
* **colocated** -- the engine on trainer ranks 0 and 1 themselves (part of each cover is local).
* **nan** -- a NaN planted in trainer rank 1's shard of ``down_proj``: every rank raises the same
  ``QuantizedError``, the engine's tensors keep the float32 phase's bits; then a good push.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch

PG_TIMEOUT_S = 60


def sizes(workdir: Path) -> dict:
    return json.loads((workdir / "job.json").read_text())


class Tiny(torch.nn.Module):
    """HF names, no transformers: an embedding, one layer's ``o_proj`` (with a bias) and MLP, a
    norm, a head."""

    def __init__(self, hidden: int, inter: int, vocab: int) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(vocab, hidden)
        layer = torch.nn.Module()
        layer.self_attn, layer.mlp = torch.nn.Module(), torch.nn.Module()
        layer.self_attn.o_proj = torch.nn.Linear(hidden, hidden)
        layer.mlp.up_proj = torch.nn.Linear(hidden, inter, bias=False)
        layer.mlp.down_proj = torch.nn.Linear(inter, hidden, bias=False)
        self.model.layers = torch.nn.ModuleList([layer])
        self.model.norm = torch.nn.Module()
        self.model.norm.weight = torch.nn.Parameter(torch.ones(hidden))
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)


def full_model(cfg: dict) -> Tiny:
    """The masters every trainer rank starts from: seeded, each row scaled by its own factor so
    that blocks' largest magnitudes differ (a straddling block's may lie on either side)."""
    torch.manual_seed(cfg["seed"])
    m = Tiny(cfg["hidden"], cfg["inter"], cfg["vocab"])
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(torch.rand(p.shape[0], *([1] * (p.dim() - 1))) * 4)
    return m


def targets(cfg: dict) -> dict:
    """The engine's layout: column-parallel ``up_proj``/``embed``/``lm_head``, row-parallel
    ``o_proj``/``down_proj``, replicated norm and bias."""
    from reshard.layouts.inference import column_parallel, row_parallel
    from reshard.layouts.tp import replicated

    eng, tp = cfg["engine"], len(cfg["engine"])
    h, i, v = cfg["hidden"], cfg["inter"], cfg["vocab"]
    return {"model.embed_tokens.weight": column_parallel((v, h), tp, ranks=eng),
            "model.layers.0.self_attn.o_proj.weight": row_parallel((h, h), tp, ranks=eng),
            "model.layers.0.self_attn.o_proj.bias": row_parallel((h,), tp, ranks=eng),
            "model.layers.0.mlp.up_proj.weight": column_parallel((i, h), tp, ranks=eng),
            "model.layers.0.mlp.down_proj.weight": row_parallel((h, i), tp, ranks=eng),
            "model.norm.weight": replicated((h,), eng),
            "lm_head.weight": column_parallel((v, h), tp, ranks=eng)}


def engine_tensors(cfg: dict, tg: dict, quant: set[str], scale: torch.dtype, rank: int) -> dict[str, torch.Tensor]:
    """This engine rank's tensors, garbage-filled: FP8 payloads and scales for ``quant``, bf16 else."""
    from reshard.ir.blocks import coarsen

    out = {}
    for n, m in tg.items():
        shape = m.shards[rank].shape
        if n in quant:
            out[n] = torch.full(shape, 3.0).to(torch.float8_e4m3fn)
            out[n + "_scale_inv"] = torch.full(coarsen(m, cfg["block"]).shards[rank].shape, 8.0).to(scale)
        else:
            out[n] = torch.full(shape, 3.0, dtype=torch.bfloat16)
    return out


def _raises(fn) -> dict:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the type is the result
        return {"raised": type(e).__name__, "message": str(e)}
    return {"raised": None}


def _save(rank: int, cfg: dict, workdir: Path, tag: str, local, engine, model) -> None:
    if model is not None and rank == cfg["trainer"][0]:
        torch.save({n: p.full_tensor().detach() for n, p in model.named_parameters()}, workdir / f"full-{tag}.pt")
    elif model is not None:
        for p in model.parameters():  # full_tensor is collective over the trainer's mesh
            p.full_tensor()
    if engine is not None:
        torch.save(engine, workdir / f"engine-{tag}-{rank}.pt")


def run(rank: int, workdir: Path, cfg: dict, mesh) -> dict:
    from torch.distributed.fsdp import fully_shard

    from reshard import Fp8Block, WeightSync
    from reshard.errors import QuantizedError
    from reshard.execute.sources import fsdp2_sources

    cfg["block"] = tuple(cfg["block"])
    model, local = None, {}
    if rank in cfg["trainer"]:
        model = full_model(cfg)
        fully_shard(model, mesh=mesh)
        maps, local = fsdp2_sources(model)
    else:
        from reshard.execute.sources import dtensor_map

        with torch.device("meta"):
            shapes = {n: tuple(p.shape) for n, p in Tiny(cfg["hidden"], cfg["inter"], cfg["vocab"]).named_parameters()}
        from torch.distributed.tensor import Shard

        maps = {n: dtensor_map(s, cfg["trainer"], [Shard(0)], name=n) for n, s in shapes.items()}
    tg = targets(cfg)
    engine_rank = rank in cfg["engine"]
    recs: dict = {}

    fp8 = Fp8Block(cfg["block"], "float32")
    sync = WeightSync(maps, tg, torch.bfloat16, quantize=fp8)
    quant = set(sync._quant)
    engine = engine_tensors(cfg, tg, quant, torch.float32, rank) if engine_rank else None
    sync.push(local, into=engine)
    recs["float32"] = {"quantized": sorted(quant), "stats": dict(sync.stats)}
    _save(rank, cfg, workdir, "float32", local, engine, model)

    heads = Fp8Block(cfg["block"], "ue8m0", weights=lambda n, s: n.endswith(("proj.weight", "lm_head.weight")))
    sync2 = WeightSync(maps, tg, torch.bfloat16, quantize=heads)
    quant2 = set(sync2._quant)
    engine2 = engine_tensors(cfg, tg, quant2, torch.float8_e8m0fnu, rank) if engine_rank else None
    sync2.push(local, into=engine2)
    recs["ue8m0"] = {"quantized": sorted(quant2), "stats": dict(sync2.stats)}
    _save(rank, cfg, workdir, "ue8m0", local, engine2, model)

    down = "model.layers.0.mlp.down_proj.weight"
    bad = local
    if rank == cfg["trainer"][-1]:
        bad = {**local, down: local[down].clone()}
        bad[down][-1, 20] = float("nan")  # in block column 1, which both engine ranks' shards touch
    before = {n: t.clone() for n, t in (engine or {}).items()}
    got = _raises(lambda: sync.push(bad, into=engine))
    # the bf16 tensors get this step's (unchanged) values, the FP8 ones keep theirs: all keep their bits
    got["kept"] = all(torch.equal(t.view(torch.uint8), before[n].view(torch.uint8)) for n, t in (engine or {}).items())
    got["after"] = _raises(lambda: sync.push(local, into=engine))
    got["is_quantized_error"] = got["raised"] == QuantizedError.__name__
    recs["nan"] = got

    # colocated: the engine on the trainer's own ranks (a cover partly local: cast-copied, not sent)
    colo = {**cfg, "engine": cfg["trainer"][:2]}
    tg3 = targets(colo)
    sync3 = WeightSync(maps, tg3, torch.bfloat16, quantize=fp8)
    engine3 = engine_tensors(colo, tg3, set(sync3._quant), torch.float32, rank) if rank in colo["engine"] else None
    sync3.push(local, into=engine3)
    recs["colocated"] = {"quantized": sorted(sync3._quant), "stats": dict(sync3.stats)}
    _save(rank, colo, workdir, "colocated", local, engine3, model)
    return recs


def worker(rank: int, workdir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    torch.set_num_threads(1)
    out = Path(workdir)
    cfg = sizes(out)
    world = len(cfg["trainer"]) + len(cfg["engine"])
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world,
                            timeout=timedelta(seconds=PG_TIMEOUT_S))
    mesh = DeviceMesh("cpu", torch.tensor(cfg["trainer"]))
    with open(out / f"rank{rank}.jsonl", "w") as log:
        try:
            t0 = time.perf_counter()
            recs = run(rank, out, cfg, mesh)
            recs["float32"]["seconds"] = time.perf_counter() - t0
            for name, rec in recs.items():
                log.write(json.dumps({"phase": name, **rec}) + "\n")
        except Exception:  # noqa: BLE001 - reported to the parent, which fails the test
            log.write(json.dumps({"phase": "crashed", "trace": traceback.format_exc()}) + "\n")
        log.flush()
    dist.destroy_process_group()
    os._exit(0)
