"""FP8 block scales at SGLang's TP (issue 33 item 5), against SGLang 0.5.23's own loading code
(``make test-sglang``, in ``.venv-sglang``; ``make test`` does not collect this folder): for the committed
FP8 Qwen2 folders (transformers' ``Fp8Quantize``), the FP8 linear layers SGLang's Qwen2 builds
(``QKVParallelLinear``, ``MergedColumnParallelLinear``, ``RowParallelLinear`` with its ``Fp8LinearMethod``,
whose ``ModelWeightParameter`` / ``BlockQuantScaleParameter`` weight loaders slice each rank's rows and
scale rows), loaded by SGLang's own ``Qwen2ForCausalLM`` weight loop from the HF folder at each TP rank,
hold byte for byte what ``reshard convert --format vllm --tp T --quantize …`` writes for that rank.

SGLang's TP rank and size are set in one process with its own ``get_parallel().override(tp_size=…,
tp_rank=…)``: its linear layers then partition as a ``_LogicalGroup`` ("own a weight partition before
distributed communication is initialized"), so no process group and no GPU is needed. The whole model is
not built (its constructor wants pipeline groups); its decoder layers' FP8 linears are, with the arguments
``sglang/srt/models/qwen2.py`` gives them, under module names its weight loop looks up. Nothing runs a
kernel: loading never uses one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from sglang.srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from sglang.srt.layers.quantization.fp8 import Fp8Config
from sglang.srt.models.qwen2 import Qwen2ForCausalLM
from sglang.srt.runtime_context import get_parallel
from transformers import Qwen2Config

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "hf"


def _source(tmp_path: Path, name: str) -> Path:
    src = tmp_path / name
    shutil.copytree(FIXTURES / name, src)
    config = json.loads((src / "config.json").read_text())  # config.save_pretrained leaves the class out
    (src / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen2ForCausalLM"]}))
    return src


def _reshard(*args: object) -> subprocess.CompletedProcess:
    env = {**os.environ, "RESHARD_CACHE_DIR": "off",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "reshard", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)


class _Layer(torch.nn.Module):
    """One Qwen2 decoder layer's linears, built as ``Qwen2Attention`` and ``Qwen2MLP`` build them."""

    def __init__(self, c: Qwen2Config, qc: Fp8Config, prefix: str) -> None:
        super().__init__()
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.self_attn = torch.nn.Module()
        self.self_attn.qkv_proj = QKVParallelLinear(c.hidden_size, head_dim, c.num_attention_heads,
                                                    c.num_key_value_heads, bias=True, quant_config=qc,
                                                    prefix=f"{prefix}.self_attn.qkv_proj")
        self.self_attn.o_proj = RowParallelLinear(c.num_attention_heads * head_dim, c.hidden_size, bias=False,
                                                  quant_config=qc, reduce_results=False,
                                                  prefix=f"{prefix}.self_attn.o_proj")
        self.mlp = torch.nn.Module()
        self.mlp.gate_up_proj = MergedColumnParallelLinear(c.hidden_size, [c.intermediate_size] * 2, bias=False,
                                                           quant_config=qc, prefix=f"{prefix}.mlp.gate_up_proj")
        self.mlp.down_proj = RowParallelLinear(c.intermediate_size, c.hidden_size, bias=False, quant_config=qc,
                                               prefix=f"{prefix}.mlp.down_proj")


class _Linears(torch.nn.Module):
    """``model.layers.*`` under the names ``Qwen2ForCausalLM``'s weight loop looks up; ``config`` for its
    tied-embedding branch. Tensors with no parameter here (embeddings, norms) it skips with a warning."""

    def __init__(self, c: Qwen2Config, qc: Fp8Config) -> None:
        super().__init__()
        self.config = c
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList(_Layer(c, qc, f"model.layers.{i}") for i in range(c.num_hidden_layers))


def _build(src: Path, tp: int, rank: int) -> _Linears:
    config = Qwen2Config.from_pretrained(src)
    qc = Fp8Config.from_config(json.loads((src / "config.json").read_text())["quantization_config"])
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(config.dtype or torch.bfloat16)  # as SGLang's loader builds a model (set_default_torch_dtype)
    try:
        with get_parallel().override(tp_size=tp, tp_rank=rank):
            return _Linears(config, qc)
    finally:
        torch.set_default_dtype(dtype)


def sglang_ranks(src: Path, tp: int) -> list[dict[str, torch.Tensor]]:
    """What SGLang's FP8 linears hold at each TP rank once its Qwen2 weight loop has loaded ``src``."""
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        weights.update(load_file(f))
    ranks = []
    for rank in range(tp):
        with get_parallel().override(tp_size=tp, tp_rank=rank):
            model = _build(src, tp, rank)
            Qwen2ForCausalLM._legacy_load_weights(model, iter(weights.items()))
        ranks.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return ranks


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize(("name", "tp", "quantize"), [
    ("fp8_qwen2", 2, "fp8"), ("fp8_qwen2_sharded", 2, "fp8"), ("fp8_qwen2_ue8m0", 1, "fp8-ue8m0")])
def test_fp8_ranks_are_what_sglang_loads(tmp_path: Path, name: str, tp: int, quantize: str) -> None:
    """16 x 32 float32 blocks at TP 2 (every split on a block edge: q 32, k/v 16, gate/up 64 rows, o 32 and
    down 64 columns a rank), from one file and from two with an index; 32 x 32 E8M0 blocks at TP 1, which
    SGLang's float32 scale parameter takes."""
    src = _source(tmp_path, name)
    done = _reshard("convert", src, tmp_path / "reshard", "--format", "vllm", "--tp", tp, "--quantize", quantize)
    assert done.returncode == 0, done.stderr
    engine = sglang_ranks(src, tp)
    # the ranks hold different rows: a rank's files compared with the other's would fail
    assert all(not torch.equal(_bits(engine[0][k]), _bits(engine[r][k])) for r in range(1, tp) for k in engine[0]
               if k.endswith(".weight"))
    for rank, held in enumerate(engine):
        assert held["model.layers.0.self_attn.qkv_proj.weight"].dtype == torch.float8_e4m3fn
        assert held["model.layers.0.mlp.down_proj.weight_scale_inv"].dtype == torch.float32
        ours: dict[str, torch.Tensor] = {}
        for f in sorted((tmp_path / "reshard").glob(f"model-rank-{rank}-part-*.safetensors")):
            ours.update(load_file(f))
        # per layer: qkv_proj's weight, scale and bias; o_proj's, gate_up_proj's, down_proj's weight and scale
        assert len(held) == 9 * 2, sorted(held)
        for key, t in held.items():
            assert key in ours, (rank, key)
            assert ours[key].dtype == t.dtype and ours[key].shape == t.shape, (rank, key, ours[key].shape, t.shape)
            assert torch.equal(_bits(ours[key]), _bits(t)), (rank, key)


@pytest.mark.parametrize(("name", "tp", "quantize", "sglang_says"), [
    # 32-row blocks, k_proj/v_proj 16 rows a rank (qkv_proj's partitions are checked one by one)
    ("fp8_qwen2_ue8m0", 2, "fp8-ue8m0", "output_partition_size = 16 is not divisible by weight quantization block_n = 32"),
    # 32-column blocks, o_proj 16 columns a rank (SGLang gives k_proj/v_proj's 2 heads one a rank, two
    # ranks each, whole 16-row blocks; the row-parallel o_proj is what it refuses)
    ("fp8_qwen2", 4, "fp8", "input_size_per_partition = 16 is not divisible by weight quantization block_k = 32"),
])
def test_a_split_that_cuts_a_block_is_refused_as_sglang_refuses_it(
        tmp_path: Path, name: str, tp: int, quantize: str, sglang_says: str) -> None:
    """Where a TP boundary cuts a block SGLang builds no layer (``Fp8LinearMethod.validate_block_quant_shapes``)
    and reshard writes no engine shards for it, before any output exists."""
    src = _source(tmp_path, name)
    for rank in range(tp):
        with pytest.raises(ValueError, match=sglang_says.replace(".", r"\.")):
            _build(src, tp, rank)
    done = _reshard("convert", src, tmp_path / "out", "--format", "vllm", "--tp", tp, "--quantize", quantize)
    assert done.returncode != 0 and "reshard: error:" in done.stderr and "choose a TP that splits whole blocks" in done.stderr
    assert not (tmp_path / "out").exists()
