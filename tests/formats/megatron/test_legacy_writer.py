"""Megatron -> legacy Megatron files (``--ckpt-format torch``, weights only) at another TP / PP / EP:
read back by reshard's legacy reader, every weight equals Megatron's own reload of the source bit
for bit; at the source's own topology each file holds Megatron's module keys in Megatron's order
with the same tensors. Megatron's own loader reading them: test_megatron_loads (opt-in)."""

from __future__ import annotations

import json

import pytest
import torch

from reshard.errors import ReshardError
from reshard.formats.megatron import safe
from reshard.formats.megatron.reader import MegatronReader
from reshard.jobs.convert import reshard

from .support import FIXTURES, compare_megatron

CASES = [  # (source, target topology, the rank folders Megatron's save_checkpoint writes there)
    ("legacy_tp2_pp2", dict(tp=1, pp=2), ["mp_rank_00_000", "mp_rank_00_001"]),
    ("legacy_tp2_pp2", dict(tp=2, pp=1, dp=2), ["mp_rank_00", "mp_rank_01"]),
    ("torch_dist_tp2_pp2", dict(tp=1, pp=4), [f"mp_rank_00_00{p}" for p in range(4)]),
    ("legacy_pp2_vpp2", dict(tp=2, pp=1), ["mp_rank_00", "mp_rank_01"]),  # virtual stages merged
    # experts: files per EP rank (DP rank 0 or expert-DP rank 0 saves)
    ("legacy_moe_tp2_ep2_shared", dict(tp=1, ep=1), ["mp_rank_00"]),
    ("legacy_moe_tp2_ep2_shared", dict(tp=2, dp=2, ep=2, etp=2),
     ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]),
    ("legacy_moe_tp2_ep2_shared", dict(tp=2, dp=2, ep=4, etp=1),
     ["mp_rank_00_000", "mp_rank_00_002", "mp_rank_01_001", "mp_rank_01_003"]),
    ("torch_dist_moe_tp2_ep2_shared_distopt", dict(tp=1, pp=3, dp=2, ep=2),
     [f"mp_rank_00_00{p}_00{e}" for p in range(3) for e in range(2)]),
]


@pytest.mark.parametrize("fixture,topology,folders", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_legacy_target_equals_the_oracle(tmp_path, fixture, topology, folders):
    out = reshard(FIXTURES / fixture, tmp_path, to="megatron", ckpt_format="torch", optimizer="none",
                  **topology).out_dir
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "3"
    it = out / "iter_0000003"
    assert sorted(p.name for p in it.iterdir()) == folders
    assert not (it / "metadata.json").exists()
    reader = MegatronReader.open(out)
    reader.check()
    assert reader.loc.fmt == "torch" and all(reader.states(n) == ("weight",) for n in reader.names)
    a = reader.arch
    assert (a.tp, a.pp, a.dp) == (topology.get("tp", 1), topology.get("pp", 1), topology.get("dp", 1))
    assert reader.args.ckpt_format == "torch" and reader.args.no_save_optim
    assert compare_megatron(reader, fixture) > 0
    manifest = json.loads((out / "reshard-manifest.json").read_text())
    assert manifest["optimizer"] == "none"


@pytest.mark.parametrize("fixture", ["legacy_tp2_pp2", "legacy_moe_tp2_ep2_shared", "legacy_pp2_vpp2"])
def test_legacy_at_the_source_topology_is_megatrons_files(tmp_path, fixture):
    """Each file: Megatron's top-level entries (less the optimizer, scheduler and RNG), its model
    keys in its order (``_extra_state`` included), the same tensors and dtypes, ``args.rank``."""
    out = reshard(FIXTURES / fixture, tmp_path, to="megatron", optimizer="none").out_dir  # the source's format
    src = FIXTURES / fixture / "iter_0000003"
    files = sorted(src.rglob("model_optim_rng.pt"))
    assert sorted(p.relative_to(out / "iter_0000003") for p in (out / "iter_0000003").rglob("*.pt")) == [
        p.relative_to(src) for p in files]
    for f in files:
        want, got = safe.load_file(f), safe.load_file(out / "iter_0000003" / f.relative_to(src))
        assert list(got) == [k for k in want if k not in ("optimizer", "opt_param_scheduler", "rng_state")]
        assert got["args"].rank == want["args"].rank and got["args"].ckpt_format == "torch"
        for mk in (k for k in want if k.startswith("model")):
            assert list(got[mk]) == list(want[mk]), f
            for k, v in want[mk].items():
                if v is None:
                    assert got[mk][k] is None, k
                else:
                    assert v.dtype == got[mk][k].dtype and torch.equal(v, got[mk][k]), k


def test_legacy_target_optimizer_state_is_refused_before_any_output(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ReshardError, match="--optimizer none"):  # the source's Adam: asked for by default
        reshard(FIXTURES / "legacy_tp2_pp2", out, to="megatron", tp=1)
    with pytest.raises(ReshardError, match="--optimizer adam with --ckpt-format torch"):
        reshard(FIXTURES / "torch_dist_tp2_pp2", out, to="megatron", ckpt_format="torch", optimizer="adam")
    with pytest.raises(ReshardError, match="--optimizer none"):
        reshard(FIXTURES / "torch_dist_tp2_pp2", out, to="megatron", ckpt_format="torch")
    assert not out.exists()


def test_torch_dist_from_a_legacy_source_on_request(tmp_path):
    out = reshard(FIXTURES / "legacy_tp2_pp2", tmp_path, to="megatron", ckpt_format="torch_dist", tp=1,
                  pp=1).out_dir
    assert (out / "iter_0000003" / "metadata.json").exists()
