"""A fresh DeepSpeed job's files carry the source's gradient clipping: DeepSpeed 0.19.8's ZeRO-1/2
loader takes ``clip_grad`` from the optimizer file over the resuming job's ``gradient_clipping``
(``_load_global_state``), so a 0.0 written where the source records 1.0 turns clipping off."""

from __future__ import annotations

from pathlib import Path

import pytest

from reshard.jobs.convert import reshard
from reshard.storage.safe_load import load
from tests.support.dsconv import ds_to_universal_folder
from tests.support.paths import DCP, DEEPSPEED, MEGATRON


def _clips(out: Path) -> set[float]:
    files = sorted(out.rglob("*optim_states.pt"))
    assert files
    return {load(f)["optimizer_state_dict"]["clip_grad"] for f in files}


def test_a_universal_source_keeps_its_clip_grad(tmp_path):
    pytest.importorskip("deepspeed")  # its ds_to_universal makes the source
    ucp = ds_to_universal_folder(DEEPSPEED / "llama_zero1_dp2", tmp_path / "ucp")
    report = reshard(ucp.parent, tmp_path / "out", to="deepspeed", dp=2, zero_stage=1)
    assert _clips(tmp_path / "out") == {1.0}  # the fixture's gradient_clipping
    assert not any("clip_grad" in n for n in report.notes)


def test_a_source_without_clipping_writes_zero_and_says_what_deepspeed_does_with_it(tmp_path):
    src = DCP / "llama_fsdp2_ws2"
    report = reshard(src, tmp_path / "out", to="deepspeed", dp=2, zero_stage=1)
    assert _clips(tmp_path / "out") == {0.0}
    assert any("clip_grad 0.0" in n and "gradient_clipping" in n for n in report.notes)


def test_a_megatron_source_keeps_its_clip_grad(tmp_path):
    """Megatron records ``--clip-grad`` in its args (1.0 for the fixtures)."""
    report = reshard(MEGATRON / "torch_dist_tp2_dp2_distopt", tmp_path / "out", to="deepspeed", dp=2, zero_stage=1)
    assert _clips(tmp_path / "out") == {1.0}
    assert not any("clip_grad" in n for n in report.notes)
