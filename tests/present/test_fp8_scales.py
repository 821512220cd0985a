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


@pytest.fixture(scope="module")
def kept(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The FP8 fixture kept quantized in a DCP of 2 files (``--quantize keep``: payload and scale entries)."""
    from reshard.jobs.convert import reshard

    out = tmp_path_factory.mktemp("kept")
    reshard(FP8, out / "two", to="dcp", files=2, quantize="keep")
    reshard(FP8, out / "three", to="dcp", files=3, quantize="keep")
    return out


def test_inspect_a_kept_dcp_lists_each_scale_entry_after_its_payload(kept: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Each ``weight_scale_inv`` entry right after its payload's, with its own chunks (dim 0 over the 2
    storage ranks), paired with it (``Inspected.scales``), and said so."""
    src = open_source(kept / "two" / "fp8_qwen2")
    assert len(src.scales) == 14
    for scale, (payload, block) in src.scales.items():
        assert scale == payload + "_scale_inv" and block == (16, 32)
        assert sorted(src.maps[scale].ranks) == [0, 1] or src.maps[scale].logical_shape[0] == 1
    text = _run(capsys, "inspect", kept / "two" / "fp8_qwen2")
    assert "block scales: 14 tensors, each listed after its payload (entries of their own" in text
    names = [x.split()[0] for x in text.splitlines() if x.startswith("model.")]
    for scale, (payload, _) in src.scales.items():
        assert names[names.index(scale) - 1] == payload


def test_inspect_png_of_a_kept_dcp_draws_the_scale_entry_beside_the_payload(kept: Path, tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    from reshard.present.viz import AXES_RECT, MAP_PNG_SIZE, rank_colors

    out, key = tmp_path / "o.png", "model." + O_PROJ
    assert f"wrote {out}" in _run(capsys, "inspect", kept / "two" / "fp8_qwen2", "--param", key, "--png", out)
    img = imread(out)[..., :3]
    colours = rank_colors([0, 1])
    left, bottom, width, height = AXES_RECT
    for x in (left + width * 0.3, left + width * 0.83):  # the payload's panel, the scales' panel
        for y, rank in ((bottom + height * 7 / 8, 0), (bottom + height / 8, 1)):  # row 0 at the top: rank 0's
            px = img[int((1 - y) * MAP_PNG_SIZE[1]), int(x * MAP_PNG_SIZE[0])]
            assert max(abs(float(px[k]) - colours[rank][k]) for k in range(3)) < 0.02, (x, y)


def test_plan_between_kept_dcps_moves_the_scale_entries_beside_their_payloads(
        kept: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = _run(capsys, "plan", kept / "two" / "fp8_qwen2", "--to", kept / "three" / "fp8_qwen2")
    assert "block scales: 14 tensors planned beside their payloads, as stored" in text
