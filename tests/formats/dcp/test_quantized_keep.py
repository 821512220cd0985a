"""Quantized weights kept as stored (``--quantize keep``; issue 33 item 5): from transformers' FP8
block-scale folders and the gpt-oss MXFP4 one, a DCP target holds each payload and its scales as
entries of their own, byte for byte (with ``--files N``: dim-0 chunks, so MXFP4 experts split over
the loading ranks), which torch's own ``dcp.load`` reads back bit for bit; DCP -> an HF folder gives
the source's tensors byte for byte, and an HF folder at another file split likewise; nothing is
decoded on the way. The DCP reader decodes such a checkpoint to real weights as it decodes the
folder; a quantized DCP entry without its ``quantization_config`` is refused, never read as a weight."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from reshard import convert
from reshard.errors import QuantizedError, ReshardError
from reshard.formats.safetensors import quantized as quantized_module
from reshard.jobs.convert import reshard
from tests.support.paths import HF

FOLDERS = ["fp8_qwen2", "fp8_qwen2_ue8m0", "mxfp4_gpt_oss"]
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save / load, one process


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.rglob("*.safetensors")):
        out.update(load_file(f))
    return out


def _never_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object) -> None:
        raise AssertionError("a quantized payload was decoded")

    monkeypatch.setattr(quantized_module, "fp8_block_decode", refuse)
    monkeypatch.setattr(quantized_module, "mxfp4_decode", refuse)


def _source(name: str) -> dict[str, torch.Tensor]:
    return load_file(HF / name / "model.safetensors")


def _quantized(name: str, src: dict[str, torch.Tensor]) -> list[str]:
    return [k for k, v in src.items() if v.dtype in (torch.float8_e4m3fn, torch.uint8)
            or k.endswith("_scale_inv")]


@pytest.mark.parametrize("files", [None, 3])
@pytest.mark.parametrize("name", FOLDERS)
def test_hf_dcp_hf_gives_the_source_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str,
                                          files: int | None) -> None:
    _never_decoded(monkeypatch)
    if files is None:
        convert(HF / name, tmp_path / "dcp", fmt="dcp", quantize="keep")
    else:
        reshard(HF / name, tmp_path / "dcp", to="dcp", files=files, quantize="keep")
    ck = tmp_path / "dcp" / name
    if files is not None:
        assert sorted(p.name for p in ck.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(files)]
    convert(ck, tmp_path / "hf", fmt="hf", quantize="keep", hf_config=HF / name)
    src, got = _source(name), _tensors(tmp_path / "hf")
    assert sorted(got) == sorted(src)
    assert all(_same(got[k], v) for k, v in src.items())
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["quantization_config"] == \
        json.loads((HF / name / "config.json").read_text())["quantization_config"]


@pytest.mark.parametrize("name", FOLDERS)
def test_torch_dcp_load_reads_the_source_tensors(tmp_path: Path, name: str) -> None:
    """torch's own ``dcp.load`` (no process group) of the kept DCP: every payload and scale entry the
    source's bytes (experts split over 3 files for MXFP4), the quantization_config entries the source's
    (a dict, flattened as ``dcp.save`` flattens one)."""
    reshard(HF / name, tmp_path / "dcp", to="dcp", files=3, quantize="keep")
    src = _source(name)
    keys = _quantized(name, src)
    assert keys
    q = json.loads((HF / name / "config.json").read_text())["quantization_config"]
    state: dict[str, object] = {f"model.{k}": torch.empty_like(src[k]) for k in keys}
    state["quantization_config"] = {k: None for k in q}  # flattened as dcp.save flattens a dict
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp" / name), no_dist=True)
    for k in keys:
        assert _same(state[f"model.{k}"], src[k]), k  # type: ignore[arg-type]
    assert state["quantization_config"] == q


@pytest.mark.parametrize("name", FOLDERS)
def test_kept_dcp_decodes_as_the_folder(tmp_path: Path, name: str) -> None:
    """The DCP reader decodes the kept entries as the folder's reader does: the bf16 export is the
    same, bit for bit (the folder's is transformers' dequantized load: test_quantized_decode)."""
    reshard(HF / name, tmp_path / "dcp", to="dcp", files=2, quantize="keep")
    convert(tmp_path / "dcp" / name, tmp_path / "from_dcp", fmt="hf", dtype=torch.bfloat16, hf_config=HF / name)
    convert(HF / name, tmp_path / "from_hf", fmt="hf", dtype=torch.bfloat16)
    a, b = _tensors(tmp_path / "from_dcp"), _tensors(tmp_path / "from_hf")
    assert sorted(a) == sorted(b) and all(_same(a[k], v) for k, v in b.items())
    assert "quantization_config" not in json.loads((tmp_path / "from_dcp" / "config.json").read_text())


@pytest.mark.parametrize("name", FOLDERS)
def test_hf_and_safetensors_at_three_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """An HF folder in (at least) 3 files (each payload's scales in its file), read back and written whole: the
    source's bytes; the safetensors target so split holds them too."""
    _never_decoded(monkeypatch)
    src = _source(name)
    size = sum(v.numel() * v.element_size() for v in src.values())
    for fmt in ("hf", "safetensors"):
        convert(HF / name, tmp_path / fmt, fmt=fmt, quantize="keep", max_file_bytes=size // 3 + 1)
        files = sorted((tmp_path / fmt).rglob("*.safetensors"))
        assert len(files) >= 3, files  # whole tensors per file: a third of the bytes, at least 3 files
        got = _tensors(tmp_path / fmt)
        assert sorted(got) == sorted(src) and all(_same(got[k], v) for k, v in src.items())
        for f in files:  # a payload and its scales in one file
            held = set(load_file(f))
            assert all(k.replace("_scale_inv", "") in held for k in held if k.endswith("_scale_inv"))
            assert all(k.replace("_scales", "_blocks") in held for k in held if k.endswith("_scales"))
    convert(tmp_path / "hf", tmp_path / "whole", fmt="hf", quantize="keep")
    got = _tensors(tmp_path / "whole")
    assert len(list((tmp_path / "whole").glob("*.safetensors"))) == 1
    assert sorted(got) == sorted(src) and all(_same(got[k], v) for k, v in src.items())


def test_quantize_keep_on_vllm_is_the_sources_own_encoding(tmp_path: Path) -> None:
    """``--format vllm --quantize keep`` from the E8M0 folder: as ``--quantize fp8-ue8m0`` (its own)."""
    import shutil

    for q in ("keep", "fp8-ue8m0"):
        src = tmp_path / f"src_{q}"
        shutil.copytree(HF / "fp8_qwen2_ue8m0", src)
        config = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen2ForCausalLM"]}))
        convert(src, tmp_path / q, fmt="vllm", tp=1, quantize=q)
    a, b = _tensors(tmp_path / "keep"), _tensors(tmp_path / "fp8-ue8m0")
    assert sorted(a) == sorted(b) and all(_same(a[k], v) for k, v in b.items())


def _save_dcp(path: Path, state: dict[str, object]) -> None:
    dcp.save(state, checkpoint_id=str(path), no_dist=True)


def test_fp8_dcp_entry_without_its_config_refused(tmp_path: Path) -> None:
    """A DCP torch saved with an FP8 model entry and no quantization_config: refused naming the entry
    (the payload's bytes are not a weight), before any output."""
    src = _source("fp8_qwen2")
    key = "model.layers.0.mlp.down_proj.weight"
    _save_dcp(tmp_path / "ck", {"model.model.norm.weight": src["model.norm.weight"].float(),
                                f"model.{key}": src[key], f"model.{key}_scale_inv": src[key + "_scale_inv"]})
    with pytest.raises(QuantizedError, match=rf"tensor {key!r}: dtype 'F8_E4M3'.*no quantization_config"):
        convert(tmp_path / "ck", tmp_path / "out", fmt="hf", hf_config=HF / "fp8_qwen2")
    assert not (tmp_path / "out").exists()


def test_mxfp4_dcp_entries_without_their_config_refused(tmp_path: Path) -> None:
    """MXFP4's uint8 blocks saved by torch with no quantization_config: refused by name, not read as
    weights of values 0-255."""
    src = _source("mxfp4_gpt_oss")
    key = "model.layers.0.mlp.experts.down_proj"
    _save_dcp(tmp_path / "ck", {"model.model.norm.weight": src["model.norm.weight"].float(),
                                f"model.{key}_blocks": src[key + "_blocks"], f"model.{key}_scales": src[key + "_scales"]})
    with pytest.raises(QuantizedError, match=rf"tensor '{key}_(blocks|scales)' \(torch.uint8\) is part of a quantized "
                                             r"weight.*no quantization_config"):
        convert(tmp_path / "ck", tmp_path / "out", fmt="dcp")
    assert not (tmp_path / "out").exists()


def test_fp8_dcp_scale_of_the_wrong_shape_refused(tmp_path: Path) -> None:
    src = _source("fp8_qwen2")
    key = "model.layers.0.mlp.down_proj.weight"
    q = json.loads((HF / "fp8_qwen2" / "config.json").read_text())["quantization_config"]
    _save_dcp(tmp_path / "ck", {"model.model.norm.weight": src["model.norm.weight"].float(), f"model.{key}": src[key],
                                f"model.{key}_scale_inv": src[key + "_scale_inv"][:-1].clone(),
                                "quantization_config": q})
    with pytest.raises(QuantizedError, match=rf"tensor '{key}_scale_inv': shape .* in 16 x 32 blocks has"):
        convert(tmp_path / "ck", tmp_path / "out", fmt="dcp", quantize="keep")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("fmt", "quantize", "match"), [
    ("dcp", "fp8", r"--quantize 'fp8': a DCP target keeps a quantized source's weights as it stores them"),
    ("universal", "keep", r"--quantize goes with .*not with a universal checkpoint"),
])
def test_refused_before_any_output(tmp_path: Path, fmt: str, quantize: str, match: str) -> None:
    with pytest.raises(ReshardError, match=match):
        convert(HF / "fp8_qwen2", tmp_path / "out", fmt=fmt, quantize=quantize)
    assert not (tmp_path / "out").exists()


def test_block_with_keep_refused(tmp_path: Path) -> None:
    with pytest.raises(ReshardError, match=r"--block goes with --quantize fp8 or fp8-ue8m0"):
        convert(HF / "fp8_qwen2", tmp_path / "out", fmt="hf", quantize="keep", block=(16, 32))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["fp8_qwen2", "mxfp4_gpt_oss"])
def test_kept_dcp_laid_out_again_keeps_the_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """A kept DCP laid out again for 2 loading ranks (its own entries, as stored) and written to HF:
    the source's bytes."""
    _never_decoded(monkeypatch)
    reshard(HF / name, tmp_path / "a", to="dcp", files=3, quantize="keep")
    reshard(tmp_path / "a" / name, tmp_path / "b", to="dcp", files=2)
    convert(tmp_path / "b" / name, tmp_path / "hf", fmt="hf", quantize="keep", hf_config=HF / name)
    src, got = _source(name), _tensors(tmp_path / "hf")
    assert sorted(got) == sorted(src) and all(_same(got[k], v) for k, v in src.items())


def test_mxfp4_experts_split_whole_over_the_loading_ranks(tmp_path: Path) -> None:
    """``--files 2``: each MXFP4 ``_blocks`` / ``_scales`` entry is cut on dim 0, the experts (2 of the 4
    each), never inside a 32-value block (dims 2 and 3 whole), as torch's metadata records it."""
    reshard(HF / "mxfp4_gpt_oss", tmp_path / "dcp", to="dcp", files=2, quantize="keep")
    md = dcp.FileSystemReader(str(tmp_path / "dcp" / "mxfp4_gpt_oss")).read_metadata()
    packed = {k: v for k, v in md.state_dict_metadata.items() if k.endswith(("_blocks", "_scales"))}
    assert len(packed) == 8
    for key, entry in packed.items():
        chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks)
        shape = tuple(entry.size)
        assert shape[0] == 4 and chunks == [((0,) * len(shape), (2, *shape[1:])),
                                            ((2,) + (0,) * (len(shape) - 1), (2, *shape[1:]))], key


def test_cli(tmp_path: Path) -> None:
    """``reshard reshard FP8 OUT --to dcp --files 2 --quantize keep`` writes the kept DCP; ``--quantize fp8``
    there is one line naming why, status 2, no output."""
    import subprocess
    import sys

    run = [sys.executable, "-m", "reshard", "reshard", str(HF / "fp8_qwen2")]
    bad = subprocess.run([*run, str(tmp_path / "bad"), "--to", "dcp", "--files", "2", "--quantize", "fp8"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "a DCP target keeps a quantized source's weights" in bad.stderr
    assert not (tmp_path / "bad").exists()
    good = subprocess.run([*run, str(tmp_path / "good"), "--to", "dcp", "--files", "2", "--quantize", "keep"],
                          capture_output=True, text=True)
    assert good.returncode == 0, good.stderr
    assert "14 weights kept quantized as the source stores them" in good.stdout
    md = dcp.FileSystemReader(str(tmp_path / "good" / "fp8_qwen2")).read_metadata()
    assert md.state_dict_metadata["model.model.layers.0.mlp.down_proj.weight"].properties.dtype == torch.float8_e4m3fn
