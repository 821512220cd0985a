"""``layouts.inference.scale_placed``: a fused engine tensor's block scales, each part's coarsened map
at its block row ``⌈offset/bm⌉`` (vLLM's ``BlockQuantScaleParameter`` loaders); the parts' scales tile
the engine's scale tensor, and a part starting inside a block row is refused."""

from __future__ import annotations

import pytest
import torch

from reshard.errors import MapError
from reshard.ir import block_grid
from reshard.ir.codec import scale_grid
from reshard.layouts.inference import check_placed, merged_column_parts, scale_placed


@pytest.mark.parametrize(("gate", "up", "tp", "block"), [(64, 32, 2, (16, 8)), (48, 48, 1, (16, 16)),
                                                         (64, 40, 1, (16, 8))])  # the last part may end mid-block
def test_fused_scales_tile_the_engine_scale_tensor(gate: int, up: int, tp: int, block: tuple[int, int]) -> None:
    parts = merged_column_parts([(gate, 24), (up, 24)], tp)
    scales = [scale_placed(p, block) for p in parts]
    check_placed({f"p{i}": s for i, s in enumerate(scales)})  # no scale entry twice, none missing
    s = {n: torch.arange(float(torch.Size(scale_grid((rows, 24), block)).numel())).reshape(scale_grid((rows, 24), block))
         for n, rows in (("gate", gate), ("up", up))}
    for r in range(tp):
        engine = torch.empty(block_grid(tuple(parts[0].shapes[r]), block)).reshape(-1)
        for sp, full in zip(scales, s.values()):
            shard = sp.map.extract(full, r).reshape(-1)
            engine[sp.offsets[r]:sp.offsets[r] + shard.numel()] = shard
        # vLLM: part k's ⌈rows_k/bm⌉ scale rows, the rank's slice of its scales, one after another
        want = torch.cat([full.chunk(tp)[r] for full in s.values()])
        assert torch.equal(engine.reshape(want.shape), want)


def test_part_inside_a_block_row_refused() -> None:
    parts = merged_column_parts([(40, 24), (32, 24)], 1)  # up starts at row 40, inside the 32-row block 1
    with pytest.raises(MapError, match="starts at row 40, inside a block of 32 rows"):
        scale_placed(parts[1], (32, 8))
