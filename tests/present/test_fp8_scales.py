"""``reshard inspect`` and ``reshard plan`` on an FP8 block-scale folder (the committed transformers
fixture, 16 x 32 blocks): each payload's ``weight_scale_inv`` is shown beside it with the map
``ir.blocks.coarsen`` derives from the payload's map, here and at a planned TP, where a block a TP
boundary cuts is held by every rank it touches; the plan moves the scale entries exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from reshard import apply_plan
from reshard.cli import main as cli
from reshard.ir import block_grid, coarsen
from reshard.plan.retarget import plan_topology
from reshard.present.inspected import hf_plan_targets, open_source

FP8 = Path(__file__).resolve().parents[1] / "fixtures" / "hf" / "fp8_qwen2"
O_PROJ = "model.layers.0.self_attn.o_proj.weight"


def _run(capsys: pytest.CaptureFixture[str], *argv: object) -> str:
    assert cli([str(a) for a in argv]) == 0
    return capsys.readouterr().out


def test_inspect_lists_each_scale_after_its_payload(capsys: pytest.CaptureFixture[str]) -> None:
    lines = [x.split() for x in _run(capsys, "inspect", FP8).splitlines()]
    names = [x[0] for x in lines if x and x[0].startswith(("model.", "lm_head"))]
    scales = [n for n in names if n.endswith(".weight_scale_inv")]
    assert len(scales) == 14
    for s in scales:  # right after its payload, its F the payload's block grid
        payload = s.replace("_scale_inv", "")
        assert names[names.index(s) - 1] == payload
        rows = {x[0]: x for x in lines if x and x[0] in (s, payload)}
        shape = tuple(json.loads(rows[payload][1] + rows[payload][2]))
        assert json.loads(rows[s][1] + rows[s][2]) == list(block_grid(shape, (16, 32)))


@pytest.mark.parametrize("tp", [2, 4])
def test_plan_coarsens_the_scales_and_moves_them_exactly(tp: int, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    src = open_source(FP8)
    given = hf_plan_targets(src, tp)
    assert given is not None
    tplan = plan_topology(src.maps, tp, given=given)
    raw = load_file(FP8 / "model.safetensors")
    for scale, (payload, block) in src.scales.items():
        target = tplan.target_maps[scale]
        assert target == coarsen(tplan.target_maps[payload], block)
        out = apply_plan(tplan.plan.params[scale], {0: raw[scale]})
        for r in target.ranks:
            assert torch.equal(out[r], target.extract(raw[scale], r)), (scale, r)
    # o_proj [64, 64] row-wise at TP 4: 16 columns a rank, so each 32-column block on 2 ranks
    held = {len(p.locations) for s in tplan.target_maps[O_PROJ.replace("weight", "weight_scale_inv")].shards.values()
            for p in s.pieces}
    assert held == ({1} if tp == 2 else {2})
    text = _run(capsys, "plan", FP8, "--tp", tp)
    assert ("no TP boundary cuts a block" in text) == (tp == 2)
    assert ("6 cut by a TP boundary" in text) == (tp == 4)


def test_inspect_png_draws_the_scales_beside_the_payload(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    from reshard.present.viz import AXES_RECT, MAP_PNG_SIZE, rank_colors

    out = tmp_path / "o.png"
    assert f"wrote {out}" in _run(capsys, "inspect", FP8, "--param", O_PROJ, "--png", out)
    img = imread(out)[..., :3]
    assert img.shape[:2] == (MAP_PNG_SIZE[1], MAP_PNG_SIZE[0])
    colour = rank_colors([0])[0]
    left, bottom, width, height = AXES_RECT
    for x in (left + width * 0.3, left + width * 0.83):  # the payload's panel, the scales' panel
        px = img[int((1 - bottom - height / 4) * MAP_PNG_SIZE[1]), int(x * MAP_PNG_SIZE[0])]  # off the label
        assert max(abs(float(px[k]) - colour[k]) for k in range(3)) < 0.02, x
