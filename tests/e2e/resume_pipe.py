"""Resume ``deepspeed.pipe`` checkpoints, one after another, in a real DeepSpeed job and train a
few steps after each (the pipeline counterpart of ``resume_train.py``); launched by
``tests/e2e/launch.py``::

    deepspeed --num_gpus N --no_local_rank --master_port P tests/e2e/resume_pipe.py --spec SPEC.json

``SPEC.json``: ``report_path`` and ``loads``, a list of ``{"name", "model_config"`` (with
``stages``, the stage count to run at), ``"seed", "seq_len", "micro_batch", "ds_config",
"load_dir", "universal"`` (load through ``load_universal``), ``"save_dir"`` (optional: save right
after loading, before any step) and ``"steps"}``. Each load builds a fresh ``PipelineModule`` (its
own stage grid, so loads may differ in stage count) and engine, as a fresh job would; each DP rank
trains on its slice of one fixed batch, as the fixture script does. Rank 0 writes
``{"loads": {name: {"losses": [...], "stages": S, "dp": D}}}``, rewritten after every load.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from _fixture_pipe import build, fixed_batches  # noqa: E402


def resume_one(load: dict) -> dict:
    """Load one checkpoint into a fresh pipeline engine and train; this rank's view of it."""
    import deepspeed

    torch.manual_seed(int(load["seed"]))
    cfg = dict(load["model_config"], seq_len=load["seq_len"])
    ds_config = copy.deepcopy(load["ds_config"])
    ds_config.pop("train_batch_size", None)
    if load["universal"]:
        ds_config["checkpoint"] = {"load_universal": True}
    model = build(cfg)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                            if p.requires_grad], config=ds_config)
    path, _ = engine.load_checkpoint(load["load_dir"])
    if path is None:
        raise RuntimeError(f"nothing loaded from {load['load_dir']}")
    if load.get("save_dir"):
        engine.save_checkpoint(load["save_dir"])
    dp_world = engine.grid.get_data_parallel_world_size()
    data, _ = fixed_batches(load, engine)
    losses = [float(engine.train_batch(data_iter=data)) for _ in range(int(load["steps"]))]
    report = {"losses": losses, "stages": engine.num_stages, "dp": dp_world}
    # Release this engine (its gradient hooks and optimizer state) before the next one is built.
    engine.destroy()
    del engine, model
    gc.collect()
    torch.distributed.barrier()
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    spec = json.loads(Path(parser.parse_args().spec).read_text())
    torch.set_num_threads(1)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    reports = {}
    for load in spec["loads"]:
        reports[load["name"]] = resume_one(load)
        if torch.distributed.get_rank() == 0:
            tmp = spec["report_path"] + ".tmp"
            Path(tmp).write_text(json.dumps({"loads": reports}))
            os.replace(tmp, spec["report_path"])
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
