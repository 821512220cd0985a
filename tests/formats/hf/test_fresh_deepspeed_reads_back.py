"""A DeepSpeed checkpoint reshard writes from a source without one (an HF folder, a DCP checkpoint)
is a source reshard reads again: its fresh model-state files leave out ``global_samples`` (the
source records no batch size; DeepSpeed's loader derives it), which the reader must accept, and
converting it back gives the source's tensors bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from reshard import convert, reshard
from tests.support.paths import HF


@pytest.mark.parametrize("stage", [1, 3])
def test_hf_to_deepspeed_and_back(tmp_path: Path, stage: int) -> None:
    src = HF / "pretrained_llama"
    ds = reshard(src, tmp_path / "ds", dp=2, zero_stage=stage).out_dir
    back = convert(ds.parent, tmp_path / "back", fmt="safetensors").out_dir
    want, got = load_file(str(src / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert set(got) == set(want)
    for name, w in want.items():
        assert got[name].dtype == w.dtype and torch.equal(got[name], w), name
