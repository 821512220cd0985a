"""Peak memory of writing Megatron's legacy distributed-optimizer files (``distrib_optim.pt``, issue 35):
a legacy checkpoint with the distributed optimizer resharded to TP 2 x DP 1, at two model sizes, to show
that no rank's optimizer shard is ever held whole (each target file is streamed window by window).

The source: a synthetic fp32 Llama-shaped checkpoint (hidden 1024, 8 heads in 4 groups, ffn 2816,
vocabulary 32000, ``layers`` layers: 160M parameters at 8, 349M at 24) written as legacy files with
the distributed optimizer at DP 2 (``distrib_optim.pt``: fp32 main parameters and two moments, the
whole buffer) by reshard's legacy writer from an HF folder of random weights. An HF import records no
learning-rate scheduler state, which the writer needs beside the optimizer: this benchmark gives it a
synthetic one (``_scheduler``), so the moments are zeros -- the bytes streamed are the same.

Each reshard runs in a subprocess; its peak RSS is the child's own ``VmHWM`` read at its end (not
``ru_maxrss``: Linux carries the forking parent's RSS into it). Everything lives in a
temporary folder (``$LEGACY_DISTOPT_TMP``, default /tmp), deleted after.

    python -m benchmarks.bench_legacy_distopt [--layers 8,24]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.common import row

H, HEADS, GROUPS, FFN, VOCAB = 1024, 8, 4, 2816, 32000
_ROOT = Path(__file__).resolve().parents[1]


def _hf_source(folder: Path, layers: int) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    d = H // HEADS
    files: dict[str, str] = {}

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    def put(name: str, tensors: dict[str, torch.Tensor]) -> None:
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        files.update({k: name for k in tensors})

    put("embed.safetensors", {"model.embed_tokens.weight": rnd(VOCAB, H)})
    for i in range(layers):
        p = f"model.layers.{i}."
        put(f"layer-{i:03d}.safetensors", {
            p + "input_layernorm.weight": torch.ones(H), p + "self_attn.q_proj.weight": rnd(HEADS * d, H),
            p + "self_attn.k_proj.weight": rnd(GROUPS * d, H), p + "self_attn.v_proj.weight": rnd(GROUPS * d, H),
            p + "self_attn.o_proj.weight": rnd(H, HEADS * d), p + "post_attention_layernorm.weight": torch.ones(H),
            p + "mlp.gate_proj.weight": rnd(FFN, H), p + "mlp.up_proj.weight": rnd(FFN, H),
            p + "mlp.down_proj.weight": rnd(H, FFN)})
    put("head.safetensors", {"model.norm.weight": torch.ones(H), "lm_head.weight": rnd(VOCAB, H)})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": files}))
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "intermediate_size": FFN,
        "num_hidden_layers": layers, "num_attention_heads": HEADS, "num_key_value_heads": GROUPS, "head_dim": d,
        "vocab_size": VOCAB, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "hidden_act": "silu",
        "tie_word_embeddings": False, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "dtype": "float32"}))


def _scheduler() -> None:
    """An HF import has no scheduler state: a synthetic one (this benchmark's source only)."""
    from reshard.formats.megatron import writer

    orig = writer.MegatronWriter._from_hf

    def patched(self: writer.MegatronWriter, *a: object, **k: object) -> None:
        orig(self, *a, **k)  # type: ignore[arg-type]
        self.template = {"opt_param_scheduler": {"max_lr": 1e-3, "num_steps": 0}}

    writer.MegatronWriter._from_hf = patched  # type: ignore[method-assign]


def _child(argv: list[str]) -> dict:
    """``--child make|run``: one step, its peak RSS (MiB) and what it wrote."""
    from reshard.jobs.convert import reshard

    step, src, out = argv
    if step == "make":
        _scheduler()
        done = reshard(Path(src), Path(out), to="megatron", ckpt_format="torch", optimizer="distributed", tp=1,
                       dp=2).out_dir
    else:
        done = reshard(Path(src), Path(out), to="megatron", tp=2, dp=1).out_dir  # the source's format, its optimizer
    sizes = {str(p.relative_to(done)): p.stat().st_size for p in sorted(done.rglob("*.pt"))}
    hwm = next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
               if line.startswith("VmHWM:"))  # kB
    return {"out": str(done), "peak_rss_mib": hwm / 1024, "files": sizes}


def _run(step: str, src: Path, out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(_ROOT))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_legacy_distopt", "--child", step, str(src),
                           str(out)], capture_output=True, text=True, env=env, check=False)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(layers: tuple[int, ...] = (8, 24)) -> list[str]:
    out = []
    for n in layers:
        tmp = Path(tempfile.mkdtemp(prefix="legacy_distopt_", dir=os.environ.get("LEGACY_DISTOPT_TMP")))
        try:
            _hf_source(tmp / "hf", n)
            src = Path(_run("make", tmp / "hf", tmp / "src")["out"])
            shutil.rmtree(tmp / "hf")
            got = _run("run", src, tmp / "out")
            shard = max(v for k, v in got["files"].items() if k.endswith("distrib_optim.pt"))
            out.append(row(f"legacy distopt DP2 -> TP2 x DP1, {n} layers: peak RSS", got["peak_rss_mib"], unit="MiB",
                           note=f"(largest distrib_optim.pt written {shard / 2**20:.0f} MiB)"))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(_child(sys.argv[2:])))
    else:
        ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        ap.add_argument("--layers", default="8,24")
        for line in main(tuple(int(x) for x in ap.parse_args().layers.split(","))):
            print(line)
