"""Megatron -> legacy Megatron files (``--ckpt-format torch``: weights only, or with plain Adam's
state) at another TP / PP / EP: read back by reshard's legacy reader, every weight (and moment)
equals Megatron's own reload of the source bit for bit; at the source's own topology each file is
Megatron's: its module keys in Megatron's order, the same tensors, the same optimizer entries.
Megatron's own loader reading them: test_megatron_loads (opt-in)."""

from __future__ import annotations

import json

import pytest
import torch

from reshard.errors import ReshardError
from reshard.formats.megatron import safe
from reshard.formats.megatron.reader import MegatronReader
from reshard.jobs.convert import reshard

from .support import FIXTURES, HF_FIXTURES, compare_megatron

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
    # a multi-token-prediction layer on the last stage (with its copy of the embedding over several stages)
    ("legacy_tp2_pp2_mtp1", dict(tp=1, pp=1), ["mp_rank_00"]),
    ("torch_dist_mtp1", dict(tp=2, pp=2), [f"mp_rank_0{t}_00{p}" for t in range(2) for p in range(2)]),
]


@pytest.mark.parametrize("fixture,topology,folders", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_legacy_target_equals_the_oracle(tmp_path, fixture, topology, folders):
    out = reshard(FIXTURES / fixture, tmp_path, to="megatron", ckpt_format="torch", optimizer="none",
                  **topology).out_dir
    _check(out, fixture, topology, folders, "none")


ADAM = [  # plain Adam's moments beside the weights (the default from a plain-Adam source)
    ("legacy_tp2_pp2", dict(tp=1, pp=2), ["mp_rank_00_000", "mp_rank_00_001"]),
    ("torch_dist_tp2_pp2", dict(tp=1, pp=4), [f"mp_rank_00_00{p}" for p in range(4)]),
    ("legacy_moe_tp2_ep2_shared", dict(tp=1, ep=1), ["mp_rank_00"]),  # one optimizer
    ("legacy_moe_tp2_ep2_shared", dict(tp=2, dp=2, ep=2, etp=2),  # chained [dense, experts]
     ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]),
    # MTP: the last stage's optimizer holds the embedding copy first (index 0), then its layers and the MTP block
    ("legacy_tp2_pp2_mtp1", dict(tp=1, pp=2), ["mp_rank_00_000", "mp_rank_00_001"]),
    ("torch_dist_deepseek_v3_mtp_tp2_ep2", dict(tp=1, ep=1), ["mp_rank_00"]),  # an MLA + MoE MTP layer
]


@pytest.mark.parametrize("fixture,topology,folders", ADAM, ids=[f"{c[0]}-{c[1]}" for c in ADAM])
def test_legacy_target_with_adam_equals_the_oracle(tmp_path, fixture, topology, folders):
    out = reshard(FIXTURES / fixture, tmp_path, to="megatron", ckpt_format="torch", **topology).out_dir
    _check(out, fixture, topology, folders, "adam")


DISTRIBUTED = [  # the distributed optimizer (distrib_optim.pt beside each file; the default from such a source)
    ("legacy_dp2_distopt", dict(tp=2, dp=1), ["mp_rank_00", "mp_rank_01"]),
    ("legacy_dp2_distopt_buckets", dict(tp=2, dp=2), ["mp_rank_00", "mp_rank_01"]),  # several buckets at TP 2
    ("legacy_dp2_distopt_buckets", dict(pp=2, dp=1), ["mp_rank_00_000", "mp_rank_00_001"]),  # stage 0's only
    ("legacy_moe_tp2_ep2_shared_distopt", dict(tp=1, ep=1), ["mp_rank_00"]),  # one optimizer, experts in its buffer
    ("legacy_moe_tp2_ep2_shared_distopt", dict(tp=2, dp=2, ep=2, etp=2),  # [dense, None] / [None, experts] files too
     ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]),
    ("torch_dist_tp2_dp2_distopt", dict(tp=1, dp=2), ["mp_rank_00"]),  # dp_reshardable buckets -> distrib_optim.pt
    ("torch_dist_dp2_distopt_bf16", dict(tp=2, dp=1), ["mp_rank_00", "mp_rank_01"]),  # bf16 weights, fp32 masters
    ("torch_dist_mtp1", dict(tp=1, dp=2, optimizer="distributed"), ["mp_rank_00"]),  # MTP after the final norm
    # MTP over several stages: the last stage's buffer holds the embedding copy (a shared_embedding bucket)
    ("torch_dist_mtp1", dict(tp=1, pp=2, dp=2, optimizer="distributed"), ["mp_rank_00_000", "mp_rank_00_001"]),
    ("legacy_pp2_dp2_mtp1_distopt", dict(tp=2, pp=1, dp=1), ["mp_rank_00", "mp_rank_01"]),  # the copy merged away
]


@pytest.mark.parametrize("fixture,topology,folders", DISTRIBUTED, ids=[f"{c[0]}-{c[1]}" for c in DISTRIBUTED])
def test_legacy_target_with_the_distributed_optimizer_equals_the_oracle(tmp_path, fixture, topology, folders):
    out = reshard(FIXTURES / fixture, tmp_path, to="megatron", ckpt_format="torch", **topology).out_dir
    _check(out, fixture, topology, folders, "dp_reshardable")
    assert all((out / "iter_0000003" / f / "distrib_optim.pt").is_file() for f in folders)


def _check(out, fixture, topology, folders, kind):
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "3"
    it = out / "iter_0000003"
    assert sorted(p.name for p in it.iterdir()) == folders
    assert not (it / "metadata.json").exists()
    reader = MegatronReader.open(out)
    reader.check()
    want = {"none": ("weight",), "adam": ("weight", "exp_avg", "exp_avg_sq"),
            "dp_reshardable": ("weight", "fp32", "exp_avg", "exp_avg_sq")}[kind]
    assert reader.loc.fmt == "torch" and all(reader.states(n) in (want, ("weight",)) for n in reader.names)
    assert any(reader.states(n) == want for n in reader.names)
    a = reader.arch
    assert (a.tp, a.pp, a.dp) == (topology.get("tp", 1), topology.get("pp", 1), topology.get("dp", 1))
    assert reader.args.ckpt_format == "torch" and bool(reader.args.no_save_optim) == (kind == "none")
    assert reader.args.use_distributed_optimizer == (kind == "dp_reshardable")
    assert reader.args.no_save_rng and all("rng_state" not in reader.src.state_dict(k) for k in reader.src.files)
    assert compare_megatron(reader, fixture) > 0
    manifest = json.loads((out / "reshard-manifest.json").read_text())
    assert manifest["optimizer"] == kind


@pytest.mark.parametrize("fixture", ["legacy_tp2_pp2", "legacy_moe_tp2_ep2_shared", "legacy_pp2_vpp2",
                                     "legacy_tp2_pp2_mtp1"])
@pytest.mark.parametrize("optimizer", ["none", None])
def test_legacy_at_the_source_topology_is_megatrons_files(tmp_path, fixture, optimizer):
    """Each file: Megatron's top-level entries (less the RNG states; weights only: less the
    optimizer and scheduler too), its model keys in its order (``_extra_state`` included), the same
    tensors and dtypes, ``args.rank``; with the source's plain Adam (the default), Megatron's
    optimizer entries: param groups, state indices, steps and moments."""
    out = reshard(FIXTURES / fixture, tmp_path, to="megatron", optimizer=optimizer).out_dir  # the source's format
    src = FIXTURES / fixture / "iter_0000003"
    files = sorted(src.rglob("model_optim_rng.pt"))
    assert sorted(p.relative_to(out / "iter_0000003") for p in (out / "iter_0000003").rglob("*.pt")) == [
        p.relative_to(src) for p in files]
    left = ("optimizer", "opt_param_scheduler") if optimizer == "none" else ()
    for f in files:
        want, got = safe.load_file(f), safe.load_file(out / "iter_0000003" / f.relative_to(src))
        assert list(got) == [k for k in want if k not in left]
        assert got["args"].rank == want["args"].rank and got["args"].ckpt_format == "torch"
        assert not got["args"].no_save_rng and _same(got["rng_state"], want["rng_state"])  # the same ranks: copied
        for mk in (k for k in want if k.startswith("model")):
            assert list(got[mk]) == list(want[mk]), f
            for k, v in want[mk].items():
                if v is None:
                    assert got[mk][k] is None, k
                else:
                    assert v.dtype == got[mk][k].dtype and torch.equal(v, got[mk][k]), k
        if optimizer is None:
            assert got["opt_param_scheduler"] == want["opt_param_scheduler"]
            mine, theirs = got["optimizer"], want["optimizer"]
            assert type(mine) is type(theirs)  # chained (a list) with experts apart
            for a, b in zip(mine if isinstance(mine, list) else [mine], theirs if isinstance(theirs, list) else [theirs]):
                assert a["param_groups"] == b["param_groups"] and list(a["state"]) == list(b["state"])
                for i, st in b["state"].items():
                    assert list(a["state"][i]) == list(st)
                    for k, v in st.items():
                        assert v.dtype == a["state"][i][k].dtype and torch.equal(v, a["state"][i][k]), (f, i, k)


@pytest.mark.parametrize("fixture", ["legacy_dp2_distopt", "legacy_dp2_distopt_buckets", "legacy_pp2_dp2_mtp1_distopt",
                                     "legacy_moe_tp2_ep2_shared_distopt", "legacy_pp2_dp2_tied_distopt"])
def test_legacy_distributed_optimizer_at_the_source_topology_is_megatrons_files(tmp_path, fixture):
    """The distributed optimizer's legacy files at the source's topology (the default: the source's
    format and optimizer) are Megatron's: every ``model_optim_rng.pt`` and ``distrib_optim.pt``
    object for object -- the param groups and steps, the DDP buffers' dtype keys, ``numel_unpadded``,
    a chained ``[dense, experts]`` list with experts apart -- each tensor bit for bit (fp32 main
    parameters and moments over every bucket, the gaps' zeros), and ``args`` but ``local_rank``."""
    out = reshard(FIXTURES / fixture, tmp_path, to="megatron").out_dir
    src = FIXTURES / fixture / "iter_0000003"
    files = sorted(src.rglob("*.pt"))
    assert sorted(p.relative_to(out / "iter_0000003") for p in (out / "iter_0000003").rglob("*.pt")) == [
        p.relative_to(src) for p in files]
    assert {f.name for f in files} == {"model_optim_rng.pt", "distrib_optim.pt"}
    for f in files:
        want, got = safe.load_file(f), safe.load_file(out / "iter_0000003" / f.relative_to(src))
        if f.name == "model_optim_rng.pt":
            mine, theirs = vars(got.pop("args")), vars(want.pop("args"))
            assert set(mine) == set(theirs)
            # local_rank: the saving process's node-local rank, kept from the first file's args (Megatron reads
            # it from the environment, never from a checkpoint)
            assert {k for k in theirs if mine[k] != theirs[k]} <= {"local_rank"}, f
            assert not mine["no_save_optim"] and not mine["no_save_rng"] and mine["use_distributed_optimizer"]
        assert _same(got, want, bits=True), f


def _same(a, b, bits: bool = False) -> bool:
    if isinstance(a, torch.Tensor):
        if bits:  # bit for bit (torch.equal takes -0.0 for 0.0)
            return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                    and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k], bits) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y, bits) for x, y in zip(a, b))
    if type(a).__name__ == "ndarray":
        return type(b).__name__ == "ndarray" and a.dtype == b.dtype and (a == b).all()
    return a == b


def test_legacy_target_refusals_come_before_any_output(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ReshardError, match="--optimizer fully_reshardable with --ckpt-format torch.*torch_dist layout"):
        reshard(FIXTURES / "torch_dist_tp2_pp2", out, to="megatron", ckpt_format="torch", optimizer="fully_reshardable")
    with pytest.raises(ReshardError, match="virtual pipeline size 2: legacy distrib_optim.pt"):
        reshard(FIXTURES / "legacy_pp2_vpp2", out, to="megatron", optimizer="distributed")
    with pytest.raises(ReshardError, match="--optimizer distributed with --ckpt-format torch: the source records no "
                                           "learning-rate scheduler"):
        reshard(HF_FIXTURES / "pretrained_llama", out, to="megatron", ckpt_format="torch", optimizer="distributed")
    with pytest.raises(ReshardError, match="for torch.bfloat16 weights"):
        reshard(FIXTURES / "torch_dist_dp2_distopt_bf16", out, to="megatron", ckpt_format="torch", optimizer="adam")
    with pytest.raises(ReshardError, match="would both save mp_rank_00"):  # expert TP above TP: one file, two savers
        reshard(FIXTURES / "legacy_moe_tp2_ep2_shared", out, to="megatron", tp=1, dp=2, ep=1, etp=2, optimizer="none")
    assert not out.exists()
    # from a distributed optimizer, plain Adam on request: its moments
    got = reshard(FIXTURES / "legacy_dp2_distopt", out, to="megatron", dp=1, optimizer="adam").out_dir
    assert compare_megatron(MegatronReader.open(got), "legacy_dp2_distopt") > 0


def test_torch_dist_from_a_legacy_source_on_request(tmp_path):
    out = reshard(FIXTURES / "legacy_tp2_pp2", tmp_path, to="megatron", ckpt_format="torch_dist", tp=1,
                  pp=1).out_dir
    assert (out / "iter_0000003" / "metadata.json").exists()


def test_hf_import_as_legacy_files_equals_the_torch_dist_import(tmp_path):
    """An HF folder imported as legacy files (a release checkpoint, weights only) holds what the
    torch_dist import holds, key for key (the HF blocks restricted over the local maps)."""
    from .support import HF_FIXTURES, full

    src = HF_FIXTURES / "pretrained_llama"
    legacy = MegatronReader.open(reshard(src, tmp_path / "a", to="megatron", tp=2, pp=2, ckpt_format="torch").out_dir)
    dist = MegatronReader.open(reshard(src, tmp_path / "b", to="megatron", tp=2, pp=2).out_dir)
    legacy.check()
    assert legacy.loc.fmt == "torch" and legacy.loc.iteration is None and set(legacy.names) == set(dist.names)
    for k in dist.names:
        assert torch.equal(full(legacy, k, "weight"), full(dist, k, "weight")), k
