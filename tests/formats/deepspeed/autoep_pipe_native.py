"""DeepSpeed's own pipeline job for the ``mixtral_autoep_ep2_pp2`` recipe (``scripts/_fixture_autoep_pipe.py``) at
another topology: ``pipeline_stages`` ``pp`` over ``world`` CPU ranks, EP ``ep``; it trains ``steps`` steps (from a
fresh start, or after loading ``load_dir`` natively and digesting every stage's parameters into ``digests.json``) and
saves into ``work/native``. Used by the AutoEP-under-PP writer's tests as the reference of what DeepSpeed writes."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from tests.support.dsconv import FIXTURES

NAME = "mixtral_autoep_ep2_pp2"


def run(work: Path, *, pp: int, world: int, ep: int, steps: int, load_dir: Path | None = None,
        tag: str | None = None) -> dict:
    """Launch the job; returns ``{"native": save folder, "digests": ...}`` (digests only with ``load_dir``)."""
    from tests.e2e.launch import REPO, launch

    fx = json.loads((FIXTURES / NAME / "fixture.json").read_text())
    cfg = copy.deepcopy(fx["ds_config"])
    cfg["expert_parallel"]["autoep_size"] = ep
    # the fixture's global batch (micro 2 x accumulation 2 x DP 2) kept: accumulation x DP = 4
    cfg["gradient_accumulation_steps"] = max(1, 4 // (world // pp))
    spec = {"model_type": fx["model_type"], "model_config": dict(fx["model_config"], pipeline_stages=pp),
            "ds_config": cfg, "steps": steps, "seed": fx["seed"], "seq_len": fx["data"]["seq_len"],
            "micro_batch": fx["data"]["micro_batch"], "save_dir": str(work / "native"),
            "tag": tag or fx["tag"], "report_dir": str(work / "report"), "patches": fx["patches"]}
    if load_dir is not None:
        spec.update(load_dir=str(load_dir), digests_out=str(work / "digests.json"))
    launch(REPO / "scripts" / "_fixture_autoep_pipe.py", spec, world_size=world, workdir=work)
    out = {"native": work / "native"}
    if load_dir is not None:
        out["digests"] = json.loads((work / "digests.json").read_text())
    return out
