"""Hugging Face at either end: a Megatron checkpoint exported with HF names + ``hf_config()`` is a
model ``transformers`` loads, whose weights are Megatron's de-interleaved and whose logits are
Megatron's; an HF ``save_pretrained`` folder imported into Megatron and exported again is
bit-identical."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from reshard.formats.megatron.reader import MegatronReader
from reshard.formats.registry import open_reader
from reshard.jobs.convert import convert, reshard

from .support import FIXTURES, HF_FIXTURES, oracle

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402  (after the skip: transformers brings it)

# fp32 forward passes of one function by two implementations: Megatron's and transformers'
# attention and MLP kernels sum in different orders, which moves logits by a few ulp of their
# ~1-10 magnitude (the fixtures' own cross-check saw 4e-8..9e-8); 1e-5 leaves room for that and
# nothing else (a wrong head or a swapped gate/up half moves them by ~1e-1).
LOGITS_ATOL = 1e-5


def _export(fixture: str, out) -> tuple:
    """``--format hf``: the folder as the command writes it, config.json built from Megatron's args."""
    report = convert(FIXTURES / fixture, out / "hf", fmt="hf")
    assert (report.out_dir / "config.json").is_file()
    return report.out_dir, MegatronReader.open(FIXTURES / fixture, names="hf")


@pytest.mark.parametrize("fixture", ["torch_dist_tp2_pp2", "legacy_tp2_pp2", "torch_dist_tp2_dp2_distopt",
                                     "torch_dist_moe_ep2", "torch_dist_pp2_vpp2", "torch_dist_pp2_uneven",
                                     "legacy_pp2_vpp2", "torch_dist_tp2_qk_layernorm", "torch_dist_tp2_mla",
                                     "torch_dist_pp2_dp2_tied_distopt"])  # tied: no lm_head.weight written
def test_hf_export_loads_and_gives_megatron_logits(tmp_path, fixture):
    folder, reader = _export(fixture, tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    want = ("DeepseekV3ForCausalLM" if reader.arch.mla else "MixtralForCausalLM" if reader.arch.experts
            else "Qwen3ForCausalLM" if reader.arch.qk_norm else "LlamaForCausalLM")
    assert type(model).__name__ == want
    sd = model.state_dict()
    written = load_file(str(folder / "model.safetensors"))
    tied = bool(model.config.tie_word_embeddings)
    assert tied == reader.arch.tied
    assert set(written) == {k for k in sd if "rotary" not in k and not (tied and k == "lm_head.weight")}
    if tied:
        assert torch.equal(sd["lm_head.weight"], written["model.embed_tokens.weight"])
    for k, v in written.items():
        assert torch.equal(sd[k], v), k
    _, _, fwd, _ = oracle(fixture)
    model.eval()
    with torch.no_grad():
        logits = model(fwd["input_ids"]).logits
    vocab = reader.arch.vocab
    diff = float((logits - fwd["logits"][..., :vocab]).abs().max())
    assert diff < LOGITS_ATOL, diff


def _roundtrip(tmp_path, hf: str, tp: int, pp: int) -> None:
    src = HF_FIXTURES / hf
    mg = reshard(src, tmp_path / "mg", to="megatron", tp=tp, pp=pp).out_dir
    assert (mg / "latest_checkpointed_iteration.txt").read_text() == "release"
    reader = MegatronReader.open(mg)
    assert (reader.arch.tp, reader.arch.pp) == (tp, pp) and reader.iteration is None
    back = convert(mg, tmp_path / "back", fmt="safetensors").out_dir
    a, b = load_file(str(src / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    cfg = json.loads((src / "config.json").read_text())
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    got = open_reader(mg, route="safetensors").hf_config()
    for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
              "vocab_size", "tie_word_embeddings", "num_hidden_layers"):
        assert got[k] == cfg[k], k
    assert got["architectures"] == cfg["architectures"]


def test_hf_llama_megatron_hf_round_trip_is_bit_exact(tmp_path):
    _roundtrip(tmp_path, "pretrained_llama", tp=2, pp=2)  # head_dim 6, 2 KV heads: one group per TP rank


def test_hf_qwen2_tied_round_trip_is_bit_exact(tmp_path):
    _roundtrip(tmp_path, "pretrained_qwen2_tied", tp=2, pp=1)  # q/k/v biases, tied embeddings


def test_qwen3_export_imports_back_bit_exact(tmp_path):
    """QK layer norms at both ends: the Qwen3 export of a Megatron checkpoint, imported into
    Megatron at TP=2 x PP=2 and exported again, is the same folder of tensors."""
    folder, _ = _export("torch_dist_tp2_qk_layernorm", tmp_path)
    mg = reshard(folder, tmp_path / "mg", to="megatron", tp=2, pp=2).out_dir
    r = MegatronReader.open(mg)
    assert r.arch.qk_norm and r.args.qk_layernorm
    back = convert(mg, tmp_path / "back", fmt="safetensors").out_dir
    a, b = load_file(str(folder / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert set(a) == set(b) and any(k.endswith("q_norm.weight") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert r.hf_config()["architectures"] == ["Qwen3ForCausalLM"]


def test_deepseek_v3_export_imports_back_bit_exact(tmp_path):
    """Multi-latent attention at both ends: the DeepseekV3 export of Megatron's MLA checkpoint,
    imported into Megatron at TP=2 x PP=2 (column-parallel down projections, replicated latent
    norms) and exported again, is the same folder of tensors and the same config."""
    folder, _ = _export("torch_dist_tp2_mla", tmp_path)
    mg = reshard(folder, tmp_path / "mg", to="megatron", tp=2, pp=2).out_dir
    r = MegatronReader.open(mg)
    assert r.arch.mla is not None and (r.arch.tp, r.arch.pp) == (2, 2)
    assert r.shape("decoder.layers.self_attention.linear_kv_down_proj.weight") == (2, 18, 24)
    back = convert(mg, tmp_path / "back", fmt="hf").out_dir
    a, b = load_file(str(folder / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert set(a) == set(b) and any(k.endswith("kv_a_proj_with_mqa.weight") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    want = json.loads((folder / "config.json").read_text())
    got = json.loads((back / "config.json").read_text())
    for k in ("architectures", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
              "rope_interleave", "rms_norm_eps", "first_k_dense_replace", "hidden_size", "num_hidden_layers"):
        assert got[k] == want[k], k


def test_hf_deepseek_v3_megatron_hf_round_trip_is_bit_exact(tmp_path):
    """A DeepseekV3 folder transformers wrote (MLA, dense) -> Megatron at TP=2 x PP=2 -> HF: the
    same tensors, and the config's MLA widths kept."""
    src = HF_FIXTURES / "pretrained_deepseek_v3"
    mg = reshard(src, tmp_path / "mg", to="megatron", tp=2, pp=2).out_dir
    r = MegatronReader.open(mg)
    assert r.arch.mla is not None and r.args.q_lora_rank == 16 and r.args.kv_lora_rank == 12
    back = convert(mg, tmp_path / "back", fmt="hf").out_dir
    a, b = load_file(str(src / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    want, got = (json.loads((d / "config.json").read_text()) for d in (src, back))
    for k in ("architectures", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
              "rope_interleave", "rms_norm_eps", "hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"):
        assert got[k] == want[k], k


def test_hf_import_then_megatron_names(tmp_path):
    """The imported checkpoint in Megatron's own names: q/k/v interleaved per query group."""
    src = HF_FIXTURES / "pretrained_llama"
    mg = reshard(src, tmp_path, to="megatron", tp=1, pp=1).out_dir
    r = MegatronReader.open(mg)
    hf = load_file(str(src / "model.safetensors"))
    m = r.map("decoder.layers.self_attention.linear_qkv.weight", "weight")
    qkv = m.rebuild({k: r.fragment("decoder.layers.self_attention.linear_qkv.weight", "weight", k) for k in m.ranks})
    g, h, d = 2, 2, 6
    q = hf["model.layers.1.self_attn.q_proj.weight"].view(g, h * d, -1)
    k = hf["model.layers.1.self_attn.k_proj.weight"].view(g, d, -1)
    v = hf["model.layers.1.self_attn.v_proj.weight"].view(g, d, -1)
    assert torch.equal(qkv[1], torch.cat([q, k, v], 1).reshape(-1, q.shape[-1]))
    assert r.shape("embedding.word_embeddings.weight") == (128, 32)  # padded 128 at TP=1, rows valid


def test_hf_import_without_config_is_refused(tmp_path):
    src = tmp_path / "weights"
    src.mkdir()
    shutil.copy(HF_FIXTURES / "pretrained_llama" / "model.safetensors", src)
    with pytest.raises(Exception, match="config.json"):
        reshard(src, tmp_path / "out", to="megatron")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize("field,value,needle", [
    ("q_lora_rank", None, "q_lora_rank = null"),
    ("rope_interleave", False, "rope_interleave = false"),
    # MoE from layer 1 with this config's 1 expert, top-1, norm_topk_prob (HF's weight 1, Megatron's the raw score)
    ("first_k_dense_replace", 1, "norm_topk_prob = True with num_experts_per_tok = 1"),
    ("rms_norm_eps", 1e-5, "rms_norm_eps = 1e-05"),
])
def test_deepseek_v3_imports_megatron_cannot_compute_are_refused(tmp_path, field, value, needle):
    """A DeepSeek-V3 folder whose function no Megatron MLA model computes is refused by name, before
    any output exists."""
    from reshard.errors import ReshardError

    src = tmp_path / "src"
    shutil.copytree(HF_FIXTURES / "pretrained_deepseek_v3", src, ignore=shutil.ignore_patterns("reference"))
    cfg = json.loads((src / "config.json").read_text())
    cfg[field] = value
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ReshardError, match=needle):
        reshard(src, tmp_path / "out", to="megatron", tp=2)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
