"""Hugging Face at both ends for Megatron MoE models (issue 35 item 3, Qwen-MoE shaped): a Megatron
checkpoint with experts exports to the folder ``from_pretrained`` loads as it stands --
Qwen3-MoE (QK layer norms, a dense layer among MoE ones: ``mlp_only_layers``), Qwen2-MoE (a shared
expert and its sigmoid gate, q/k/v biases, ``norm_topk_prob`` off) or Mixtral -- with every weight
Megatron's own TP=1 reload mapped by ``llama.json`` and logits equal to Megatron's forward; the
export imported into Megatron at TP x EP (x PP) holds Megatron's weights again and exports back
bit for bit; router settings no such HF model computes are refused by name, before any output."""

from __future__ import annotations

import argparse
import copy

import pytest
import torch

from reshard.errors import ReshardError
from reshard.formats.megatron.hfconfig import args_from_hf, hf_config
from reshard.formats.megatron.hfmap import hf_params
from reshard.formats.megatron.reader import MegatronReader
from reshard.jobs.convert import convert, reshard

from .support import FIXTURES, full, oracle

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402  (after the skip: transformers brings it)

# as test_hf: two fp32 implementations of one function (measured here: <= 1.2e-7 on these fixtures)
LOGITS_ATOL = 1e-5

QWEN3_MOE, QWEN2_MOE = "torch_dist_moe_tp2_ep2_qk_layernorm", "torch_dist_moe_ep2_shared_softmax"
DEEPSEEK_V3 = "torch_dist_deepseek_v3_tp2_ep2"
ARCHS = {QWEN3_MOE: "Qwen3MoeForCausalLM", QWEN2_MOE: "Qwen2MoeForCausalLM", "torch_dist_moe_ep2": "MixtralForCausalLM"}


def _oracle_keys(fixture: str) -> dict[str, torch.Tensor]:
    """Megatron's TP=1 reload as full key tensors (``full(key)[index] == model[name]``)."""
    model, _, _, info = oracle(fixture)
    out: dict[str, torch.Tensor] = {}
    for name, (key, idx) in info["names"].items():
        shape = tuple(info["key_shapes"][key]) if "key_shapes" in info else None
        if key not in out:
            out[key] = torch.zeros(shape or (*[0] * len(idx), *model[name].shape), dtype=model[name].dtype)
        out[key][tuple(idx)] = model[name]
    return out


def _mapped_oracle(fixture: str, reader: MegatronReader) -> dict[str, torch.Tensor]:
    """Every HF tensor cut from Megatron's own reload by the document's blocks (valid rows)."""
    keys = _oracle_keys(fixture)
    out = {}
    for p in hf_params(reader.arch):
        t = torch.zeros(p.shape, dtype=keys[p.key].dtype)
        for b in p.blocks:
            src = keys[p.key][tuple(slice(s, s + n) for s, n in zip(b.start, b.size))]
            src = src.reshape(b.size[b.fixed:])
            t[tuple(slice(h, h + n) for h, n in zip(b.hf_start, b.size[b.fixed:]))] = src
        out[p.name] = t[tuple(slice(0, n) for n in p.valid)]
    return out


@pytest.mark.parametrize("fixture", [QWEN3_MOE, QWEN2_MOE])
def test_qwen_moe_export_loads_with_oracle_weights_and_megatron_logits(tmp_path, fixture):
    folder = convert(FIXTURES / fixture, tmp_path / "hf", fmt="hf").out_dir
    reader = MegatronReader.open(FIXTURES / fixture, names="hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert type(model).__name__ == ARCHS[fixture]
    cfg = model.config
    assert cfg.mlp_only_layers == [0] and cfg.num_experts == 4 and cfg.num_experts_per_tok == 2
    assert type(model.model.layers[0].mlp).__name__.endswith("MLP")  # the dense layer 0
    assert cfg.norm_topk_prob == (fixture == QWEN3_MOE)  # QWEN2_MOE: --moe-router-pre-softmax
    sd = model.state_dict()
    written = load_file(str(folder / "model.safetensors"))
    want = _mapped_oracle(fixture, reader)
    assert set(written) == set(want) == {k for k in sd if "rotary" not in k}
    for k, v in written.items():
        assert torch.equal(sd[k], v) and torch.equal(v, want[k]), k
    if fixture == QWEN2_MOE:
        assert "model.layers.1.mlp.shared_expert_gate.weight" in written and cfg.qkv_bias
    else:
        assert "model.layers.1.self_attn.q_norm.weight" in written
    fwd = oracle(fixture)[2]
    model.eval()
    with torch.no_grad():
        logits = model(fwd["input_ids"]).logits
    diff = float((logits - fwd["logits"][..., :reader.arch.vocab]).abs().max())
    assert diff < LOGITS_ATOL, diff


def _weights_equal_oracle(mg, fixture: str) -> int:
    """The imported checkpoint (Megatron names) holds Megatron's own reload of ``fixture``, the
    padded vocabulary compared on its valid rows."""
    r = MegatronReader.open(mg)
    keys = _oracle_keys(fixture)
    for key, want in keys.items():
        got = full(r, key, "weight")
        if key in ("embedding.word_embeddings.weight", "output_layer.weight"):
            got, want = got[:r.arch.vocab], want[:r.arch.vocab]
        assert got.dtype == want.dtype and torch.equal(got, want), key
    return len(keys)


@pytest.mark.parametrize("fixture,topology", [
    (QWEN3_MOE, dict(tp=2, pp=2, dp=2, ep=2)),  # expert TP = TP 2: ETP x EP = 4 over TP x DP
    (QWEN2_MOE, dict(tp=2, pp=1, dp=1, ep=2, etp=1)),  # MoE parallel folding
    ("torch_dist_moe_ep2", dict(tp=2, pp=2, dp=2, ep=2)),  # Mixtral
], ids=["qwen3_moe-tp2pp2ep2", "qwen2_moe-tp2ep2etp1", "mixtral-tp2pp2ep2"])
def test_moe_export_imports_into_megatron_and_back_bit_exact(tmp_path, fixture, topology):
    folder = convert(FIXTURES / fixture, tmp_path / "hf", fmt="hf").out_dir
    mg = reshard(folder, tmp_path / "mg", to="megatron", **topology).out_dir
    r = MegatronReader.open(mg)
    a = r.arch
    assert (a.tp, a.pp, a.ep, a.etp) == (topology["tp"], topology["pp"], topology["ep"], topology.get("etp", topology["tp"]))
    assert _weights_equal_oracle(mg, fixture) >= 10
    assert r.hf_config()["architectures"] == [ARCHS[fixture]]
    back = convert(mg, tmp_path / "back", fmt="safetensors").out_dir
    x, y = load_file(str(folder / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert set(x) == set(y)
    for k in x:
        assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), k


# -- refusals: router settings and parts no Mixtral / Qwen-MoE model computes -----------------------


@pytest.mark.parametrize("fixture", ["torch_dist_moe_tp2_ep2_shared_distopt", "torch_dist_moe_ep2_shared_bf16"])
def test_sigmoid_router_with_expert_bias_export_is_refused_by_name(tmp_path, fixture):
    with pytest.raises(ReshardError, match="expert_bias"):
        convert(FIXTURES / fixture, tmp_path / "hf", fmt="hf")
    assert not (tmp_path / "hf").exists()


def _args(fixture: str, **changes) -> tuple[argparse.Namespace, object]:
    r = MegatronReader.open(FIXTURES / fixture)
    args = copy.copy(r.args)
    for k, v in changes.items():
        setattr(args, k, v)
    return args, r.arch


@pytest.mark.parametrize("change,match", [
    (dict(moe_router_score_function="sigmoid"), "moe_router_score_function"),
    (dict(moe_router_topk_scaling_factor=2.5), "moe_router_topk_scaling_factor"),
    (dict(moe_router_num_groups=2), "moe_router_num_groups"),
    (dict(moe_expert_capacity_factor=1.0), "moe_expert_capacity_factor"),
    (dict(moe_input_jitter_eps=0.01), "moe_input_jitter_eps"),
    (dict(moe_router_pre_softmax=True), "moe_router_pre_softmax"),  # Mixtral always renormalises
    (dict(moe_router_load_balancing_type="sinkhorn"), "moe_router_load_balancing_type"),
])
def test_router_settings_hf_would_compute_differently_are_refused(change, match):
    args, arch = _args("torch_dist_moe_ep2", **change)
    with pytest.raises(ReshardError, match=match):
        hf_config(args, arch, torch.float32)


def test_shared_expert_without_gate_and_mixed_mixtral_are_refused():
    import dataclasses

    args, arch = _args(QWEN2_MOE)
    with pytest.raises(ReshardError, match="moe_shared_expert_gate"):
        hf_config(args, dataclasses.replace(arch, shared_gate=False), torch.float32)
    args, arch = _args(QWEN3_MOE)
    with pytest.raises(ReshardError, match="moe_layer_freq"):  # no QK norms, no shared expert: Mixtral has no dense layers
        hf_config(args, dataclasses.replace(arch, qk_norm=False), torch.float32)


def test_qwen_moe_config_imports_its_dense_layers_and_router():
    cfg = {"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"], "num_hidden_layers": 4,
           "hidden_size": 24, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 10,
           "intermediate_size": 36, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 28,
           "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": False, "decoder_sparse_step": 2,
           "mlp_only_layers": [3], "vocab_size": 120}
    args = args_from_hf(cfg, tp=1, pp=1, dp=2, ep=2, dtype=torch.float32)
    # HF: layer i sparse iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
    assert args.moe_layer_freq == [0, 1, 0, 0] and args.moe_router_pre_softmax and args.moe_shared_expert_gate
    assert args.add_qkv_bias and args.expert_model_parallel_size == 2
    with pytest.raises(ReshardError, match="no experts"):
        args_from_hf(dict(cfg, model_type="qwen2"), tp=1, pp=1, dp=2, ep=2, dtype=torch.float32)


def _saved(tmp_path, kind: str):
    """A tiny random model of ``kind`` saved by transformers' own ``save_pretrained`` (each
    expert's tensors apart, as on the Hub)."""
    common = dict(vocab_size=96, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, num_experts_per_tok=2)
    cfg = {"qwen3_moe": lambda: transformers.Qwen3MoeConfig(**common, intermediate_size=24, moe_intermediate_size=8,
                                                            num_experts=4, mlp_only_layers=[0], norm_topk_prob=True),
           "mixtral": lambda: transformers.MixtralConfig(**common, intermediate_size=8, num_local_experts=4),
           "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**common, intermediate_size=24, moe_intermediate_size=8,
                                                            shared_expert_intermediate_size=12, num_experts=4,
                                                            decoder_sparse_step=2)}[kind]()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(tmp_path / kind)
    return model, tmp_path / kind


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_save_pretrained_moe_folder_imports_at_tp_ep_pp_and_exports_back(tmp_path, kind):
    """A folder as transformers writes it (per-expert tensors: the document llama_hub_experts.json)
    imported at TP2 x PP2 x EP2 x DP2 and exported again (fused experts): the model transformers
    loads holds the same tensors and gives the same logits, bit for bit."""
    model, src = _saved(tmp_path, kind)
    assert any(".experts.0." in k for k in load_file(str(src / "model.safetensors")))
    mg = reshard(src, tmp_path / "mg", to="megatron", tp=2, pp=2, dp=2, ep=2).out_dir
    a = MegatronReader.open(mg).arch
    assert (a.tp, a.pp, a.ep, a.experts) == (2, 2, 2, 4)
    assert a.moe_layers == ((True, True) if kind == "mixtral" else (False, True))
    back = transformers.AutoModelForCausalLM.from_pretrained(convert(mg, tmp_path / "hf", fmt="hf").out_dir).eval()
    assert type(back) is type(model)
    want, got = model.state_dict(), back.state_dict()
    assert set(want) == set(got)
    for k in want:
        assert torch.equal(want[k], got[k]), k
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, back(ids).logits)


# (fixture, via): DeepSeek-V3 MoE (MLA, TP2 x EP2 x expert TP1, a dense layer, a shared expert, the sigmoid
# router's expert bias: a buffer, compared as a weight), Qwen3-MoE (TP2 x EP2 x expert TP1, a dense layer, QK norms), Qwen2-MoE (EP2 x DP2, a shared
# expert and its gate, q/k/v biases), Mixtral-like (EP2 x DP2, every layer MoE: stacked expert keys)
MOE_VIA = [(DEEPSEEK_V3, "dcp"), (DEEPSEEK_V3, "universal"), (QWEN3_MOE, "dcp"), pytest.param(QWEN3_MOE, "universal", marks=pytest.mark.slow),  # universal: ~6 s
           (QWEN2_MOE, "dcp"), ("torch_dist_moe_ep2", "universal"),
           pytest.param(QWEN2_MOE, "universal", marks=pytest.mark.slow), pytest.param("torch_dist_moe_ep2", "dcp",
                                                                                     marks=pytest.mark.slow)]


@pytest.mark.parametrize("fixture,via", MOE_VIA)
def test_megatron_moe_to_dcp_or_universal_and_back_keeps_weights_and_moments(tmp_path, fixture, via):
    """Cross-framework: a Megatron MoE checkpoint to DCP / a universal checkpoint (HF names) and
    back to Megatron at its own TP x EP x expert TP x DP with plain Adam (``--hf-config``: the
    export's config.json): every weight and Adam moment equals Megatron's own reload of the source
    (the padded vocabulary on its valid rows: HF names hold only those); DeepSeek-V3's expert bias,
    a buffer without moments, comes back equal and non-zero."""
    from .support import STATES

    a = MegatronReader.open(FIXTURES / fixture).arch
    hf = convert(FIXTURES / fixture, tmp_path / "hf", fmt="hf").out_dir
    mid = convert(FIXTURES / fixture, tmp_path / via, fmt=via, names="hf").out_dir
    back = reshard(mid, tmp_path / "back", to="megatron", tp=a.tp, dp=a.dp, ep=a.ep, etp=a.etp, optimizer="adam",
                   hf_config=hf).out_dir
    r = MegatronReader.open(back)
    assert (r.arch.tp, r.arch.dp, r.arch.ep, r.arch.etp, r.arch.experts) == (a.tp, a.dp, a.ep, a.etp, a.experts)
    model, optim, _, info = oracle(fixture)
    n = 0
    for name, (key, idx) in info["names"].items():
        for state, prefix in STATES[:3]:
            if prefix is not None and name.endswith(".expert_bias"):  # a buffer: no moments
                continue
            want = model[name] if prefix is None else optim[prefix + name]
            got = full(r, key, state)[tuple(idx)]
            if key in ("embedding.word_embeddings.weight", "output_layer.weight"):
                got, want = got[:r.arch.vocab], want[:r.arch.vocab]
            assert got.dtype == want.dtype and torch.equal(got, want), (name, state)
            n += 1
    buffers = sum(name.endswith(".expert_bias") for name in info["names"])
    assert n == 3 * len(info["names"]) - 2 * buffers
    assert any(".local_experts." in name for name in info["names"])  # the experts' weights and moments among them
    if fixture == DEEPSEEK_V3:  # the expert bias came back (non-zero, fp32), not re-initialised
        assert buffers == 1 and bool(full(r, "decoder.layers.1.mlp.router.expert_bias", "weight").ne(0).all())


@pytest.mark.parametrize("via", ["dcp", "universal"])
def test_a_shared_expert_gate_deepseek_v3_has_no_name_for_is_refused_on_the_way_out(tmp_path, via):
    """MLA + MoE with a shared-expert gate (``torch_dist_mla_moe_tp2_ep2``): DeepseekV3 has no
    such gate, so HF names -- which DCP and universal need to come back -- are refused naming the
    key, before any output; the gate is never dropped."""
    from reshard.errors import CheckpointError

    with pytest.raises(CheckpointError, match=r"'decoder\.layers\.1\.mlp\.shared_experts\.gate_weight'.*"
                                              r"deepseek_v3\.json has no Hugging Face name"):
        convert(FIXTURES / "torch_dist_mla_moe_tp2_ep2", tmp_path / via, fmt=via, names="hf")
    assert not (tmp_path / via).exists()


def test_a_universal_expert_bias_is_a_buffer_and_a_missing_moment_is_still_refused(tmp_path):
    """The DeepSeek-V3 expert bias goes to a universal checkpoint as ``fp32.pt`` alone (no optimizer
    state; the model states name it in ``buffer_names``) and reads back; a weight whose moment file
    is deleted is still refused as a missing file."""
    from reshard.errors import CheckpointError
    from reshard.formats.registry import open_reader

    out = convert(FIXTURES / DEEPSEEK_V3, tmp_path / "ucp", fmt="universal", names="hf").out_dir
    zero = out / "zero"
    assert sorted(f.name for f in (zero / "model.layers.1.mlp.gate.e_score_correction_bias").iterdir()) == ["fp32.pt"]
    open_reader(out).check()
    (zero / "model.layers.1.mlp.gate.weight" / "exp_avg.pt").unlink()
    with pytest.raises(CheckpointError, match=r"parameters hold different optimizer states.*a file is missing"):
        open_reader(out).check()


def test_hf_moe_import_refuses_a_tensor_it_has_no_key_for(tmp_path):
    """Every source tensor accounted for: a planted router bias (DeepSeek's name) in a Qwen3-MoE
    folder has no Megatron key in the document, so the import is refused naming it, before any
    output -- not dropped."""
    from safetensors.torch import save_file

    _, src = _saved(tmp_path, "qwen3_moe")
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.layers.1.mlp.gate.e_score_correction_bias"] = torch.zeros(4)
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ReshardError, match=r"e_score_correction_bias.*has no Megatron key"):
        reshard(src, tmp_path / "mg", to="megatron", tp=1, ep=2, dp=2)
    assert not (tmp_path / "mg").exists()


def test_hf_moe_import_names_a_missing_expert_tensor(tmp_path):
    from safetensors.torch import save_file

    _, src = _saved(tmp_path, "mixtral")
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ReshardError, match=r"has no 'model.layers.1.block_sparse_moe.experts.3.w3.weight'"):
        reshard(src, tmp_path / "mg", to="megatron", tp=1, ep=2, dp=2)
    assert not (tmp_path / "mg").exists()
