"""Peak memory of reading one large FP8 weight whole vs in bands (``Reader.banded``), on the paths that
read a source outside the engine's fills: ``reshard verify SRC`` (every shard read through the verified
reads) on an HF folder and on its kept DCP, and a kept DCP's export to bf16 (the DCP reader's fills), each
a fresh process whose own peak (``VmHWM``) is reported.

The source is one DeepSeek-V3 MLP width weight, 18432 x 7168 E4M3 with float32 ``weight_scale_inv`` per
128 x 128 block (126 MiB payload; 504 MiB decoded to float32), and a norm, written into a temporary folder;
the kept DCPs are ``reshard reshard SRC OUT --to dcp --files N --quantize keep`` of it (N = 1, 2; their
manifests removed, so that ``verify`` checks them as sources).

    python -m benchmarks.bench_fragment_bands [--repo PATH]   (PATH: the checkout whose reshard runs;
                                                               default this one: a before/after pair)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPE, BLOCK = (18432, 7168), (128, 128)
NAME = "model.layers.0.mlp.gate_proj.weight"
# run in the measured process: the CLI, then this process's own peak resident set
CHILD = ("import sys\nfrom reshard.cli import main\ncode = main(sys.argv[1:])\n"
         "hwm = next(l for l in open('/proc/self/status') if l.startswith('VmHWM'))\n"
         "print('VMHWM', int(hwm.split()[1]) // 1024, code)\n")


def write_source(folder: Path) -> None:
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    payload = torch.randint(0, 256, SHAPE, generator=g, dtype=torch.uint8)
    payload[(payload & 0x7F) == 0x7F] = 0  # E4M3's NaN bytes
    grid = (-(-SHAPE[0] // BLOCK[0]), -(-SHAPE[1] // BLOCK[1]))
    scales = torch.rand(grid, generator=g) * 1e-3 + 1e-6
    save_file({NAME: payload.view(torch.float8_e4m3fn), NAME + "_scale_inv": scales,
               "model.norm.weight": torch.ones(SHAPE[1], dtype=torch.bfloat16)}, str(folder / "model.safetensors"))
    quant = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK), "activation_scheme": "dynamic"}
    (folder / "config.json").write_text(json.dumps({"quantization_config": quant}))


def peak(repo: Path, *argv: str) -> int:
    env = {**os.environ, "PYTHONPATH": str(repo)}
    run = subprocess.run([sys.executable, "-c", CHILD, *argv], env=env, capture_output=True, text=True, timeout=1800,
                         cwd=tempfile.gettempdir())  # not this checkout: -c puts the working folder first on sys.path
    line = next((x for x in run.stdout.splitlines() if x.startswith("VMHWM")), None)
    if run.returncode != 0 or line is None or line.split()[2] != "0":
        raise RuntimeError(f"{argv}: {run.stderr[-2000:]}")
    return int(line.split()[1])


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_fragment_bands")
    p.add_argument("--repo", type=Path, default=ROOT, help="the checkout whose reshard is measured")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="reshard-bands-") as tmp:
        work = Path(tmp)
        src = work / "fp8"
        write_source(src)
        rows = [("reshard verify (HF folder)", peak(args.repo, "verify", str(src)))]
        for files in (1, 2):
            kept = work / f"kept{files}"
            peak(ROOT, "reshard", str(src), str(kept), "--to", "dcp", "--files", str(files), "--quantize", "keep")
            (kept / "fp8" / "reshard-manifest.json").unlink()  # a source, not an output: verify checks it as one
            rows.append((f"reshard verify (kept DCP, {files} file(s))", peak(args.repo, "verify", str(kept / "fp8"))))
            rows.append((f"kept DCP ({files} file(s)) -> hf bf16",
                         peak(args.repo, "convert", str(kept / "fp8"), str(work / f"out{files}"), "--format", "hf",
                              "--dtype", "bf16", "--hf-config", str(src))))
    print(f"one FP8 {SHAPE[0]}x{SHAPE[1]} weight, reshard at {args.repo}")
    for what, mib in rows:
        print(f"  {what:40s} peak {mib} MiB")


if __name__ == "__main__":
    main()
