"""FP8 -> FP8 at another layout without re-quantizing (issue 33 item 5): from the committed FP8
block-scale folders (transformers' own ``Fp8Quantize``), ``--format vllm --tp T --quantize fp8``
gives each rank its payload shard and its ``weight_scale_inv`` rows as vLLM's loaders hold them
(``⌈rows/block⌉`` scale rows at ``⌈offset/block⌉``), never decoding; the shards put back by the
maps are the source's bytes; a TP that cuts a block is refused as vLLM refuses it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from reshard.errors import QuantizedError
from reshard.formats.safetensors import quantized as quantized_module
from reshard.ir.apply import bits, rebuild
from reshard.ir.codec import e8m0
from reshard.jobs.convert import convert
from reshard.layouts.arch import LLAMA_VLLM, inference_targets
from reshard.layouts.inference import scale_placed

HF = Path(__file__).resolve().parents[2] / "fixtures" / "hf"
ATTN = "model.layers.{i}.self_attn."


@pytest.fixture(autouse=True)
def never_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object) -> None:
        raise AssertionError("an FP8 payload was decoded")

    monkeypatch.setattr(quantized_module, "fp8_block_decode", refuse)


def source(tmp_path: Path, name: str) -> Path:
    """The fixture with its architecture named (``config.save_pretrained`` leaves it out; vLLM needs it)."""
    src = tmp_path / name
    shutil.copytree(HF / name, src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen2ForCausalLM"]}))
    return src


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize(("name", "tp", "quantize"), [("fp8_qwen2", 2, "fp8"), ("fp8_qwen2", 1, "fp8"),
                                                      ("fp8_qwen2_ue8m0", 1, "fp8-ue8m0")])
def test_ranks_hold_payload_and_scale_rows_as_vllm(tmp_path: Path, name: str, tp: int, quantize: str) -> None:
    src = source(tmp_path, name)
    convert(src, tmp_path / "out", fmt="vllm", tp=tp, quantize=quantize)
    hf = load_file(src / "model.safetensors")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    bm, bn = config["quantization_config"]["weight_block_size"]

    def scales(key: str) -> torch.Tensor:  # as vLLM's float32 parameter holds them (E8M0 exactly)
        s = hf[key.replace(".weight", ".weight_scale_inv")]
        return e8m0(s) if s.dtype == torch.float8_e8m0fnu else s

    for r in range(tp):
        got = load_file(tmp_path / "out" / f"model-rank-{r}-part-0.safetensors")
        for i in range(2):
            qkv = [ATTN.format(i=i) + f"{p}_proj.weight" for p in "qkv"]  # 2 kv heads: whole heads per rank at TP 2
            gate_up = [f"model.layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up")]
            for into, parts in ((ATTN.format(i=i) + "qkv_proj.weight", qkv),
                                (f"model.layers.{i}.mlp.gate_up_proj.weight", gate_up)):
                assert got[into].dtype == torch.float8_e4m3fn
                assert torch.equal(u8(got[into]), torch.cat([u8(hf[k]).chunk(tp)[r] for k in parts]))
                # each part's ⌈rows/bm⌉ scale rows at ⌈offset/bm⌉: whole blocks, so its rows cut by TP
                want = torch.cat([scales(k).chunk(tp)[r] for k in parts])
                assert got[into.replace(".weight", ".weight_scale_inv")].dtype == torch.float32
                assert torch.equal(got[into.replace(".weight", ".weight_scale_inv")], want)
            for into in (ATTN.format(i=i) + "o_proj.weight", f"model.layers.{i}.mlp.down_proj.weight"):
                assert torch.equal(u8(got[into]), u8(hf[into]).chunk(tp, 1)[r])  # row-parallel: columns
                assert torch.equal(got[into.replace(".weight", ".weight_scale_inv")], scales(into).chunk(tp, 1)[r])
        assert got["lm_head.weight"].dtype == torch.bfloat16  # not a linear vLLM quantizes
        # Fp8KVCacheMethod's parameters, unset (-1.0) in the model dtype, beside the float32 scalars (1.0)
        assert got[ATTN.format(i=1) + "attn.k_scale"].dtype == torch.bfloat16 and got[ATTN.format(i=1) + "attn.k_scale"] == -1
        assert got[ATTN.format(i=1) + "attn._k_scale"] == 1
    assert config["quantization_config"]["quant_method"] == "fp8"


def test_tp_shards_put_back_are_the_source_bytes(tmp_path: Path) -> None:
    """FP8 -> TP 2 shards -> back by the IR's maps (payload's and ``coarsen``'s): every payload and
    scale byte the source's."""
    src = source(tmp_path, "fp8_qwen2")
    convert(src, tmp_path / "out", fmt="vllm", tp=2, quantize="fp8")
    hf = load_file(src / "model.safetensors")
    shapes = {k: tuple(v.shape) for k, v in hf.items() if not k.endswith("_scale_inv")}
    placed = inference_targets(LLAMA_VLLM, shapes, tp=2, num_heads=4, num_kv_heads=2)
    engine = [load_file(tmp_path / "out" / f"model-rank-{r}-part-0.safetensors") for r in range(2)]
    back = 0
    for name, p in placed.items():
        if not name.endswith(".weight") or name.replace(".weight", ".weight_scale_inv") not in hf:
            continue
        for key, m, into in ((name, p, p.into), (name.replace(".weight", ".weight_scale_inv"),
                                                 scale_placed(p, (16, 32)), p.into.replace(".weight", ".weight_scale_inv"))):
            shards = {}
            for r, s in m.map.shards.items():
                flat = engine[r][into].reshape(-1)
                shards[r] = flat[m.offsets[r]:m.offsets[r] + s.numel].reshape(s.shape)
            full = rebuild(m.map, {r: bits(t) for r, t in shards.items()})  # replicas checked equal
            assert torch.equal(full, bits(hf[key])), key
            back += 1
    assert back == 28  # 14 payloads and their scales


def test_hf_at_another_file_split_moves_the_bytes(tmp_path: Path) -> None:
    """FP8 -> an FP8 HF folder in shards of 30 kB (its quantization_config kept): every tensor the
    source's bytes, never decoded."""
    convert(HF / "fp8_qwen2", tmp_path / "out", fmt="hf", quantize="fp8", max_file_bytes=30000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"]
    got = {k: v for f in sorted(set(index.values())) for k, v in load_file(tmp_path / "out" / f).items()}
    hf = load_file(HF / "fp8_qwen2" / "model.safetensors")
    assert len(set(index.values())) > 1 and sorted(got) == sorted(hf)
    assert all(got[k].dtype == v.dtype and torch.equal(u8(got[k]), u8(v)) for k, v in hf.items())
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [16, 32]


@pytest.mark.parametrize(("name", "tp", "quantize", "match"), [
    # o_proj [64, 64] in 16 x 32 blocks at TP 4: 16 columns a rank, half a block
    ("fp8_qwen2", 4, "fp8", r"'model.layers.0.self_attn.o_proj.weight' \[64, 64\] at --format vllm --tp 4: rank 0 "
                            r"holds 16 of its columns.*input_size_per_partition = 16 is not divisible by block_k = 32"),
    # k_proj [32, 64] in 32 x 32 blocks at TP 2: one 16-row key/value head a rank, half a block
    ("fp8_qwen2_ue8m0", 2, "fp8-ue8m0", r"'model.layers.0.self_attn.q_proj.weight'.*rank 0 holds 32 of its rows|"
                                        r"'model.layers.0.self_attn.k_proj.weight'.*output_partition_size = 16"),
])
def test_refused_before_any_output(tmp_path: Path, name: str, tp: int, quantize: str, match: str) -> None:
    with pytest.raises(QuantizedError, match=match):
        convert(source(tmp_path, name), tmp_path / "out", fmt="vllm", tp=tp, quantize=quantize)
    assert not (tmp_path / "out").exists()


def test_fp8_output_head_refused(tmp_path: Path) -> None:
    """A folder whose lm_head is FP8 too (transformers leaves it; some releases do not): vLLM's output
    head is no FP8 linear, so its FP8 bytes would be read as weights. Refused by name."""
    from safetensors.torch import save_file

    from reshard.ir.codec import fp8_block_encode

    src = source(tmp_path, "fp8_qwen2")
    t = load_file(src / "model.safetensors")
    t["lm_head.weight"], t["lm_head.weight_scale_inv"] = fp8_block_encode(t["lm_head.weight"], (16, 32))
    save_file(t, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(QuantizedError, match=r"'lm_head.weight' is stored as FP8, but vLLM holds 'lm_head.weight' "
                                             "unquantized"):
        convert(src, tmp_path / "out", fmt="vllm", tp=2, quantize="fp8")
    assert not (tmp_path / "out").exists()
