"""Hugging Face at both ends for DeepSeek-V3-shaped Megatron MoE (issue 35 item 3): multi-latent
attention with a dense first layer and MoE after it -- a sigmoid router with an expert bias,
group-limited routing, scaled routing weights, shared experts without a gate -- exports through
``deepseek_v3.json`` to the folder ``DeepseekV3ForCausalLM.from_pretrained`` loads as it stands, with
every weight (the expert bias included, ``e_score_correction_bias``) Megatron's own TP=1 reload and
logits equal to Megatron's forward; a wrong router moves those logits; the export and a folder
transformers' ``save_pretrained`` wrote import into Megatron at TP x EP (x PP) and export back bit for
bit; router settings DeepseekV3 computes otherwise are refused by name, before any output."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from reshard.errors import ReshardError
from reshard.formats.megatron.hfconfig import args_from_hf, hf_config
from reshard.formats.megatron.reader import MegatronReader
from reshard.jobs.convert import convert, reshard

from .support import FIXTURES, oracle
from .test_hf_moe import _mapped_oracle, _weights_equal_oracle

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402  (after the skip: transformers brings it)

DSV3 = "torch_dist_deepseek_v3_tp2_ep2"
# as test_hf: two fp32 implementations of one function (measured on this fixture: 6e-8)
LOGITS_ATOL = 1e-5
BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The fixture's HF export (written once for the tests here)."""
    return convert(FIXTURES / DSV3, tmp_path_factory.mktemp("dsv3") / "hf", fmt="hf").out_dir


def _load(folder):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    return model.eval(), info


def _logits_diff(model) -> float:
    fwd = oracle(DSV3)[2]
    with torch.no_grad():
        logits = model(fwd["input_ids"]).logits
    return float((logits - fwd["logits"][..., :logits.shape[-1]]).abs().max())


def test_deepseek_v3_moe_export_loads_with_oracle_weights_and_megatron_logits(exported):
    folder = exported
    model, info = _load(folder)
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    cfg = model.config
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.n_shared_experts) == (8, 2, 8, 2)
    assert (cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor, cfg.norm_topk_prob) == (2, 1, 2.5, True)
    assert cfg.first_k_dense_replace == 1 and cfg.scoring_func == "sigmoid"
    assert type(model.model.layers[0].mlp).__name__ == "DeepseekV3MLP"
    assert type(model.model.layers[1].mlp).__name__ == "DeepseekV3MoE"
    sd = model.state_dict()
    written = load_file(str(folder / "model.safetensors"))
    want = _mapped_oracle(DSV3, MegatronReader.open(FIXTURES / DSV3, names="hf"))
    assert set(written) == set(want) == {k for k in sd if "rotary" not in k}
    for k, v in written.items():
        assert torch.equal(sd[k], v) and torch.equal(v, want[k]), k
    # the expert bias is carried: Megatron's buffer, non-zero, fp32 (Megatron-Bridge#4199 left it at zero)
    bias = written[BIAS]
    assert bias.dtype == torch.float32 and bool((bias != 0).all())
    assert torch.equal(bias, oracle(DSV3)[0]["decoder.layers.1.mlp.router.expert_bias"])
    diff = _logits_diff(model)
    print(f"{DSV3}: DeepseekV3ForCausalLM vs Megatron's forward: max |diff| {diff:.1e}")
    assert diff < LOGITS_ATOL, diff


def test_a_bf16_export_keeps_the_expert_bias_float32(tmp_path):
    """``--dtype bf16`` casts the weights, not what DeepseekV3 computes in float32 whatever it loads in
    (transformers' ``_keep_in_fp32_modules_strict``: the router's weight and bias): the expert bias stays Megatron's fp32 buffer bit
    for bit, as DeepSeek-V3's release stores it (a bf16 copy would move the routing)."""
    folder = convert(FIXTURES / DSV3, tmp_path / "hf", fmt="hf", dtype=torch.bfloat16).out_dir
    written = load_file(str(folder / "model.safetensors"))
    assert written[BIAS].dtype == torch.float32
    assert torch.equal(written[BIAS], oracle(DSV3)[0]["decoder.layers.1.mlp.router.expert_bias"])
    kept = {BIAS, "model.layers.1.mlp.gate.weight"}  # DeepseekV3's router weight too (this fixture: fp32)
    assert {k for k, v in written.items() if v.dtype == torch.float32} == kept
    assert {v.dtype for k, v in written.items() if k not in kept} == {torch.bfloat16}  # the rest cast as asked
    model, info = _load(folder)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert torch.equal(model.model.layers[1].mlp.gate.e_score_correction_bias, written[BIAS])


@pytest.mark.parametrize("wrong", ["zero expert bias", "norm_topk_prob off", "routed_scaling_factor 1",
                                   "no group limit"])
def test_a_wrong_router_moves_the_logits(exported, wrong):
    """The logits check sees the router: each setting changed alone moves them far past LOGITS_ATOL."""
    model, _ = _load(exported)
    gate = model.model.layers[1].mlp.gate
    if wrong == "zero expert bias":
        gate.e_score_correction_bias.zero_()
    elif wrong == "norm_topk_prob off":
        gate.norm_topk_prob = False
    elif wrong == "routed_scaling_factor 1":
        gate.routed_scaling_factor = 1.0
    else:
        gate.topk_group = gate.num_group
    diff = _logits_diff(model)
    print(f"{wrong}: max |diff| {diff:.1e}")
    assert diff > 10 * LOGITS_ATOL, diff


@pytest.mark.parametrize("topology", [dict(tp=2, pp=1, dp=1, ep=2, etp=1), dict(tp=1, pp=2, dp=2, ep=2)],
                         ids=["tp2ep2etp1", "pp2ep2dp2"])
def test_deepseek_v3_moe_export_imports_into_megatron_and_back_bit_exact(tmp_path, exported, topology):
    folder = exported
    mg = reshard(folder, tmp_path / "mg", to="megatron", **topology).out_dir
    r = MegatronReader.open(mg)
    a = r.arch
    assert (a.tp, a.pp, a.ep, a.etp) == (topology["tp"], topology["pp"], topology["ep"], topology.get("etp", topology["tp"]))
    assert a.mla is not None and a.expert_bias and a.moe_layers == (False, True) and not a.shared_gate
    assert (r.args.moe_router_num_groups, r.args.moe_router_group_topk, r.args.moe_router_topk_scaling_factor) == (2, 1, 2.5)
    assert _weights_equal_oracle(mg, DSV3) >= 15  # the expert bias among them
    back = convert(mg, tmp_path / "back", fmt="hf").out_dir
    x, y = load_file(str(folder / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert set(x) == set(y) and BIAS in x
    for k in x:
        assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), k
    want, got = (json.loads((d / "config.json").read_text()) for d in (folder, back))
    for k in ("architectures", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
              "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob", "first_k_dense_replace",
              "q_lora_rank", "kv_lora_rank", "intermediate_size"):
        assert got[k] == want[k], k


def _saved(tmp_path, **changes):
    """A tiny random DeepSeek-V3 MoE saved by transformers' own ``save_pretrained`` (each expert's
    tensors apart, as on the Hub), its expert bias set non-zero."""
    cfg = transformers.DeepseekV3Config(**{**dict(
        vocab_size=96, hidden_size=16, intermediate_size=20, moe_intermediate_size=8,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, kv_lora_rank=8, q_lora_rank=12, qk_rope_head_dim=4, v_head_dim=5,
        qk_nope_head_dim=6, first_k_dense_replace=1, max_position_embeddings=64, num_hidden_layers=4), **changes})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    model.save_pretrained(tmp_path / "src")
    return model, tmp_path / "src"


def test_save_pretrained_deepseek_v3_moe_folder_imports_at_tp_ep_pp_and_exports_back(tmp_path):
    """transformers' layout (per-expert tensors: ``deepseek_v3_hub_experts.json``) -> Megatron at
    TP2 x PP2 x EP2 x DP2 -> HF (fused experts): the model transformers loads holds the same tensors
    and gives the same logits, bit for bit."""
    model, src = _saved(tmp_path)
    assert any(".experts.0.gate_proj" in k for k in load_file(str(src / "model.safetensors")))
    mg = reshard(src, tmp_path / "mg", to="megatron", tp=2, pp=2, dp=2, ep=2).out_dir
    r = MegatronReader.open(mg)
    assert (r.arch.tp, r.arch.pp, r.arch.ep, r.arch.experts, r.arch.moe_layers) == (2, 2, 2, 8, (False, True, True, True))
    assert (r.args.moe_router_num_groups, r.args.moe_router_group_topk) == (4, 2)
    back, info = transformers.AutoModelForCausalLM.from_pretrained(convert(mg, tmp_path / "hf", fmt="hf").out_dir,
                                                                   output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    want, got = model.state_dict(), back.eval().state_dict()
    assert set(want) == set(got)
    for k in want:
        assert torch.equal(want[k], got[k]), k
    # the same logits, bit for bit, once each weight sits in memory of its own: from_pretrained leaves them
    # in the file's mapping, where a tensor's address follows its file offset, and the CPU kernels sum in an
    # order that follows the address's alignment (measured here: 7e-9 apart before the copy, 0 after)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for p in back.parameters():
            p.data = p.data.clone()
        assert torch.equal(model(ids).logits, back(ids).logits)


def test_hf_deepseek_v3_mtp_tensors_are_refused_unless_dropped(tmp_path):
    """transformers' DeepseekV3 holds no multi-token-prediction layers (the Hub's
    ``model.layers.<num_hidden_layers>.*``): such tensors have no Megatron key, so the import is
    refused naming one, before any output -- or, with ``--drop``, left out and reported."""
    _, src = _saved(tmp_path)
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.layers.4.eh_proj.weight"] = torch.zeros(16, 32)
    tensors["model.layers.4.enorm.weight"] = torch.ones(16)
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ReshardError, match=r"model\.layers\.4\.e.*has no Megatron key"):
        reshard(src, tmp_path / "mg", to="megatron", tp=1, ep=2, dp=2)
    assert not (tmp_path / "mg").exists()
    report = reshard(src, tmp_path / "mg", to="megatron", tp=1, ep=2, dp=2, drop=[r"^model\.layers\.4\."])
    for name in ("model.layers.4.eh_proj.weight", "model.layers.4.enorm.weight"):
        assert any(name in str(d) for d in report.dropped), name


# -- refusals: what DeepseekV3 computes otherwise ---------------------------------------------------


def _args(fixture: str = DSV3, **changes):
    r = MegatronReader.open(FIXTURES / fixture)
    args = copy.copy(r.args)
    for k, v in changes.items():
        setattr(args, k, v)
    return args, r.arch


@pytest.mark.parametrize("change,match", [
    (dict(moe_router_score_function="softmax"), "moe_router_score_function"),
    (dict(moe_router_group_topk=2, moe_router_num_groups=2), "moe_router_group_topk"),  # groups by their top 1
    (dict(moe_router_load_balancing_type="sinkhorn"), "moe_router_load_balancing_type"),
    (dict(moe_expert_capacity_factor=1.0), "moe_expert_capacity_factor"),
    (dict(moe_router_dtype="fp64"), "moe_router_dtype"),
    (dict(moe_apply_probs_on_input=True), "moe_apply_probs_on_input"),
    (dict(moe_router_topk_limited_devices=1), "moe_router_topk_limited_devices"),  # groups = EP, under another name
])
def test_router_settings_deepseek_v3_computes_otherwise_are_refused(change, match):
    args, arch = _args(**change)
    with pytest.raises(ReshardError, match=match):
        hf_config(args, arch, torch.float32)


@pytest.mark.parametrize("change,match", [
    (dict(expert_bias=False), "moe_router_enable_expert_bias"),
    (dict(shared_gate=True), "moe_shared_expert_gate"),
    (dict(shared_ffn=12), "moe_shared_expert_intermediate_size"),
    (dict(moe_layers=(True, False)), "moe_layer_freq"),
])
def test_parts_deepseek_v3_has_no_place_for_are_refused(change, match):
    args, arch = _args()
    with pytest.raises(ReshardError, match=match):
        hf_config(args, dataclasses.replace(arch, **change), torch.float32)


def test_mla_moe_with_a_shared_expert_gate_export_is_refused_before_any_output(tmp_path):
    """DeepseekV3's shared experts have no gate: the mapping has no name for Megatron's, so the export
    is refused naming the key (never written without it)."""
    with pytest.raises(ReshardError, match=r"'decoder\.layers\.1\.mlp\.shared_experts\.gate_weight'.*deepseek_v3\.json"):
        convert(FIXTURES / "torch_dist_mla_moe_tp2_ep2", tmp_path / "hf", fmt="hf")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("change,match", [
    (dict(norm_topk_prob=False), "norm_topk_prob"),
    (dict(num_experts_per_tok=2), "topk_group"),  # 2 experts from 2 groups: Megatron ranks groups by their top 1
    (dict(scoring_func="softmax"), "scoring_func"),
    (dict(n_shared_experts=0), "n_shared_experts"),
])
def test_deepseek_v3_configs_megatron_computes_otherwise_are_refused(change, match):
    cfg = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 3,
           "hidden_size": 16, "num_attention_heads": 4, "intermediate_size": 20, "moe_intermediate_size": 8,
           "n_routed_experts": 8, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
           "routed_scaling_factor": 2.5, "norm_topk_prob": True, "first_k_dense_replace": 1, "q_lora_rank": 12,
           "kv_lora_rank": 8, "qk_nope_head_dim": 6, "qk_rope_head_dim": 4, "v_head_dim": 5, "vocab_size": 96,
           "rms_norm_eps": 1e-6}
    args = args_from_hf(cfg, tp=1, pp=1, dp=2, ep=2, dtype=torch.float32)
    assert args.moe_layer_freq == [0, 1, 1] and args.moe_router_enable_expert_bias and not args.moe_shared_expert_gate
    assert (args.moe_router_num_groups, args.moe_router_group_topk, args.moe_shared_expert_intermediate_size) == (4, 2, 8)
    with pytest.raises(ReshardError, match=match):
        args_from_hf({**cfg, **change}, tp=1, pp=1, dp=2, ep=2, dtype=torch.float32)
