#!/usr/bin/env python
"""Build the quantized Hugging Face fixtures under ``tests/fixtures/hf/`` (on CPU, in seconds).

* ``fp8_qwen2`` / ``fp8_qwen2_ue8m0``: a tiny Qwen2 (random weights, seeded, bf16) whose decoder
  linears are quantized by transformers' own ``Fp8Quantize`` conversion op (what
  ``from_pretrained(..., quantization_config=FineGrainedFP8Config())`` runs; called directly with a
  minimal quantizer object, as loading-time quantization needs a GPU): FP8 E4M3 payloads and a
  ``weight_scale_inv`` per block, float32 (block 16 x 32) or E8M0 (``scale_fmt="ue8m0"``, block
  32 x 32). Embeddings, norms, biases and ``lm_head`` stay bf16, as transformers leaves them.
* ``fp8_qwen2_sharded``: ``fp8_qwen2``'s tensors in two files as ``save_pretrained`` shards them
  (the tensors in name order, a new file before one would pass 57,600 bytes, so that
  `model.layers.0.mlp.up_proj.weight_scale_inv` opens the second file, apart from its payload) with ``model.safetensors.index.json``: the payloads and scales of some weights in
  different files.
* ``mxfp4_gpt_oss``: a tiny gpt-oss (``GptOssForCausalLM``; random weights, seeded, bf16) whose
  experts are MXFP4 as the released checkpoints hold them. transformers' MXFP4 quantizer needs the
  Triton kernels, so the packed tensors are built here by hand, in transformers' layout:
  ``*_blocks`` uint8 ``[E, out, in/32, 16]`` (random nibbles, two E2M1 values per byte, low nibble
  first) and ``*_scales`` uint8 ``[E, out, in/32]`` (random E8M0 exponents, bias 127), for
  ``gate_up_proj`` (out = 2 x intermediate, in = hidden) and ``down_proj`` (out = hidden,
  in = intermediate).

``config.json`` is ``config.save_pretrained``'s, with the ``quantization_config`` a quantized
``save_pretrained`` writes (``FineGrainedFP8Config(...).to_dict()``, ``Mxfp4Config(...)``).

Usage: ``python scripts/make_quantized_fixtures.py [--out DIR]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import transformers
from safetensors.torch import save_file
from transformers import (
    FineGrainedFP8Config,
    GptOssConfig,
    GptOssForCausalLM,
    Mxfp4Config,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.integrations.finegrained_fp8 import Fp8Quantize

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "tests" / "fixtures" / "hf"
SEED = 1234
QWEN2 = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2,
         "intermediate_size": 128, "vocab_size": 128, "max_position_embeddings": 64, "tie_word_embeddings": False}
GPT_OSS = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2,
           "intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2, "vocab_size": 128,
           "sliding_window": 8, "tie_word_embeddings": False}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8 = {"fp8_qwen2": {"weight_block_size": [16, 32]},
       "fp8_qwen2_ue8m0": {"weight_block_size": [32, 32], "scale_fmt": "ue8m0"}}
SHARDED = {"fp8_qwen2_sharded": ("fp8_qwen2", 57_600)}  # name: (the folder whose tensors, max shard bytes)
MXFP4_EXPONENTS = (118, 126)  # E8M0 scales 2**-9 .. 2**-2: weights of an initialised model's size


def fp8_fixture(out: Path, options: dict, max_shard: int | None = None) -> dict:
    torch.manual_seed(SEED)
    config = Qwen2Config(**QWEN2, dtype="bfloat16")
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    qconfig = FineGrainedFP8Config(**options)
    op = Fp8Quantize(SimpleNamespace(quantization_config=qconfig))
    tensors, quantized = {}, []
    for name, t in model.state_dict().items():
        if name.startswith("model.layers.") and name.endswith(".weight") and name.split(".")[-2] in LINEARS:
            made = op.convert({name: t.detach().clone()})
            if made[name].dtype == torch.float8_e4m3fn:
                quantized.append(name)
            tensors.update(made)
        else:
            tensors[name] = t.detach().clone()
    _save(tensors, out, max_shard)
    config.quantization_config = qconfig
    config.save_pretrained(out)
    return {"model": "Qwen2ForCausalLM", "model_config": QWEN2, "dtype": "bfloat16", "seed": SEED,
            "quantizer": "transformers.integrations.finegrained_fp8.Fp8Quantize(quantizer with "
                         f"FineGrainedFP8Config(**{options}))",
            "quantized": quantized, **({"max_shard_size": max_shard} if max_shard else {})}


def _save(tensors: dict[str, torch.Tensor], out: Path, max_shard: int | None) -> None:
    """``model.safetensors``, or shards and their index as ``save_pretrained`` names them: the
    tensors in name order, a new file whenever the next tensor would take one past ``max_shard`` bytes."""
    if max_shard is None:
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
        return
    groups: list[list[str]] = [[]]
    size = 0
    for n in sorted(tensors):
        nbytes = tensors[n].numel() * tensors[n].element_size()
        if groups[-1] and size + nbytes > max_shard:
            groups.append([])
            size = 0
        groups[-1].append(n)
        size += nbytes
    weight_map = {}
    for i, names in enumerate(groups, 1):
        fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, out / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, fname))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _packed(g: torch.Generator, experts: int, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(*MXFP4_EXPONENTS, (experts, rows, cols // 32), generator=g, dtype=torch.uint8)
    return blocks, scales


def mxfp4_fixture(out: Path) -> dict:
    torch.manual_seed(SEED)
    g = torch.Generator().manual_seed(SEED)
    config = GptOssConfig(**GPT_OSS, dtype="bfloat16")
    model = GptOssForCausalLM(config).to(torch.bfloat16)
    e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
    tensors = {}
    for name, t in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            tensors[name + "_blocks"], tensors[name + "_scales"] = _packed(g, e, 2 * i, h)
        elif name.endswith("mlp.experts.down_proj"):
            tensors[name + "_blocks"], tensors[name + "_scales"] = _packed(g, e, h, i)
        else:
            tensors[name] = t.detach().clone()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config.quantization_config = Mxfp4Config(modules_to_not_convert=[
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"])
    config.save_pretrained(out)
    return {"model": "GptOssForCausalLM", "model_config": GPT_OSS, "dtype": "bfloat16", "seed": SEED,
            "quantizer": "by hand in transformers' MXFP4 layout (its quantizer needs Triton kernels): *_blocks "
                         "uint8 [E, out, in/32, 16] of random bytes, *_scales uint8 [E, out, in/32] of random E8M0 "
                         f"exponents in [{MXFP4_EXPONENTS[0]}, {MXFP4_EXPONENTS[1]})",
            "quantized": sorted(n for n in tensors if n.endswith("_blocks"))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--only", default=None, help="build only these fixtures (comma-separated names)")
    args = ap.parse_args()
    jobs = {**{name: (lambda d, o=o: fp8_fixture(d, o)) for name, o in FP8.items()},
            **{name: (lambda d, f=f, n=n: fp8_fixture(d, FP8[f], n)) for name, (f, n) in SHARDED.items()},
            "mxfp4_gpt_oss": mxfp4_fixture}
    for name, job in jobs.items():
        if args.only and name not in args.only.split(","):
            continue
        folder = args.out / name
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        recipe = job(folder)
        for st in folder.glob("*.safetensors"):
            st.chmod(0o644)
        files = {p.name: {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
                 for p in sorted(folder.iterdir())}
        doc = {"name": name, "kind": "quantized save_pretrained folder", "recipe": recipe,
               "command": "python scripts/make_quantized_fixtures.py",
               "versions": {"transformers": transformers.__version__, "torch": torch.__version__.split("+")[0]},
               "files": files}
        (folder / "fixture.json").write_text(json.dumps(doc, indent=1) + "\n")
        print(f"{name}: {sum(f['bytes'] for f in files.values())} bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
