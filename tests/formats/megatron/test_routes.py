"""Megatron through the existing writers, each output read back by its own framework's reader
(torch's ``dcp_to_torch_save``, ``safetensors``, ``torch.load`` of universal files) and compared
with Megatron's own reload of the source, bit for bit: Megatron keys by default for ``ucp`` and
``dcp``, HF names for ``safetensors`` (``--names`` chooses)."""

from __future__ import annotations

import pytest
import torch

from reshard.jobs.convert import convert
from reshard.storage.safe_load import load

from .support import FIXTURES, oracle


def _stacked(fixture: str) -> dict[str, torch.Tensor]:
    """The oracle's TP=1 weights stacked into Megatron's keys (``oracle.json`` names them)."""
    model, _, _, info = oracle(fixture)
    out: dict[str, torch.Tensor] = {}
    for key, shape in info["key_shapes"].items():
        if key in {k for k, _ in info["names"].values()}:
            out[key] = torch.empty(shape, dtype=next(iter(model.values())).dtype)
    for name, (key, idx) in info["names"].items():
        out[key][tuple(idx)] = model[name]
    return out


@pytest.mark.parametrize("fixture", ["torch_dist_tp2_dp2_distopt", "legacy_tp2_pp2"])
def test_megatron_to_dcp_read_by_torch(tmp_path, fixture):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = convert(FIXTURES / fixture, tmp_path / "dcp", fmt="dcp").out_dir
    dcp_to_torch_save(out, tmp_path / "whole.pt")
    sd = torch.load(tmp_path / "whole.pt", weights_only=True)
    want = _stacked(fixture)
    assert set(sd["model"]) == set(want)
    for k, v in want.items():
        assert torch.equal(sd["model"][k], v), k
    _, optim, _, info = oracle(fixture)
    name = "decoder.layers.1.self_attention.linear_qkv.weight"
    key, idx = info["names"][name]
    assert torch.equal(sd["optim"]["state"][key]["exp_avg"][tuple(idx)], optim[f"exp_avg.{name}"])


def test_megatron_to_ucp_read_by_torch_load(tmp_path):
    out = convert(FIXTURES / "torch_dist_pp2_dp2_distopt", tmp_path, fmt="ucp").out_dir
    want = _stacked("torch_dist_pp2_dp2_distopt")
    _, optim, _, info = oracle("torch_dist_pp2_dp2_distopt")
    for key, v in want.items():
        got = load(out / "zero" / key / "fp32.pt", mmap=False)
        got = got["param"] if isinstance(got, dict) else got
        assert torch.equal(got.reshape(v.shape), v), key
    key, idx = info["names"]["decoder.layers.0.mlp.linear_fc1.weight"]
    m = load(out / "zero" / key / "exp_avg_sq.pt", mmap=False)
    m = m["param"] if isinstance(m, dict) else m
    assert torch.equal(m.reshape(want[key].shape)[tuple(idx)], optim["exp_avg_sq.decoder.layers.0.mlp.linear_fc1.weight"])


def test_megatron_to_safetensors_megatron_names(tmp_path):
    from safetensors.torch import load_file

    out = convert(FIXTURES / "torch_dist_moe_ep2", tmp_path, fmt="safetensors", names="megatron").out_dir
    sd = load_file(str(out / "model.safetensors"))
    want = _stacked("torch_dist_moe_ep2")
    assert set(sd) == set(want)
    for k, v in want.items():
        assert torch.equal(sd[k], v), k
