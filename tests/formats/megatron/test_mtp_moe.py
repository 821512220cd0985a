"""Multi-token prediction with MLA and MoE (issue 35 item 1, DeepSeek-V3's real shape):
``torch_dist_deepseek_v3_mtp_tp2_ep2``, written by Megatron-Core 0.19.2 at TP2 x EP2 (expert TP 1),
whose MTP layer is the decoder's last layer spec -- MLA + MoE with a router, an expert bias, routed
experts and a shared expert -- between ``enorm`` / ``hnorm`` / ``eh_proj`` and its final norm.

Read bit for bit like Megatron's own TP1 x EP1 reload (``test_reader``, every fixture), laid out
as Megatron's save when written again at its own topology, resharded (``test_writer``; Megatron's
loader: ``test_megatron_loads``), to DCP under Megatron's names with the MTP layer, and through
HF names -- where transformers' DeepseekV3 has no place for an MTP layer -- refused naming the MTP
tensors unless ``--drop`` leaves them out, recorded in the report and the manifest."""

from __future__ import annotations

import json

import pytest
import torch

from reshard.errors import UnplacedError
from reshard.formats.megatron.reader import MegatronReader
from reshard.formats.registry import open_reader
from reshard.jobs.convert import convert, reshard

from .support import FIXTURES, STATES, compare_megatron, full, oracle

MTP = "torch_dist_deepseek_v3_mtp_tp2_ep2"
DROP = r"^mtp\."
EXPERT_BIAS = "mtp.layers.0.transformer_layer.mlp.router.expert_bias"


def _mtp_keys(reader: MegatronReader) -> list[str]:
    return [n for n in reader.names if n.startswith("mtp.")]


def _dropped_weights(report) -> set[str]:
    return {k for k in report.dropped if "_extra_state" not in k}


def test_the_mtp_layer_is_mla_and_moe_as_megatron_built_it():
    r = MegatronReader.open(FIXTURES / MTP)
    a = r.arch
    assert (a.mtp, a.mtp_moe, a.mla is not None, a.moe_layers, a.tp, a.ep, a.etp) == (1, True, True, (False, True), 2, 2, 1)
    t = "mtp.layers.0.transformer_layer."
    want = {"mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.eh_proj.weight",
            "mtp.layers.0.final_layernorm.weight", t + "input_layernorm.weight", t + "pre_mlp_layernorm.weight",
            *(f"{t}self_attention.{n}.weight" for n in ("linear_proj", "linear_q_down_proj", "linear_q_up_proj",
                                                         "linear_kv_down_proj", "linear_kv_up_proj", "q_layernorm",
                                                         "kv_layernorm")),
            t + "mlp.router.weight", EXPERT_BIAS, t + "mlp.experts.experts.linear_fc1.weight",
            t + "mlp.experts.experts.linear_fc2.weight", t + "mlp.shared_experts.linear_fc1.weight",
            t + "mlp.shared_experts.linear_fc2.weight"}
    assert set(_mtp_keys(r)) == want
    assert r.shape(t + "mlp.experts.experts.linear_fc1.weight") == (4, 16, 24)  # stacked over experts only
    assert r.states(EXPERT_BIAS) == ("weight",)  # a buffer: no moments
    assert not r.unlowered() or all(h.what == "state" for h in r.unlowered())  # every tensor entry read
    # every MTP tensor of Megatron's reload -- experts, router, bias, MLA, norms -- and its moments compared
    model, optim, _, info = oracle(MTP)
    names = [n for n in info["names"] if n.startswith("mtp.")]
    assert sum(".local_experts." in n for n in names) == 8 and any(n.endswith("expert_bias") for n in names)
    assert sum(f"exp_avg.{n}" in optim for n in names) == len(names) - 1
    # the MTP router's own expert bias (set before the save), non-zero and not the decoder's
    bias = full(r, EXPERT_BIAS, "weight")
    assert bias.dtype == torch.float32 and bool(bias.ne(0).all())
    assert not torch.equal(bias, full(r, "decoder.layers.1.mlp.router.expert_bias", "weight"))


def test_written_at_its_own_topology_is_megatrons_layout(tmp_path):
    """Keys, shapes, chunks and the files they lie in, and every object key (the MTP experts'
    ``_extra_state`` one per expert) as Megatron saved them."""
    src = MegatronReader.open(FIXTURES / MTP).src
    out = MegatronReader.open(reshard(FIXTURES / MTP, tmp_path, to="megatron").out_dir)
    assert set(out.src.ck.tensors) == set(src.ck.tensors) and set(out.src.ck.objects) == set(src.ck.objects)
    for key, e in src.ck.tensors.items():
        got = out.src.ck.tensors[key]
        assert (got.shape, got.dtype) == (e.shape, e.dtype), key
        assert sorted((c.offsets, c.sizes, c.file) for c in got.chunks) == sorted(
            (c.offsets, c.sizes, c.file) for c in e.chunks), key
    assert compare_megatron(out, MTP) > 0


def test_megatron_names_to_dcp_keep_the_mtp_layer(tmp_path):
    """Under Megatron's names nothing needs a place elsewhere: the DCP checkpoint holds every key,
    the MTP layer's among them, equal to Megatron's reload."""
    report = convert(FIXTURES / MTP, tmp_path / "dcp", fmt="dcp")
    assert not report.dropped
    r = open_reader(report.out_dir)
    model, optim, _, info = oracle(MTP)
    n = 0
    for name, (key, idx) in info["names"].items():
        assert key in r.names, key
        got = full(r, key, "weight")[tuple(idx)]
        want = model[name]
        if key in ("embedding.word_embeddings.weight", "output_layer.weight"):
            got, want = got[:want.shape[0]], want[:got.shape[0]]
        assert torch.equal(got, want), name
        n += key.startswith("mtp.")
    assert n >= 20


@pytest.mark.parametrize("fmt", ["hf", "safetensors"])
def test_hf_names_refuse_the_mtp_layer_naming_it_before_any_output(tmp_path, fmt):
    with pytest.raises(UnplacedError) as e:
        convert(FIXTURES / MTP, tmp_path / "out", fmt=fmt)
    msg = str(e.value)
    assert "mtp.layers.0.enorm.weight" in msg and "multi-token prediction" in msg and "--drop" in msg, msg
    assert set(e.value.entries) == set(_mtp_keys(MegatronReader.open(FIXTURES / MTP)))
    assert not (tmp_path / "out").exists()


def test_hf_export_with_the_mtp_layer_dropped_loads_with_megatron_logits(tmp_path):
    """``--drop '^mtp\\.'``: the folder DeepseekV3ForCausalLM loads with no missing or unexpected key,
    every weight Megatron's reload cut by deepseek_v3.json, logits Megatron's forward (the MTP
    layer does not enter the main logits); every MTP tensor listed as dropped in the report and
    the manifest."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from .test_hf_moe import _mapped_oracle

    report = convert(FIXTURES / MTP, tmp_path / "hf", fmt="hf", drop=[DROP])
    mtp = set(_mtp_keys(MegatronReader.open(FIXTURES / MTP)))
    assert _dropped_weights(report) == mtp
    manifest = json.loads((report.out_dir / "reshard-manifest.json").read_text())
    weights = [d for d in manifest["dropped"] if d["what"] == "weights"]
    assert {d["key"] for d in weights} == mtp and all("multi-token prediction" in d["reason"] for d in weights)
    # the MTP linears' _extra_state objects match the pattern too: dropped rather than "not carried"
    assert {d["what"] for d in manifest["dropped"]} == {"weights", "state"}
    assert any(n.startswith("dropped by --drop") and "mtp.layers.0." in n for n in report.notes)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(report.out_dir, output_loading_info=True)
    model.eval()
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert json.loads((report.out_dir / "config.json").read_text())["num_nextn_predict_layers"] == 0
    written = load_file(str(report.out_dir / "model.safetensors"))
    want = _mapped_oracle(MTP, MegatronReader.open(FIXTURES / MTP, names="hf"))
    assert set(written) == set(want)
    for k, v in written.items():
        assert torch.equal(v, want[k]), k
    fwd = oracle(MTP)[2]
    with torch.no_grad():
        logits = model(fwd["input_ids"]).logits
    diff = float((logits - fwd["logits"][..., :logits.shape[-1]]).abs().max())
    print(f"{MTP}: DeepseekV3ForCausalLM vs Megatron's forward: max |diff| {diff:.1e}")
    assert diff < 1e-5, diff


@pytest.mark.parametrize("via", ["dcp", pytest.param("universal", marks=pytest.mark.slow)])
def test_through_hf_names_and_back_with_the_mtp_layer_dropped(tmp_path, via):
    """Megatron -> DCP / universal (HF names) -> Megatron at TP2 x EP2 x expert TP 1: HF names have no
    place for the MTP layer, so it goes only with ``--drop`` (listed); every other weight and Adam
    moment comes back equal to Megatron's reload, and the target has no MTP layer (its config's
    ``num_nextn_predict_layers`` is 0), so nothing is left at an initial value."""
    hf = convert(FIXTURES / MTP, tmp_path / "hf", fmt="hf", drop=[DROP]).out_dir
    mid = convert(FIXTURES / MTP, tmp_path / via, fmt=via, names="hf", drop=[DROP])
    assert _dropped_weights(mid) == set(_mtp_keys(MegatronReader.open(FIXTURES / MTP)))
    back = reshard(mid.out_dir, tmp_path / "back", to="megatron", tp=2, dp=1, ep=2, etp=1, optimizer="adam",
                   hf_config=hf).out_dir
    r = MegatronReader.open(back)
    assert r.arch.mtp == 0 and (r.arch.tp, r.arch.ep, r.arch.etp) == (2, 2, 1)
    model, optim, _, info = oracle(MTP)
    n = 0
    for name, (key, idx) in info["names"].items():
        if key.startswith("mtp."):
            continue
        for state, prefix in STATES[:3]:
            want = model[name] if prefix is None else optim.get(prefix + name)
            if want is None:
                continue
            got = full(r, key, state)[tuple(idx)]
            if key in ("embedding.word_embeddings.weight", "output_layer.weight"):
                got, want = got[:r.arch.vocab], want[:r.arch.vocab]
            assert got.dtype == want.dtype and torch.equal(got, want), (name, state)
            n += 1
    assert n > 60


def test_a_dense_mtp_layer_is_refused_for_llama_and_dropped_on_request(tmp_path):
    """``torch_dist_mtp1`` (a dense model's MTP layer, ``llama.json``): the same rule -- no Llama holds
    an MTP layer -- refused naming it, and with ``--drop`` a folder LlamaForCausalLM loads whole."""
    transformers = pytest.importorskip("transformers")
    with pytest.raises(UnplacedError, match=r"mtp\.layers\.0\.eh_proj\.weight.*--drop"):
        convert(FIXTURES / "torch_dist_mtp1", tmp_path / "out", fmt="hf")
    assert not (tmp_path / "out").exists()
    report = convert(FIXTURES / "torch_dist_mtp1", tmp_path / "out", fmt="hf", drop=[DROP])
    assert _dropped_weights(report) == set(_mtp_keys(MegatronReader.open(FIXTURES / "torch_dist_mtp1")))
    model, info = transformers.AutoModelForCausalLM.from_pretrained(report.out_dir, output_loading_info=True)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
