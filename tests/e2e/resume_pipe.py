"""Resume a ``deepspeed.pipe`` checkpoint in a real DeepSpeed job and train a few steps (the
pipeline counterpart of ``resume_train.py``); launched by ``tests/e2e/launch.py``::

    deepspeed --num_gpus N --no_local_rank --master_port P tests/e2e/resume_pipe.py --spec SPEC.json

``SPEC.json``: ``model_config`` (with ``stages``, the stage count to run at), ``seed``,
``seq_len``, ``micro_batch``, ``ds_config``, ``load_dir``, ``universal`` (load through
``load_universal``), ``save_dir`` (optional: save right after loading, before any step),
``steps`` and ``report_path``. Each DP rank trains on its slice of one fixed batch, as the
fixture script does; rank 0 writes ``{"losses": [...], "stages": S, "dp": D}``.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from _fixture_pipe import build, fixed_batches  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    spec = json.loads(Path(parser.parse_args().spec).read_text())
    torch.set_num_threads(1)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(int(spec["seed"]))
    cfg = dict(spec["model_config"], seq_len=spec["seq_len"])
    ds_config = copy.deepcopy(spec["ds_config"])
    ds_config.pop("train_batch_size", None)
    if spec["universal"]:
        ds_config["checkpoint"] = {"load_universal": True}
    model = build(cfg)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                            if p.requires_grad], config=ds_config)
    path, _ = engine.load_checkpoint(spec["load_dir"])
    if path is None:
        raise RuntimeError(f"nothing loaded from {spec['load_dir']}")
    if spec.get("save_dir"):
        engine.save_checkpoint(spec["save_dir"])
    dp_world = engine.grid.get_data_parallel_world_size()
    data, _ = fixed_batches(spec, engine)
    losses = [float(engine.train_batch(data_iter=data)) for _ in range(int(spec["steps"]))]
    if torch.distributed.get_rank() == 0:
        Path(spec["report_path"]).write_text(json.dumps({"losses": losses, "stages": engine.num_stages,
                                                         "dp": dp_world}))
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
