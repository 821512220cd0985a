"""Real FSDP2 jobs (torchrun, gloo, CPU) load what reshard writes with their ordinary ``dcp.load``:

* a DeepSpeed checkpoint converted to DCP, at world size 3 (a size neither side used): weights and
  Adam moments equal DeepSpeed's own universal tensors, and the loss of the first step equals the
  loss of a DeepSpeed job resumed from the same checkpoint to the last bit: both compute the same
  two batch rows with the same fp32 weights on one process (the FSDP job's global batch is 6 rows,
  rank ``d`` rows ``[2d, 2d + 2)``; the DeepSpeed job's is 8 rows over DP=4, same rows per rank, the
  same fixed draw). Later steps differ by reduction order (3 ranks against 4), so are not compared;
* the FSDP x TP fixture laid out for 4 loading ranks (``reshard reshard --files 4``) at world
  size 4: the same state and the same next losses, bit for bit, as loading the original.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from reshard import convert
from reshard.formats.dcp.checkpoint import DcpCheckpoint
from reshard.jobs.convert import reshard as reshard_dcp_files
from reshard.storage.safe_load import load
from tests.support.dcp_jobs import FIXTURES, run_fsdp_job
from tests.support.dsconv import tag_dir

pytestmark = pytest.mark.e2e


@pytest.mark.slow  # a 3-rank FSDP2 job and the 4-rank DeepSpeed job of tests/e2e/plan.py
def test_deepspeed_to_dcp_loads_in_fsdp2_at_world_size_3(e2e, tmp_path: Path) -> None:
    out = convert(tag_dir("llama_zero1_dp2"), tmp_path / "dcp", fmt="dcp").out_dir
    rep = run_fsdp_job("load", 3, out, steps=2, batch_dp=3)
    ucp = e2e.ds_ucp("llama_zero1_dp2")
    ucp = ucp / (ucp / "latest_universal").read_text().strip() / "zero"
    assert rep["local_batch_rows"] == 2 and rep["adam_step"] == 3.0
    for name, got in rep["tensors"].items():
        for kind, state in (("param", "fp32"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
            want = load(ucp / name / f"{state}.pt")["param"]
            assert torch.equal(got[kind], want), (name, state)
    assert len(rep["tensors"]) == len(DcpCheckpoint.open(out).params)
    group = rep["param_groups"][0]
    assert group["lr"] == 0.001 and group["weight_decay"] == 0.01
    ds = e2e.report("ds_to_universal", "llama_zero1_dp2", tp=1, dp=4)
    assert ds["losses_per_dp_rank"]["0"][0] == rep["losses_rank0"][0]


def test_fsdp_tp_laid_out_for_4_ranks_resumes_like_the_original(tmp_path: Path) -> None:
    src = FIXTURES / "llama_fsdp_tp_2x2"
    out = reshard_dcp_files(src, tmp_path / "out", files=4).out_dir
    assert sorted(p.name for p in out.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    ours = run_fsdp_job("load", 4, out, steps=2)
    theirs = run_fsdp_job("load", 4, src, steps=2)
    assert ours["losses"] == theirs["losses"] and ours["losses_rank0"] == theirs["losses_rank0"]
    assert ours["adam_step"] == theirs["adam_step"] == 3.0
    for name, kinds in theirs["tensors"].items():
        for kind, t in kinds.items():
            assert torch.equal(ours["tensors"][name][kind], t), (name, kind)
