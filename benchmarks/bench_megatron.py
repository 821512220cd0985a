"""Megatron-Core ``torch_dist`` -> Hugging Face safetensors on a ~1B-parameter Llama-shaped
checkpoint (bf16, TP=2, random weights), against the copy floor of the same bytes (``cp -r`` of the
iteration folder + ``sync``) in the same run; wall time and peak RSS, each command in a fresh
process, the page cache flushed before each.

The checkpoint is written by reshard's own Megatron writer (an HF ``save_pretrained``-style folder
of random weights imported with ``reshard reshard --to megatron``; Megatron's loader reads that
writer's output: ``tests/formats/megatron/test_megatron_loads.py``), generated on first use into
``bench-data/`` (not committed). ``RESHARD_BENCH_MEGATRON_LAYERS`` changes the depth (default 18:
0.98B parameters, 1.96 GB)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.bench_convert import DATA, ROOT, _drop_out, _run, settle
from benchmarks.common import row

HIDDEN, HEADS, GROUPS, FFN, VOCAB = 2048, 16, 8, 5632, 32000


def _layers() -> int:
    return int(os.environ.get("RESHARD_BENCH_MEGATRON_LAYERS", "18"))


def _hf_source(folder: Path, layers: int) -> None:
    """A Llama ``save_pretrained``-style folder of random bf16 weights, one file per layer."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    d = HIDDEN // HEADS

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    files: dict[str, str] = {}

    def put(name: str, tensors: dict[str, torch.Tensor]) -> None:
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        files.update({k: name for k in tensors})

    put("embed.safetensors", {"model.embed_tokens.weight": rnd(VOCAB, HIDDEN)})
    for i in range(layers):
        p = f"model.layers.{i}."
        put(f"layer-{i:03d}.safetensors", {
            p + "input_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
            p + "self_attn.q_proj.weight": rnd(HEADS * d, HIDDEN), p + "self_attn.k_proj.weight": rnd(GROUPS * d, HIDDEN),
            p + "self_attn.v_proj.weight": rnd(GROUPS * d, HIDDEN), p + "self_attn.o_proj.weight": rnd(HIDDEN, HEADS * d),
            p + "post_attention_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
            p + "mlp.gate_proj.weight": rnd(FFN, HIDDEN), p + "mlp.up_proj.weight": rnd(FFN, HIDDEN),
            p + "mlp.down_proj.weight": rnd(HIDDEN, FFN)})
    put("head.safetensors", {"model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
                             "lm_head.weight": rnd(VOCAB, HIDDEN)})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": files}))
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN, "intermediate_size": FFN,
        "num_hidden_layers": layers, "num_attention_heads": HEADS, "num_key_value_heads": GROUPS, "head_dim": d,
        "vocab_size": VOCAB, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "hidden_act": "silu",
        "tie_word_embeddings": False, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "dtype": "bfloat16"}))


def ensure_checkpoint() -> tuple[Path, float]:
    """The Megatron save folder (and the seconds the HF -> Megatron import took, 0 if cached)."""
    layers = _layers()
    name = f"megatron_llama_{layers}l_tp2"
    ckpt = DATA / "megatron" / name
    if (ckpt / "latest_checkpointed_iteration.txt").is_file():
        return ckpt, 0.0
    hf = DATA / "megatron" / f"hf_llama_{layers}l"
    if not (hf / "config.json").is_file():
        _hf_source(hf, layers)
    _drop_out(ckpt)
    settle()
    t = time.perf_counter()
    staging = DATA / "megatron" / "import"
    subprocess.run([sys.executable, "-m", "reshard.cli", "reshard", str(hf), str(staging), "--to", "megatron",
                    "--tp", "2", "--workers", "2"], check=True, cwd=ROOT, capture_output=True)
    took = time.perf_counter() - t
    (staging / hf.name).rename(ckpt)  # the writer names the save folder after its source
    return ckpt, took


def _copy_floor(src: Path, dst: Path) -> float:
    settle()
    t = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    os.sync()
    wall = time.perf_counter() - t
    _drop_out(dst)
    return wall


def main(workers: int = 2, repeat: int = 2) -> list[str]:
    ckpt, import_s = ensure_checkpoint()
    it = next(p for p in ckpt.iterdir() if p.is_dir())
    in_bytes = sum(p.stat().st_size for p in it.iterdir() if p.is_file())
    out = DATA / "out-megatron"
    _drop_out(out)
    out.mkdir(parents=True)
    # files of at most 1 GiB (HF's sharded layout), so the two workers each write one
    cmd = [sys.executable, "-m", "reshard.cli", "convert", str(ckpt), str(out / "hf"), "--format", "safetensors",
           "--workers", str(workers), "--max-file-gb", "1"]
    ours = floor = float("inf")
    rss = 0.0
    for _ in range(repeat):  # best of `repeat`, alternating
        _drop_out(out / "hf")
        wall, peak = _run(cmd)
        ours, rss = min(ours, wall), max(rss, peak)
        floor = min(floor, _copy_floor(it, out / "copy"))
    out_bytes = sum(p.stat().st_size for p in (out / "hf").rglob("*.safetensors"))
    _drop_out(out)
    params = out_bytes // 2
    lines = [f"Megatron torch_dist checkpoint: {params / 1e9:.2f}B parameters (bf16, TP=2, {_layers()} layers), "
             f"{in_bytes / 2**30:.2f} GiB in, {out_bytes / 2**30:.2f} GiB of safetensors out (files <= 1 GiB), workers={workers}, "
             f"best of {repeat}"]
    if import_s:
        lines.append(row("  (generation: HF -> Megatron TP=2 import, reshard's writer)", import_s))
    lines += [row("torch_dist -> HF safetensors: reshard vs copy floor (cp -r + sync)", ours, floor,
                  note="(ratio < 1: slower than the floor)"),
              row("  peak RSS reshard", rss, unit="MiB", note="(goal: <= 512 MiB, flat in model size)")]
    return lines


if __name__ == "__main__":
    print("\n".join(main()))
