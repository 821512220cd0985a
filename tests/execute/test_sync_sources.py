"""Sources of a weight sync (``reshard.execute.sources``) against what the trainers hold: DTensor
placements against ``torch.chunk``, ZeRO-3 partitions against DeepSpeed's padding, and checkpoints
on disk (the reader's maps and fragments) pushed into a vLLM-style engine."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import reshard
from reshard.errors import MapError
from reshard.execute.sources import dtensor_map, reader_sources, zero3_shard, zero3_sources
from reshard.execute.sync_program import simulate
from reshard.layouts.arch import LLAMA_VLLM, inference_targets
from reshard.layouts.inference import engine_shapes
from tests.support.paths import REPO
from tests.support.vllm_ref import engine_slices

FIXTURES = REPO / "tests" / "fixtures"


def _local(full: torch.Tensor, dims: list[int], placements, coord) -> torch.Tensor:
    """What DTensor gives a mesh coordinate: each Shard(d), in mesh-dim order, chunks the current
    local tensor along d (``torch.chunk``; missing chunks are empty)."""
    t = full
    for k, pl in enumerate(placements):
        if isinstance(pl, Shard):
            chunks = t.chunk(dims[k], dim=pl.dim)
            t = chunks[coord[k]] if coord[k] < len(chunks) else t.narrow(pl.dim, 0, 0)
    return t


@pytest.mark.parametrize("shape,mesh,placements", [
    ((101, 3), [0, 1, 2, 3], [Shard(0)]),
    ((7, 10), [3, 1, 0], [Shard(1)]),
    ((2, 5), [0, 1, 2, 3], [Shard(0)]),  # ranks 2 and 3 hold nothing
    ((9, 4), [[0, 1], [2, 3]], [Replicate(), Shard(0)]),  # HSDP: replicated over the outer dim
    ((13, 6), [[0, 1], [2, 3]], [Shard(0), Shard(0)]),  # nested shards of one dim
    ((8, 6), [[4, 5, 6], [7, 8, 9]], [Shard(1), Shard(0)]),
])
def test_dtensor_map_matches_torch_chunk(shape, mesh, placements):
    full = torch.randn(shape)
    m = dtensor_map(shape, mesh, placements)
    m.check()
    grid = torch.tensor(mesh)
    dims = list(grid.shape)
    for coord in itertools.product(*(range(n) for n in dims)):
        rank = int(grid[coord])
        assert torch.equal(m.extract(full, rank), _local(full, dims, placements, coord)), coord


def test_dtensor_map_refuses_a_pending_reduction():
    with pytest.raises(MapError, match="Partial"):
        dtensor_map((4,), [0, 1], [Partial()], name="w")


def test_zero3_sources_cut_deepspeed_partitions_without_their_padding():
    shapes = {"a": (5, 3), "b": (7,)}
    maps = zero3_sources(shapes, 4, ranks=[10, 11, 12, 13])
    for name, shape in shapes.items():
        full = torch.randn(shape)
        numel = full.numel()
        part = -(-numel // 4)
        padded = torch.cat([full.reshape(-1), torch.zeros(part * 4 - numel)])  # DeepSpeed's ds_tensor per rank
        for d in range(4):
            shard = zero3_shard(padded[d * part:(d + 1) * part], shape, 4, d)
            if 10 + d in maps[name].shards:
                assert torch.equal(shard, maps[name].extract(full, 10 + d))
            else:
                assert shard.numel() == 0
    with pytest.raises(MapError, match="has 4"):
        zero3_shard(torch.zeros(3), (5, 3), 4, 0)


def _fleet_from_checkpoint(path: Path, readers: list[int], engine: list[int]) -> None:
    """Every storage rank of the checkpoint read by a live rank; the engine filled by one push;
    compared bit for bit with vLLM's slicing of the checkpoint's own full tensors cast to bf16."""
    from transformers import LlamaConfig

    reader = reshard.open(str(path))
    cfg = LlamaConfig.from_pretrained(str(next(path.rglob("config.json")).parent))
    shards, maps = {}, None
    for live in readers:
        maps, shards[live] = reader_sources(reader, live, ranks=readers)
    full = {n: m.rebuild({r: shards[r][n] for r in m.ranks}) for n, m in maps.items()}
    shapes = {n: tuple(m.valid_shape) for n, m in maps.items()}
    tg = inference_targets(LLAMA_VLLM, shapes, tp=len(engine), num_heads=cfg.num_attention_heads,
                           num_kv_heads=cfg.num_key_value_heads, ranks=engine)
    into = {r: {n: torch.full(s, 9.0, dtype=torch.bfloat16) for n, s in engine_shapes(tg, r).items()} for r in engine}
    simulate(maps, tg, torch.bfloat16, shards, into)
    for i, r in enumerate(engine):
        want = engine_slices({n: t.to(torch.bfloat16) for n, t in full.items()}, cfg, len(engine), i)
        for n, t in want.items():
            assert torch.equal(into[r][n].view(torch.int16), t.view(torch.int16)), (n, r)


def test_an_engine_filled_from_a_zero3_checkpoint_on_disk():
    """HF Trainer + DeepSpeed ZeRO-3 (world 2, fp32 masters) into TP=2 on two other ranks."""
    _fleet_from_checkpoint(FIXTURES / "hf" / "trainer_llama_zero3" / "checkpoint-3", [0, 1], [2, 3])


def test_an_engine_filled_from_safetensors_on_disk():
    """One ``model.safetensors`` read by rank 0 into TP=2 on ranks 0 and 1 (rank 0 also serves)."""
    _fleet_from_checkpoint(FIXTURES / "hf" / "pretrained_llama", [0], [0, 1])
