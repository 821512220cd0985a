"""An HF folder's TP layout is transformers' own tensor-parallel plan for its architecture
(``reshard.formats.hf.tp_plan``), so ``reshard reshard HF_FOLDER OUT --tp 2`` needs no ``--layout``.

* The plan lowered to maps cuts every parameter as transformers' own TP load does: one
  ``torchrun`` of 2 gloo ranks on CPU loads the Llama and the tied Qwen2 folder with
  ``from_pretrained(..., distributed_config=DistributedConfig(tp_size=2))`` (``tests/e2e/hf_tp_ref.py``)
  and each rank's local tensors equal the maps' shards bit for bit.
* The DeepSpeed AutoTP checkpoint reshard writes holds, in ``mp_rank_0X_model_states.pt``, those
  same tensors on TP rank X, except where DeepSpeed 0.19.8's AutoTP reads the plan otherwise: an
  untied ``embedding_rowwise`` embedding stays whole (as the committed DeepSpeed fixtures, saved by
  AutoTP with transformers' plan, show: the plan read as DeepSpeed reads it reproduces their maps).
* transformers' own split arithmetic (``torch.chunk`` sizes, the loader's strided slices of packed
  weights) is what the lowering reproduces; missing transformers, an unknown tensor and styles
  DeepSpeed rejects are refused before any output exists.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reshard.errors import ReshardError
from reshard.formats.deepspeed.checkpoint import DeepSpeedCheckpoint
from reshard.formats.deepspeed.target_layout import autotp_plan_maps
from reshard.formats.hf.tp_plan import chunk_sizes, lower, tp_plan, tp_plan_of_config
from reshard.formats.safetensors.reader import SafetensorsReader
from reshard.ir.apply import extract
from reshard.jobs.convert import reshard
from reshard.storage.safe_load import load
from tests.support.paths import DEEPSPEED, HF, REPO

pytest.importorskip("transformers")
FOLDERS = ("pretrained_llama", "pretrained_qwen2_tied")
TORCHRUN = Path(sys.executable).with_name("torchrun")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, list[dict[str, torch.Tensor]]]:
    """transformers' own TP=2 shards of each folder: ``{folder: [rank 0's, rank 1's]}``."""
    out = tmp_path_factory.mktemp("hf_tp_ref")
    cmd = [str(TORCHRUN), "--nproc_per_node=2", f"--master_port={_port()}", str(REPO / "tests/e2e/hf_tp_ref.py"),
           str(out), *(str(HF / f) for f in FOLDERS)]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {f: [torch.load(out / f / f"rank{r}.pt", weights_only=True) for r in range(2)] for f in FOLDERS}


def _weights(folder: str) -> tuple[SafetensorsReader, dict[str, torch.Tensor]]:
    reader = SafetensorsReader(HF / folder)
    return reader, {n: reader.fragment(n, "weight", 0).reshape(reader.shape(n)).clone() for n in reader.names}


@pytest.mark.parametrize("folder", FOLDERS)
def test_the_plan_cuts_every_parameter_as_transformers_loads_it(reference, folder):
    reader, full = _weights(folder)
    shapes = {n: t.shape for n, t in full.items()}
    plan = tp_plan(HF / folder, shapes)
    maps = plan.maps(shapes, 2)
    for r, theirs in enumerate(reference[folder]):
        assert set(theirs) - set(full) == set(plan.tied)  # a tied head is the embedding itself
        for n, t in full.items():
            assert torch.equal(extract(maps[n], t, r), theirs[n]), (n, r)
        for alias, weight in plan.tied.items():
            assert torch.equal(theirs[alias], theirs[weight])
    styles = {p.style for p in plan.params.values()}
    assert {"colwise", "rowwise", "embedding_rowwise", None} <= styles


@pytest.mark.parametrize("folder", FOLDERS)
def test_reshard_to_deepspeed_tp2_writes_transformers_shards(reference, folder, tmp_path):
    reader, full = _weights(folder)
    report = reshard(HF / folder, tmp_path / "out", tp=2)
    assert any("transformers' tensor-parallel plan for" in n for n in report.notes)
    tag = next(p for p in (tmp_path / "out").iterdir() if p.is_dir())
    tied = reader.tied()
    for r, theirs in enumerate(reference[folder]):
        module = load(tag / f"mp_rank_0{r}_model_states.pt")["module"]
        assert set(module) == set(full) | set(tied)
        for n, t in module.items():
            if n == "model.embed_tokens.weight" and not tied:
                # AutoTP keeps an untied embedding whole (TPPlanConverter: embedding_rowwise -> skip)
                assert torch.equal(t, full[n]), (n, r)
            else:
                assert torch.equal(t, theirs[n]), (n, r)


@pytest.mark.parametrize("fixture", ["llama_tp2", "qwen2_tp2"])
def test_the_plan_as_deepspeed_reads_it_is_the_layout_autotp_saved(fixture):
    """The committed DeepSpeed checkpoints were saved by AutoTP with transformers' plan."""
    ck = DeepSpeedCheckpoint.open(DEEPSPEED / fixture)
    config = json.loads((DEEPSPEED / fixture / "fixture.json").read_text())["model_config_full"]
    shapes = {n: tuple(ck.tp_map(n).map.valid_shape) for n in ck.names}
    maps = autotp_plan_maps(tp_plan_of_config(config, shapes, fixture), shapes, 2, config, fixture)
    for n in ck.names:
        f = torch.arange(torch.Size(shapes[n]).numel(), dtype=torch.float32).reshape(shapes[n])
        for r in range(2):
            assert torch.equal(extract(maps[n], f, r), extract(ck.tp_map(n).map, f, r)), (fixture, n, r)


def test_split_sizes_are_transformers_own():
    from torch.distributed.tensor.placement_types import Shard
    from transformers.distributed.sharding_utils import DtensorShardOperation

    for total in range(0, 23):
        for tp in (1, 2, 3, 4, 5):
            want = [Shard.local_shard_size_and_offset(total, tp, r)[0] for r in range(tp)]
            assert chunk_sizes(total, tp) == want, (total, tp)
            for sf in (2, 3):  # packed_colwise / packed_rowwise: the loader's strided slices
                shape = (3, total, 2)
                m = lower(("strided", 1, sf), shape, tp)
                f = torch.arange(torch.Size(shape).numel()).reshape(shape)
                for r in range(tp):
                    spans = DtensorShardOperation._compute_strided_slice(None, [(0, total)], r, tp, sf)
                    theirs = torch.cat([f[:, a:b] for a, b in spans], 1) if spans else f[:, :0]
                    assert torch.equal(extract(m, f, r), theirs), (total, tp, sf, r)


def test_without_transformers_the_folder_is_refused_by_name(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    with pytest.raises(ReshardError, match="transformers is not installed"):
        reshard(HF / "pretrained_llama", tmp_path / "out", tp=2)
    assert not (tmp_path / "out").exists()


def test_a_tensor_the_model_does_not_have_is_refused(tmp_path):
    from safetensors.torch import save_file

    _, full = _weights("pretrained_llama")
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "config.json").write_bytes((HF / "pretrained_llama" / "config.json").read_bytes())
    save_file({**full, "model.layers.0.mlp.extra.weight": torch.zeros(2, 2)}, folder / "model.safetensors")
    with pytest.raises(ReshardError, match=r"'model\.layers\.0\.mlp\.extra\.weight' is not one of its parameters"):
        reshard(folder, tmp_path / "out", tp=2)
    assert not (tmp_path / "out").exists()


def test_styles_deepspeed_rejects_and_architectures_without_plan_are_refused():
    phi3 = {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
            "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 64,
            "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    plan = tp_plan_of_config(phi3, {}, "phi3")
    assert plan.plan["model.layers.*.self_attn.qkv_proj"] == "colwise_gather_output"  # fused: cut as one
    with pytest.raises(ReshardError, match="rowwise_split_input.*DeepSpeed 0.19.8's AutoTP rejects"):
        autotp_plan_maps(plan, {}, 2, phi3, "phi3")
    gpt2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 32, "n_head": 4, "n_layer": 1,
            "vocab_size": 64, "bos_token_id": 1, "eos_token_id": 2}
    with pytest.raises(ReshardError, match="no tensor-parallel plan for GPT2LMHeadModel"):
        tp_plan_of_config(gpt2, {}, "gpt2")
