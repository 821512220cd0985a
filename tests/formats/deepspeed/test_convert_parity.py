"""Parity with DeepSpeed's own converter: for every fixture ``ds_to_universal`` converts,
reshard's universal checkpoint holds bit-identical tensors under the same keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from reshard.jobs.convert import convert
from reshard.storage.safe_load import load
from tests.support.compare import same as _same
from tests.support.dsconv import FIXTURES, ds_to_universal

pytest.importorskip("deepspeed")

CONVERTIBLE = ["llama_zero1_dp2", "llama_zero2_dp2", "llama_zero3_dp2", "llama_zero1_dp2_bf16", "llama_zero3_dp2_bf16",
               "llama_tp2", "qwen2_tp2", "llama_tp2_dp2", "pipe_pp2_dp2", "pipe_pp2_dp2_bf16_odd"]


@pytest.mark.parametrize("name", CONVERTIBLE)
def test_bit_identical_to_ds_to_universal(name, tmp_path: Path):
    theirs = ds_to_universal(name, tmp_path / "ds")
    ours = convert(FIXTURES / name, tmp_path / "reshard").out_dir
    their_files = sorted(p.relative_to(theirs).as_posix() for p in theirs.rglob("*.pt"))
    our_files = sorted(p.relative_to(ours).as_posix() for p in ours.rglob("*.pt"))
    assert our_files == their_files
    for rel in their_files:
        if rel.startswith("mp_rank") or "model_states" in rel:
            assert (ours / rel).read_bytes() == (theirs / rel).read_bytes(), rel
            continue
        _same(load(ours / rel), load(theirs / rel), rel)
    assert (tmp_path / "reshard" / "latest_universal").read_text() == (tmp_path / "ds" / "latest_universal").read_text()
