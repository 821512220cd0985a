"""Turn an HF Trainer + DeepSpeed ``checkpoint-N`` into one that Trainer resumes at another world
size through DeepSpeed's own universal-checkpoint route.

    python tests/e2e/hf_universal.py SRC_CHECKPOINT DST_CHECKPOINT

``DST`` gets every file of ``SRC`` that is not DeepSpeed's (``trainer_state.json``,
``rng_state*.pth``, ``training_args.bin``, config and tokenizer files, ``model.safetensors``...),
the tag folder converted by ``python -m deepspeed.checkpoint.ds_to_universal --inject_missing_state``
under the same name (``global_stepN``), and a ``latest_universal`` file naming it; ``latest`` is
not copied (it would name a folder the native loader cannot read).

Then resume with the DeepSpeed config's ``"checkpoint": {"load_universal": true}`` and the global
batch kept (``per_device_train_batch_size * world_size`` as before), e.g.::

    python tests/e2e/hf_resume.py --fixture F --checkpoint DST --universal --per-device-batch 4 --out O
    deepspeed --num_gpus 4 --no_local_rank --master_port P tests/e2e/hf_resume.py --fixture F \
        --checkpoint DST --universal --per-device-batch 1 --out O

What Trainer needs of ``DST`` (observed with transformers 5.24 / DeepSpeed 0.19.8, see
``docs/hf-checkpoints.md``): ``trainer_state.json`` (read unconditionally when resuming), a folder
matching ``global_step*`` (Trainer's ``deepspeed_load_checkpoint`` refuses the checkpoint
otherwise: ``ValueError: Can't find a valid checkpoint at ...``), ``latest_universal`` naming the
tag, and in the tag folder ``zero/`` plus the model-state file of DP rank 0
(``mp_rank_00_model_states.pt``, or ``zero_pp_rank_0_mp_rank_00_model_states.pt`` for ZeRO-3),
which also carries the LR scheduler's state. The rest is optional.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

DEEPSPEED_NAMES = ("latest", "latest_universal", "zero_to_fp32.py", "zero_to_torch.py")


def make_universal(src: Path, dst: Path, *, log_path: Path | None = None, timeout_s: float = 600) -> Path:
    """Write ``dst`` (see the module docstring) from the Trainer checkpoint ``src``; returns ``dst``."""
    src, dst = Path(src), Path(dst)
    tag = (src / "latest").read_text().strip()
    if dst.exists():
        raise FileExistsError(dst)
    dst.mkdir(parents=True)
    for p in sorted(src.iterdir()):
        if p.name == tag or p.name in DEEPSPEED_NAMES:
            continue
        (shutil.copytree if p.is_dir() else shutil.copy2)(p, dst / p.name)
    cmd = [sys.executable, "-W", "ignore", "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
           str(src / tag), "--output_folder", str(dst / tag), "--inject_missing_state",
           "--num_extract_workers", "1", "--num_merge_workers", "1"]
    out = open(log_path, "w") if log_path else subprocess.DEVNULL
    try:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
    finally:
        if log_path:
            out.close()
    if rc != 0:
        raise RuntimeError(f"ds_to_universal failed (exit {rc}): {' '.join(cmd)}")
    (dst / "latest_universal").write_text(tag)
    return dst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path, help="a Trainer checkpoint-N folder (holding 'latest')")
    ap.add_argument("dst", type=Path, help="the folder to write (must not exist)")
    ap.add_argument("--log", type=Path, help="ds_to_universal's output goes here")
    a = ap.parse_args(argv)
    print(make_universal(a.src, a.dst, log_path=a.log))
    return 0


if __name__ == "__main__":
    sys.exit(main())
