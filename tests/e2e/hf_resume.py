"""Resume an HF ``Trainer`` + DeepSpeed checkpoint of the HF fixtures and report the losses.

Builds the Trainer setup of a fixture's recorded recipe (``<fixture>/fixture.json`` ``recipe``,
see ``scripts/_fixture_hf_recipe.py``: same model class and init, tokenizer, dataset, training
arguments and DeepSpeed config) and runs ``trainer.train(resume_from_checkpoint=CHECKPOINT)`` up
to the recipe's ``max_steps`` (or ``--max-steps``). Launch it like the training was launched::

    deepspeed --num_gpus W --no_local_rank --master_port PORT tests/e2e/hf_resume.py \
        --fixture tests/fixtures/hf/trainer_llama_zero3 --out /tmp/resume [--checkpoint DIR] \
        [--per-device-batch B] [--universal]

or, at world size 1, with plain ``python tests/e2e/hf_resume.py ... --master-port PORT`` (the
script then sets ``RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=PORT`` itself).

``--checkpoint`` defaults to the fixture's last ``checkpoint-N``. ``--universal`` sets the
DeepSpeed config's ``"checkpoint": {"load_universal": true}``; the checkpoint folder must then hold
DeepSpeed's ``ds_to_universal`` output as its tag folder and a ``latest_universal`` file naming it
(see ``docs/hf-checkpoints.md``). ``--per-device-batch`` overrides the recipe's per-device batch;
keep ``per_device * world`` equal to the recipe's global batch to continue the same run (the
DeepSpeed ``"auto"`` batch sizes follow the arguments).

Rank 0 writes ``--out/report.json``: ``{"ok", "world_size", "per_device_train_batch_size",
"global_batch", "resumed_from", "resumed_global_step", "losses": [{"step", "loss", "grad_norm",
"learning_rate"}, ...] (the steps run here, Trainer's own log_history), "error"}``, also when
training raises (then ``ok`` is false, ``error`` is ``"<Type>: <message>"`` and the exit status is
1). Nothing is saved unless ``--save`` (``save_strategy="no"``). DeepSpeed's CPU all-reduce
buffers of this job's master port (``/dev/shm/deepspeed_allreduce_buffer_*_<port>_*``) are removed
at the end by rank 0; the launcher should still clean them too in case the job dies.
"""

# ruff: noqa: E402
import argparse
import glob
import json
import os
import sys
import time
import traceback
from pathlib import Path

T0 = time.time()
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import _fixture_hf_recipe as R


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fixture", required=True, type=Path, help="fixture folder holding fixture.json")
    ap.add_argument("--checkpoint", type=Path, help="checkpoint folder to resume (default: the fixture's last)")
    ap.add_argument("--out", required=True, type=Path, help="output_dir of the resumed run; report.json goes here")
    ap.add_argument("--per-device-batch", type=int, help="per_device_train_batch_size (default: the recipe's)")
    ap.add_argument("--max-steps", type=int, help="max_steps (default: the recipe's)")
    ap.add_argument("--universal", action="store_true", help="DeepSpeed checkpoint.load_universal = true")
    ap.add_argument("--save", action="store_true", help="keep the recipe's save strategy (default: save nothing)")
    ap.add_argument("--master-port", type=int, default=29600, help="MASTER_PORT when launched without a launcher")
    return ap.parse_args(argv)


def last_checkpoint(fixture: Path) -> Path:
    ckpts = sorted(fixture.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    if not ckpts:
        raise SystemExit(f"no checkpoint-N in {fixture}")
    return ckpts[-1]


def main(argv=None) -> int:
    a = parse(argv)
    if "RANK" not in os.environ:  # plain `python`: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(a.master_port))
    port = os.environ["MASTER_PORT"]
    recipe = json.loads((a.fixture / "fixture.json").read_text())["recipe"]
    checkpoint = a.checkpoint or last_checkpoint(a.fixture)

    R.offline_env()
    R.deterministic_torch()
    import deepspeed
    import torch
    from transformers import AutoTokenizer, Trainer, TrainerState, default_data_collator

    deepspeed.init_distributed(dist_backend="gloo")  # before TrainingArguments (ZeRO-3 zero.Init)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    ds = json.loads(json.dumps(recipe["ds_config"]))
    if a.universal:
        ds["checkpoint"] = {**ds.get("checkpoint", {}), "load_universal": True}
    overrides = {}
    if a.per_device_batch:
        overrides["per_device_train_batch_size"] = a.per_device_batch
    if a.max_steps:
        overrides["max_steps"] = a.max_steps
    if not a.save:
        overrides["save_strategy"] = "no"
    args = R.training_arguments(recipe, str(a.out), ds_config_override=ds, **overrides)
    start_step = TrainerState.load_from_json(str(checkpoint / "trainer_state.json")).global_step
    report = {
        "ok": False,
        "fixture": str(a.fixture),
        "resumed_from": str(checkpoint),
        "resumed_global_step": start_step,
        "universal": a.universal,
        "world_size": world,
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "global_batch": args.per_device_train_batch_size * args.gradient_accumulation_steps * world,
        "max_steps": args.max_steps,
        "losses": [],
        "error": None,
    }
    trainer = None
    try:
        model = R.build_model(recipe)
        # the checkpoint's tokenizer when it has one (Trainer does not read it on resume), else the recipe's
        from_checkpoint = (checkpoint / "tokenizer_config.json").is_file()
        tokenizer = AutoTokenizer.from_pretrained(str(checkpoint)) if from_checkpoint else R.build_tokenizer()
        report["tokenizer"] = "checkpoint" if from_checkpoint else "recipe"
        trainer = Trainer(model=model, args=args, train_dataset=R.build_dataset(recipe),
                          data_collator=default_data_collator, processing_class=tokenizer)
        trainer.train(resume_from_checkpoint=str(checkpoint))
        report["ok"] = True
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["traceback"] = traceback.format_exc()
        print(f"[hf_resume] rank {rank}: {report['error']}", file=sys.stderr, flush=True)
    if trainer is not None:
        report["losses"] = [{k: h[k] for k in ("step", "loss", "grad_norm", "learning_rate") if k in h}
                            for h in trainer.state.log_history if "loss" in h and h.get("step", 0) > start_step]
    report["seconds"] = time.time() - T0
    if rank == 0:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
        print(f"[hf_resume] {json.dumps({k: report[k] for k in ('ok', 'world_size', 'global_batch', 'error')})}",
              flush=True)
        print(f"[hf_resume] losses {json.dumps(report['losses'])}", flush=True)
    if report["ok"]:
        torch.distributed.barrier()  # every rank has mapped its buffer; unlinking leaves the mappings alone
    if rank == 0:
        for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
