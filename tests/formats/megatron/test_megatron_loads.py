"""Opt-in: Megatron's own loader (``scripts/megatron_oracle.py``: Megatron-LM's
``load_checkpoint`` at the target topology) reads what the writer wrote, and its reload equals
Megatron's reload of the source (model and optimizer) -- or, from an HF source, what the reader
reads of the output. Needs the Megatron venv; run with ``RESHARD_MEGATRON_ORACLE=1``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reshard.formats.megatron.reader import MegatronReader
from reshard.jobs.convert import reshard

from .support import FIXTURES, HF_FIXTURES, full

VENV = Path(os.environ.get("MEGATRON_VENV", "/work/venvs/megatron"))
ORACLE = Path(__file__).resolve().parents[3] / "scripts" / "megatron_oracle.py"
pytestmark = pytest.mark.skipif(os.environ.get("RESHARD_MEGATRON_ORACLE") != "1" or not (VENV / "bin" / "python").exists(),
                                reason="opt-in: RESHARD_MEGATRON_ORACLE=1 and the Megatron venv")

CASES = [  # (source, target topology, what Megatron loads)
    ("torch_dist_tp2_pp2", dict(tp=1, pp=1, dp=1), True),
    ("torch_dist_tp2_dp2_distopt", dict(tp=1, pp=1, dp=2), True),
    ("legacy_tp2_pp2", dict(tp=2, pp=1, dp=1), True),
    ("torch_dist_pp2_dp2_distopt", dict(tp=2, pp=2, dp=1, optimizer="fully_reshardable"), True),
    ("torch_dist_dp2_distopt_bf16", dict(tp=2, pp=1, dp=1), True),
    ("torch_dist_moe_ep2_distopt", dict(tp=1, pp=1, dp=2, ep=2), True),
    ("torch_dist_tp2_pp2", dict(tp=2, pp=1, dp=2, optimizer="dp_reshardable"), True),
    # EP=1 (expert TP = TP): one optimizer, the experts in the dense groups and buffer, as Megatron builds it
    ("torch_dist_moe_ep2", dict(tp=1, pp=1, dp=1, ep=1), True),
    ("torch_dist_moe_ep2_distopt", dict(tp=1, pp=1, dp=2, ep=1), True),
    ("torch_dist_pp2_vpp2", dict(tp=2, pp=2, dp=1), True),  # virtual stages kept (the oracle loads them so)
    ("torch_dist_pp2_vpp2", dict(tp=1, pp=2, dp=1, optimizer="dp_reshardable"), True),  # a buffer per chunk
    ("torch_dist_pp2_vpp2_distopt", dict(tp=2, pp=1, dp=1), True),
    ("legacy_pp2_vpp2", dict(tp=2, pp=2, dp=1, optimizer="dp_reshardable"), True),
    ("torch_dist_pp2_uneven", dict(tp=1, pp=2, dp=2, optimizer="dp_reshardable"), True),  # uneven buckets
    ("torch_dist_pp2_uneven", dict(tp=2, pp=3, dp=1), True),
    ("torch_dist_tp2_qk_layernorm", dict(tp=1, pp=2, dp=2, optimizer="dp_reshardable"), True),
    ("torch_dist_tp2_mla", dict(tp=1, pp=1, dp=1), True),
    ("torch_dist_tp2_mla", dict(tp=2, pp=2, dp=1, optimizer="dp_reshardable"), True),
    ("legacy_tp2_mla", dict(tp=1, pp=2, dp=1), True),
    ("torch_dist_tp2_mla_q_proj", dict(tp=1, pp=1, dp=2, optimizer="dp_reshardable"), True),
    ("torch_dist_tp2_dp2_mla_distopt", dict(tp=2, pp=1, dp=1, optimizer="fully_reshardable"), True),
    ("torch_dist_mla_moe_tp2_ep2", dict(tp=1, pp=1, dp=1, ep=1), True),
    ("torch_dist_mla_moe_tp2_ep2", dict(tp=2, pp=1, dp=2, ep=2, etp=2), True),
    # DeepSeek-V3 shaped: group-limited sigmoid router, scaled weights, an ungated shared expert, random expert bias
    ("torch_dist_deepseek_v3_tp2_ep2", dict(tp=1, pp=1, dp=1, ep=1), True),
    ("torch_dist_deepseek_v3_tp2_ep2", dict(tp=1, pp=2, dp=2, ep=2), True),
    # shared experts + gate, expert bias, mixed dense / MoE layers; expert TP apart from TP (folded) or not
    ("torch_dist_moe_tp2_ep2_shared_distopt", dict(tp=2, pp=1, dp=1, ep=2, etp=1), True),
    ("torch_dist_moe_tp2_ep2_shared_distopt", dict(tp=2, pp=1, dp=2, ep=2, etp=2), True),
    ("torch_dist_moe_tp2_ep2_shared_distopt", dict(tp=1, pp=1, dp=2, ep=2, optimizer="fully_reshardable"), True),
    # a stage of dense layers only: Megatron 0.19.2's distributed optimizer without Apex / TE cannot save or load
    # an empty expert optimizer (DistributedOptimizer.state_dict: assert len(steps) == 1), so plain Adam there
    ("torch_dist_moe_tp2_ep2_shared_distopt", dict(tp=1, pp=3, dp=2, ep=2, optimizer="adam"), True),
    ("torch_dist_moe_tp2_ep2_shared_distopt", dict(tp=1, pp=1, dp=1, ep=1), True),
    ("torch_dist_moe_tp2_ep2_shared_distopt", dict(tp=1, pp=1, dp=2, ep=1, etp=2), True),  # expert TP above TP
    ("torch_dist_moe_ep2_shared_bf16", dict(tp=2, pp=2, dp=1, ep=2, etp=1, optimizer="fully_reshardable"), True),
    ("torch_dist_moe_ep2_shared_bf16", dict(tp=1, pp=1, dp=1, ep=1), True),
    # several DDP buckets (the oracle passes the source's --overlap-grad-reduce --ddp-bucket-size)
    ("torch_dist_dp2_distopt_buckets", dict(tp=2, pp=1, dp=2), True),
    ("torch_dist_dp2_distopt_buckets", dict(tp=1, pp=2, dp=2), True),
    ("legacy_dp2_distopt_buckets", dict(tp=1, pp=1, dp=2, optimizer="dp_reshardable"), True),
    # legacy files with EP (mp_rank_TT_EEE, a chained [dense, experts] Adam) at another TP / EP / expert TP
    ("legacy_moe_tp2_ep2_shared", dict(tp=1, pp=1, dp=1, ep=1), True),
    ("legacy_moe_tp2_ep2_shared", dict(tp=2, pp=1, dp=2, ep=2, etp=2, optimizer="dp_reshardable"), True),
    ("legacy_moe_tp2_ep2_shared", dict(tp=1, pp=3, dp=2, ep=2, optimizer="adam"), True),
    ("legacy_moe_tp2_ep2_shared_distopt", dict(tp=1, pp=1, dp=2, ep=2), True),
    ("legacy_moe_tp2_ep2_shared_distopt", dict(tp=2, pp=1, dp=1, ep=2, etp=1, optimizer="fully_reshardable"), True),
    ("legacy_moe_tp2_dp2_ep2", dict(tp=1, pp=1, dp=1, ep=1), True),
    # --moe-grouped-gemm under the local spec (SequentialMLP; the oracle reload keeps the flag)
    ("torch_dist_moe_ep2_grouped_gemm_local", dict(tp=1, pp=1, dp=2, ep=1), True),
    # a multi-token-prediction layer: on the last stage, in its bucket after the final norm
    ("torch_dist_mtp1", dict(tp=2, pp=2, dp=1), True),
    ("torch_dist_mtp1", dict(tp=2, pp=1, dp=2, optimizer="dp_reshardable"), True),
    # DeepSeek-V3 shaped with an MLA + MoE MTP layer: TP1 x EP1, PP2 (MTP on the last stage), and its experts in
    # the expert buckets of a dp_reshardable optimizer
    ("torch_dist_deepseek_v3_mtp_tp2_ep2", dict(tp=1, pp=1, dp=1, ep=1), True),
    ("torch_dist_deepseek_v3_mtp_tp2_ep2", dict(tp=1, pp=2, dp=2, ep=2), True),
    ("torch_dist_deepseek_v3_mtp_tp2_ep2", dict(tp=2, pp=1, dp=2, ep=2, etp=2, optimizer="dp_reshardable"), True),
    # MTP under virtual stages (the last stage's last chunk): merged to PP 1, and kept at PP 2 x virtual PP 2
    ("torch_dist_pp2_vpp2_mtp1", dict(tp=1, pp=1, dp=1), True),
    ("torch_dist_pp2_vpp2_mtp1", dict(tp=2, pp=2, dp=1), True),
    # legacy files with MTP (the last stage's embedding copy) written as torch_dist
    ("legacy_tp2_pp2_mtp1", dict(tp=1, pp=1, dp=1), True),
    # two MTP layers, and one repeated at two depths; legacy MTP over two stages with the distributed optimizer
    ("torch_dist_mtp2", dict(tp=2, pp=2, dp=1), True),
    ("torch_dist_mtp2_repeated", dict(tp=2, pp=1, dp=1), True),
    ("legacy_pp2_dp2_mtp1_distopt", dict(tp=2, pp=1, dp=2), True),
    # --vpp: plain stages -> PP 2 x virtual PP 2 (the oracle reloads at the output's recorded virtual stages), a
    # buffer per model chunk; virtual stages -> plain ones at the same PP
    ("torch_dist_tp2_pp2", dict(tp=1, pp=2, dp=1, vpp=2), True),
    ("torch_dist_tp2_pp2", dict(tp=1, pp=2, dp=1, vpp=2, optimizer="dp_reshardable"), True),
    ("torch_dist_pp2_vpp2_distopt", dict(tp=1, pp=2, dp=1, vpp=1), True),
    # the last stage's embedding copy (MTP, tied) in a dp_reshardable bucket of its own: made, kept, merged away
    ("torch_dist_mtp1", dict(tp=1, pp=2, dp=2, optimizer="dp_reshardable"), True),
    ("torch_dist_pp2_dp2_mtp1_distopt", dict(tp=1, pp=2, dp=1), True),
    ("torch_dist_pp2_dp2_mtp1_distopt", dict(tp=2, pp=1, dp=1), True),
    ("torch_dist_pp2_dp2_tied_distopt", dict(tp=2, pp=2, dp=1, optimizer="fully_reshardable"), True),
    ("torch_dist_pp2_dp2_tied_distopt", dict(tp=2, pp=1, dp=2), True),
    ("legacy_pp2_dp2_tied_distopt", dict(tp=1, pp=2, dp=2, optimizer="dp_reshardable"), True),
    ("torch_dist_pp2_vpp2_mtp1", dict(tp=1, pp=2, dp=2, optimizer="dp_reshardable"), True),  # in model chunk 1's buffer
]


def _megatron(ckpt: Path, out: Path, topology: dict, optim: bool, forward: bool = False) -> dict:
    cmd = [str(VENV / "bin" / "python"), str(ORACLE), str(ckpt), "--out", str(out), "--venv", str(VENV),
           "--tp", str(topology["tp"]), "--pp", str(topology["pp"]), "--dp", str(topology["dp"]),
           "--ep", str(topology.get("ep", 1))] + ([] if optim else ["--no-optim"]) + (["--forward"] if forward else [])
    if topology.get("etp") is not None:
        cmd += ["--etp", str(topology["etp"])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    from safetensors.torch import load_file

    got = {"model": load_file(str(out / "model.safetensors"))}
    if optim and (out / "optimizer.safetensors").exists():
        got["optimizer"] = load_file(str(out / "optimizer.safetensors"))
    return got


@pytest.mark.parametrize("fixture,topology,optim", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_megatron_loads_the_resharded_checkpoint(tmp_path, fixture, topology, optim):
    from safetensors.torch import load_file

    out = reshard(FIXTURES / fixture, tmp_path / "ckpt", to="megatron", ckpt_format="torch_dist", **topology).out_dir
    got = _megatron(out, tmp_path / "reload", topology, optim)
    ref = FIXTURES / fixture / "oracle"
    model = load_file(str(ref / "model.safetensors"))
    for part, tensors in got.items():
        want = load_file(str(ref / f"{part}.safetensors"))
        if part == "optimizer" and topology.get("optimizer") == "adam":  # plain Adam keeps no fp32 masters
            want = {k: v for k, v in want.items() if not k.startswith("param.")}
        if part == "optimizer":  # a plain-Adam source written with fp32 masters: the masters are its weights
            want.update({f"param.{k}": v.float() for k, v in model.items()
                         if f"param.{k}" in tensors and f"param.{k}" not in want})
        assert set(tensors) == set(want), (part, sorted(set(tensors) ^ set(want))[:4])
        for k in want:
            assert torch.equal(tensors[k], want[k]), (part, k)
    print(f"{fixture} -> {topology}: Megatron reloads {', '.join(got)} equal to its reload of the source",
          file=sys.stderr)


@pytest.mark.parametrize("source", ["pretrained_llama", "pretrained_deepseek_v3"])
def test_megatron_loads_an_hf_import(tmp_path, source):
    """An HF folder transformers wrote, imported at TP=2 (Llama's; DeepseekV3's: MLA), read by
    Megatron; for MLA, Megatron's forward on it gives transformers' logits."""
    src = HF_FIXTURES / source
    out = reshard(src, tmp_path / "ckpt", to="megatron", tp=2, pp=1).out_dir
    mla = source.endswith("deepseek_v3")
    got = _megatron(out, tmp_path / "reload", {"tp": 2, "pp": 1, "dp": 1}, False, forward=mla)["model"]
    info = json.loads((tmp_path / "reload" / "oracle.json").read_text())
    reader = MegatronReader.open(out)
    for name, (key, idx) in info["names"].items():
        mine = full(reader, key, "weight")[tuple(idx)]
        assert torch.equal(got[name][:mine.shape[0]] if got[name].shape != mine.shape else got[name], mine), name
    if mla:  # the rope part interleaved on both sides (deepseek_v3.json): equal logits prove it
        import transformers
        from safetensors.torch import load_file

        fwd = load_file(str(tmp_path / "reload" / "forward.safetensors"))
        hf = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
        with torch.no_grad():
            logits = hf(fwd["input_ids"]).logits
        diff = float((logits - fwd["logits"][..., :logits.shape[-1]]).abs().max())
        print(f"{source}: transformers vs Megatron's forward on the import: max |diff| {diff:.2e}", file=sys.stderr)
        assert diff < 1e-5, diff


@pytest.mark.parametrize("fixture,topology", [
    ("torch_dist_moe_tp2_ep2_qk_layernorm", {"tp": 2, "pp": 1, "dp": 1, "ep": 2, "etp": 1}),  # Qwen3-MoE
    ("torch_dist_moe_ep2_shared_softmax", {"tp": 1, "pp": 2, "dp": 2, "ep": 2}),  # Qwen2-MoE
    ("torch_dist_deepseek_v3_tp2_ep2", {"tp": 2, "pp": 1, "dp": 1, "ep": 2, "etp": 1}),  # DeepSeek-V3 MoE
    ("torch_dist_deepseek_v3_tp2_ep2", {"tp": 1, "pp": 2, "dp": 2, "ep": 2}),
])
def test_megatron_loads_an_hf_moe_import(tmp_path, fixture, topology):
    """A Qwen-MoE / DeepSeek-V3 MoE HF folder (reshard's export of a Megatron fixture) imported at TP x EP (x PP):
    Megatron loads it, and its reload equals Megatron's own reload of the fixture (valid vocabulary rows)."""
    from safetensors.torch import load_file

    from reshard.jobs.convert import convert

    hf = convert(FIXTURES / fixture, tmp_path / "hf", fmt="hf").out_dir
    out = reshard(hf, tmp_path / "ckpt", to="megatron", **topology).out_dir
    got = _megatron(out, tmp_path / "reload", topology, False)["model"]
    want = load_file(str(FIXTURES / fixture / "oracle" / "model.safetensors"))
    assert set(got) == set(want)
    vocab = MegatronReader.open(out).arch.vocab
    for k, v in want.items():
        g = got[k]
        if k in ("embedding.word_embeddings.weight", "output_layer.weight"):
            g, v = g[:vocab], v[:vocab]
        assert torch.equal(g, v), k


def test_megatron_loads_a_transformers_deepseek_v3_moe_import_and_gives_its_logits(tmp_path):
    """A DeepSeek-V3 MoE folder transformers' save_pretrained wrote (per-expert tensors, a non-zero
    expert bias, 4 groups of which 2 are kept, routed_scaling_factor 2.5, a dense first layer)
    imported at TP2 x EP2 (expert TP 1): Megatron loads it, its reload is what reshard wrote, and
    Megatron's forward on it gives transformers' logits (the router computed alike on both sides)."""
    import transformers

    from .test_hf_deepseek_v3_moe import _saved

    model, src = _saved(tmp_path)
    topology = {"tp": 2, "pp": 1, "dp": 1, "ep": 2, "etp": 1}
    out = reshard(src, tmp_path / "ckpt", to="megatron", **topology).out_dir
    got = _megatron(out, tmp_path / "reload", topology, False, forward=True)["model"]
    info = json.loads((tmp_path / "reload" / "oracle.json").read_text())
    reader = MegatronReader.open(out)
    for name, (key, idx) in info["names"].items():
        mine = full(reader, key, "weight")[tuple(idx)]
        assert torch.equal(got[name][:mine.shape[0]] if got[name].shape != mine.shape else got[name], mine), name
    assert any(n.endswith("router.expert_bias") for n in got)
    from safetensors.torch import load_file

    fwd = load_file(str(tmp_path / "reload" / "forward.safetensors"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    assert isinstance(hf, transformers.DeepseekV3ForCausalLM)
    with torch.no_grad():
        logits = hf(fwd["input_ids"]).logits
    diff = float((logits - fwd["logits"][..., :logits.shape[-1]]).abs().max())
    print(f"save_pretrained DeepSeek-V3 MoE: transformers vs Megatron's forward on the import: max |diff| {diff:.2e}",
          file=sys.stderr)
    assert diff < 1e-5, diff


def test_megatron_loads_a_moe_checkpoint_back_from_dcp(tmp_path):
    """Cross-framework: the Qwen3-MoE-shaped fixture -> DCP (HF names) -> Megatron at its own TP2 x
    EP2 x expert TP1 with plain Adam (``--hf-config``): Megatron loads it, the model equal to its
    reload of the fixture (the padded vocabulary on its valid rows: HF names hold only those). DCP
    records no iteration, so the output is a ``release`` checkpoint, which Megatron loads model-only:
    the moments written beside it are checked by reshard's reader (test_hf_moe), not here."""
    from safetensors.torch import load_file

    from reshard.jobs.convert import convert

    fixture, topology = "torch_dist_moe_tp2_ep2_qk_layernorm", {"tp": 2, "pp": 1, "dp": 1, "ep": 2, "etp": 1}
    hf = convert(FIXTURES / fixture, tmp_path / "hf", fmt="hf").out_dir
    mid = convert(FIXTURES / fixture, tmp_path / "dcp", fmt="dcp", names="hf").out_dir
    out = reshard(mid, tmp_path / "ckpt", to="megatron", optimizer="adam", hf_config=hf, **topology).out_dir
    got = _megatron(out, tmp_path / "reload", topology, False)
    vocab = MegatronReader.open(out).arch.vocab
    for part in ("model",):
        want = load_file(str(FIXTURES / fixture / "oracle" / f"{part}.safetensors"))
        assert set(got[part]) == set(want), (part, sorted(set(got[part]) ^ set(want))[:4])
        for k, v in want.items():
            g = got[part][k]
            if k.endswith(("embedding.word_embeddings.weight", "output_layer.weight")):
                g, v = g[:vocab], v[:vocab]
            assert torch.equal(g, v), (part, k)


MEGATRON_NAMES = [  # (fixture, via, target topology): Megatron -> DCP / universal in Megatron's names -> Megatron
    ("torch_dist_deepseek_v3_mtp_tp2_ep2", "dcp", dict(tp=1, pp=1, dp=1, ep=1)),
    ("torch_dist_deepseek_v3_mtp_tp2_ep2", "universal", dict(tp=1, pp=2, dp=2, ep=2)),
    ("torch_dist_mtp1", "universal", dict(tp=2, pp=2, dp=1)),
    ("torch_dist_pp2_vpp2_mtp1", "dcp", dict(tp=2, pp=2, dp=1)),  # back to PP 2 x virtual PP 2
]


@pytest.mark.parametrize("fixture,via,topology", MEGATRON_NAMES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in MEGATRON_NAMES])
def test_megatron_loads_an_mtp_checkpoint_back_from_megatron_names(tmp_path, fixture, via, topology):
    """DCP / universal keep Megatron's names, the MTP layer's too; back to Megatron with the args, optimizer
    groups and run state of the fixture (``--megatron-args``): Megatron loads it, model and Adam moments (the MTP
    layer's among them) equal to its reload of the fixture."""
    from safetensors.torch import load_file

    from reshard.jobs.convert import convert

    mid = convert(FIXTURES / fixture, tmp_path / via, fmt=via).out_dir
    out = reshard(mid, tmp_path / "ckpt", to="megatron", optimizer="adam", megatron_args=FIXTURES / fixture,
                  **topology).out_dir
    got = _megatron(out, tmp_path / "reload", topology, True)
    assert set(got) == {"model", "optimizer"}
    for part, tensors in got.items():
        want = load_file(str(FIXTURES / fixture / "oracle" / f"{part}.safetensors"))
        if part == "optimizer":  # plain Adam keeps no fp32 masters
            want = {k: v for k, v in want.items() if not k.startswith("param.")}
        assert set(tensors) == set(want), (part, sorted(set(tensors) ^ set(want))[:4])
        assert any(k.startswith(("mtp.", "exp_avg.mtp.")) for k in tensors), part
        for k, v in want.items():
            assert torch.equal(tensors[k], v), (part, k)


LEGACY_TARGETS = [  # (source, target topology): legacy files (--ckpt-format torch); "optimizer": "none" = weights only
    ("legacy_tp2_pp2", dict(tp=1, pp=2, dp=1, optimizer="none")),
    ("torch_dist_tp2_pp2", dict(tp=2, pp=1, dp=1, optimizer="none")),
    ("legacy_moe_tp2_ep2_shared", dict(tp=1, pp=1, dp=2, ep=2, optimizer="none")),  # files mp_rank_00_{000,001}
    ("legacy_moe_tp2_ep2_shared", dict(tp=2, pp=1, dp=1, ep=2, etp=1, optimizer="none")),  # folded, as the source
    # plain Adam: a chained [dense, experts] optimizer with experts apart
    ("legacy_tp2_pp2", dict(tp=1, pp=2, dp=1, optimizer="adam")),
    ("torch_dist_tp2_pp2", dict(tp=2, pp=1, dp=1, optimizer="adam")),
    ("legacy_moe_tp2_ep2_shared", dict(tp=1, pp=1, dp=2, ep=2, optimizer="adam")),
    ("legacy_moe_tp2_ep2_shared", dict(tp=1, pp=1, dp=1, ep=1, optimizer="adam")),
    # the distributed optimizer (distrib_optim.pt): other TP / DP / PP / EP, several buckets, chained with experts apart
    ("legacy_dp2_distopt", dict(tp=2, pp=1, dp=1, optimizer="distributed")),
    ("legacy_dp2_distopt_buckets", dict(tp=2, pp=1, dp=1, optimizer="distributed")),
    ("legacy_dp2_distopt_buckets", dict(tp=1, pp=2, dp=1, optimizer="distributed")),
    ("legacy_moe_tp2_ep2_shared_distopt", dict(tp=1, pp=1, dp=2, ep=2, optimizer="distributed")),
    ("legacy_moe_tp2_ep2_shared_distopt", dict(tp=1, pp=1, dp=1, ep=1, optimizer="distributed")),
    ("torch_dist_tp2_dp2_distopt", dict(tp=1, pp=1, dp=2, optimizer="distributed")),
    ("torch_dist_dp2_distopt_bf16", dict(tp=2, pp=1, dp=1, optimizer="distributed")),  # bf16 weights, fp32 masters
    # MTP layers: the last stage's embedding copy in its model and optimizer; an MLA + MoE MTP layer
    ("legacy_tp2_pp2_mtp1", dict(tp=1, pp=2, dp=1, optimizer="adam")),
    ("torch_dist_mtp1", dict(tp=2, pp=2, dp=1, optimizer="adam")),
    ("torch_dist_deepseek_v3_mtp_tp2_ep2", dict(tp=1, pp=1, dp=1, ep=1, optimizer="adam")),
    ("torch_dist_mtp1", dict(tp=1, pp=1, dp=2, optimizer="distributed")),  # one stage: no embedding copy
    ("legacy_tp2_pp2", dict(tp=1, pp=2, dp=1, vpp=2, optimizer="adam")),  # --vpp: model0 / model1 per file
    # MTP over two stages with the distributed optimizer: the embedding copy in a shared_embedding bucket
    ("torch_dist_mtp1", dict(tp=1, pp=2, dp=2, optimizer="distributed")),
    ("legacy_pp2_dp2_mtp1_distopt", dict(tp=2, pp=2, dp=1, optimizer="distributed")),
    ("torch_dist_mtp2", dict(tp=1, pp=2, dp=2, optimizer="distributed")),
    # tied embeddings over two stages: output_layer.weight, the last stage's copy, last in its model, first in its buffer
    ("torch_dist_pp2_dp2_tied_distopt", dict(tp=1, pp=2, dp=2, optimizer="distributed")),
    ("legacy_pp2_dp2_tied_distopt", dict(tp=2, pp=2, dp=1, optimizer="distributed")),
    ("torch_dist_pp2_dp2_mtp1_distopt", dict(tp=1, pp=2, dp=1, optimizer="distributed")),
]


@pytest.mark.parametrize("fixture,topology", LEGACY_TARGETS, ids=[f"{c[0]}-{c[1]}" for c in LEGACY_TARGETS])
def test_megatron_loads_a_legacy_target(tmp_path, fixture, topology):
    """A legacy target (``--ckpt-format torch``) at another TP / PP / EP: Megatron's ``load_checkpoint``
    (``--ckpt-format torch --no-load-rng``, and ``--no-load-optim`` for weights only) reads it, and its
    model (and Adam's moments) equal Megatron's reload of the source."""
    from safetensors.torch import load_file

    out = reshard(FIXTURES / fixture, tmp_path / "ckpt", to="megatron", ckpt_format="torch", **topology).out_dir
    optim = topology["optimizer"] != "none"
    got = _megatron(out, tmp_path / "reload", topology, optim)
    info = json.loads((tmp_path / "reload" / "oracle.json").read_text())
    assert info["checkpoint_format"] == "torch"
    assert set(got) == ({"model", "optimizer"} if optim else {"model"})
    for part, tensors in got.items():
        want = load_file(str(FIXTURES / fixture / "oracle" / f"{part}.safetensors"))
        if part == "optimizer" and topology["optimizer"] == "adam":  # plain Adam keeps no fp32 masters
            want = {k: v for k, v in want.items() if not k.startswith("param.")}
        if part == "optimizer":  # a plain-Adam source written with fp32 masters: the masters are its weights
            model = load_file(str(FIXTURES / fixture / "oracle" / "model.safetensors"))
            want.update({f"param.{k}": v.float() for k, v in model.items()
                         if f"param.{k}" in tensors and f"param.{k}" not in want})
        assert set(tensors) == set(want), (part, sorted(set(tensors) ^ set(want))[:4])
        for k, v in want.items():
            assert torch.equal(tensors[k], v), (part, k)
    print(f"{fixture} -> legacy {topology}: Megatron reloads {', '.join(got)} equal to its reload of the source",
          file=sys.stderr)


def _keyed(model: dict[str, torch.Tensor], info: dict) -> dict[str, dict[str, torch.Tensor]]:
    """Megatron's reload (per-layer / per-expert names) stacked into its checkpoint keys."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, (key, idx) in info["names"].items():
        full = out.setdefault(key, {}).setdefault("weight", model[name].new_zeros(info["key_shapes"][key]))
        full[tuple(idx)] = model[name]
    return out


@pytest.mark.parametrize("topology", [{"tp": 2, "pp": 1, "dp": 1, "ep": 2, "etp": 1},
                                      {"tp": 1, "pp": 2, "dp": 2, "ep": 2}], ids=["tp2-ep2-etp1", "pp2-dp2-ep2"])
def test_megatron_loads_a_deepspeed_autoep_checkpoint(tmp_path, topology):
    """Cross-framework, the way back: the checkpoint DeepSpeed 0.19.8 saved for an AutoEP job
    (``mixtral_autoep_ep2``) written as Megatron-Core MoE at TP x EP (x PP): Megatron's own loader
    reads it, and its reload, cut into HF names by the mapping document, equals DeepSpeed's own
    consolidation of the source (``ds_to_universal``, mapped by name) bit for bit. A checkpoint
    from a non-Megatron source is a ``release`` one (no iteration, scheduler or RNG state to
    carry), which Megatron loads model-only: the moments beside it are compared with DeepSpeed's
    consolidation through torch's DCP loader in tests/formats/deepspeed/test_autoep_to_megatron.py."""
    from tests.formats.deepspeed.test_autoep_to_megatron import (
        NATIVE,
        deepspeed_consolidation,
        hf_config_dir,
        in_hf_names,
    )

    out = reshard(NATIVE, tmp_path / "ckpt", to="megatron", optimizer="adam",
                  hf_config=hf_config_dir(tmp_path / "cfg"), **topology).out_dir
    got = _megatron(out, tmp_path / "reload", topology, False)["model"]
    info = json.loads((tmp_path / "reload" / "oracle.json").read_text())
    assert any(".local_experts." in n for n in got)
    mine = in_hf_names(_keyed(got, info), out)
    want = deepspeed_consolidation(tmp_path / "ucp")
    assert sorted(mine) == sorted(want)
    for name, states in want.items():
        assert torch.equal(mine[name]["weight"], states["weight"]), name
    print(f"mixtral_autoep_ep2 -> Megatron {topology}: Megatron's reload equals ds_to_universal of the source "
          f"({len(want)} tensors)", file=sys.stderr)


def test_megatron_loads_its_moe_checkpoint_back_from_deepspeed_autoep(tmp_path):
    """Megatron MoE (``torch_dist_moe_ep2``) -> DeepSpeed AutoEP (EP 2 x DP 2) -> Megatron at the
    source's TP x EP x DP: Megatron's reload equals its own reload of the source (the padded
    vocabulary on its valid rows)."""
    from safetensors.torch import load_file

    from reshard.jobs.convert import convert

    fixture = "torch_dist_moe_ep2"
    a = MegatronReader.open(FIXTURES / fixture).arch
    topology = {"tp": a.tp, "pp": a.pp, "dp": a.dp, "ep": a.ep}
    hf = convert(FIXTURES / fixture, tmp_path / "hf", fmt="hf").out_dir
    ds = reshard(FIXTURES / fixture, tmp_path / "ds", to="deepspeed", ep=2, dp=2).out_dir
    out = reshard(ds.parent, tmp_path / "ckpt", to="megatron", optimizer="adam", hf_config=hf, **topology).out_dir
    got = _megatron(out, tmp_path / "reload", topology, False)["model"]
    want = load_file(str(FIXTURES / fixture / "oracle" / "model.safetensors"))
    assert set(got) == set(want)
    vocab = MegatronReader.open(out).arch.vocab
    for k, v in want.items():
        g = got[k]
        if k.endswith(("embedding.word_embeddings.weight", "output_layer.weight")):
            g, v = g[:vocab], v[:vocab]
        assert torch.equal(g, v), k
