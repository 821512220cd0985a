"""PyTorch DCP at both ends: reading (lowering chunks to maps), writing, DCP -> safetensors / UCP,
DeepSpeed -> DCP, a DCP checkpoint laid out for N loading ranks, and bad input. Oracles are torch's
own: ``dcp.save`` writes the sources, ``dcp_to_torch_save`` consolidates for comparison."""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reshard import ReshardError, convert
from reshard.errors import CheckpointError
from reshard.formats.dcp.checkpoint import METADATA, DcpCheckpoint
from reshard.formats.dcp.records import DcpFile
from reshard.formats.dcp.writer import fsdp_chunks, target_chunks
from reshard.ir.piece import prod
from reshard.jobs.convert import reshard as reshard_dcp_files
from reshard.storage.safe_load import load
from reshard.storage.staging import verify
from tests.support.dsconv import ds_to_universal, tag_dir
from tests.support.paths import DCP

dcp = pytest.importorskip("torch.distributed.checkpoint")
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save  # noqa: E402


def _save(sd: dict, path: Path) -> Path:
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=str(path))
    return path


def _consolidated(path: Path, tmp: Path) -> dict:
    out = tmp / f"consolidated-{path.name}-{len(list(tmp.iterdir()))}.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(str(path), str(out))
    return torch.load(out, weights_only=True)


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            for i, g in enumerate(v):
                out.update(_flat(g, f"{prefix}{k}.{i}."))
        else:
            out[prefix + str(k)] = v
    return out


def _same(a: dict, b: dict) -> None:
    fa, fb = _flat(a), _flat(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        if isinstance(fa[k], torch.Tensor):
            assert fa[k].dtype == fb[k].dtype and fa[k].shape == fb[k].shape, k
            assert torch.equal(fa[k].view(-1).view(torch.uint8) if fa[k].numel() else fa[k],
                               fb[k].view(-1).view(torch.uint8) if fb[k].numel() else fb[k]), k
        else:
            assert fa[k] == fb[k], k


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(10, 6, generator=g)
    return {
        "model": {"embed.weight": w, "norm.weight": torch.randn(6, generator=g),
                  "proj.weight": torch.randn(5, 7, generator=g).to(torch.bfloat16)},
        "optim": {"state": {"embed.weight": {"step": torch.tensor(3.0), "exp_avg": torch.randn(10, 6, generator=g),
                                             "exp_avg_sq": torch.rand(10, 6, generator=g)}},
                  "param_groups": [{"lr": 0.01, "betas": (0.9, 0.95), "params": ["embed.weight"]}]},
    }


@pytest.fixture()
def source(tmp_path: Path) -> Path:
    return _save(_state(), tmp_path / "src")


# -- reading -----------------------------------------------------------------------------------


def test_reads_what_torch_wrote(source: Path, tmp_path: Path) -> None:
    ck = DcpCheckpoint.open(source)
    ref = _flat(_consolidated(source, tmp_path))
    assert ck.params == ["embed.weight", "norm.weight", "proj.weight"]
    for key in ck.tensors:
        assert torch.equal(ck.full(key), ref[key]), key
        ck.param_map(key).check()
    assert ck.state_key("embed.weight", "exp_avg") == "optim.state.embed.weight.exp_avg"
    assert ck.state_key("norm.weight", "exp_avg") is None
    assert ck.param_groups == [{"lr": 0.01, "betas": (0.9, 0.95), "params": ["embed.weight"]}]


def test_chunks_lower_to_one_box_piece_each_on_their_storage_rank(source: Path, tmp_path: Path) -> None:
    out = reshard_dcp_files(source, tmp_path / "out", files=3).out_dir
    ck = DcpCheckpoint.open(out)
    m = ck.param_map("model.embed.weight")
    assert m.ranks == (0, 1, 2)
    assert [m.shard(r).shape for r in m.ranks] == [(4, 6), (4, 6), (2, 6)]
    assert all(len(m.shard(r).pieces) == 1 for r in m.ranks)
    step = ck.param_map("optim.state.embed.weight.step")
    assert step.ranks == (0,) and step.logical_shape == ()


# -- laying out for N loading ranks -------------------------------------------------------------


@st.composite
def _states(draw) -> dict:
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int64]
    model = {}
    for i in range(draw(st.integers(1, 4))):
        shape = tuple(draw(st.lists(st.integers(0, 9), min_size=0, max_size=3)))
        dtype = draw(st.sampled_from(dtypes))
        t = torch.randint(-1000, 1000, shape) if dtype == torch.int64 else torch.randn(shape)
        model[f"p{i}.weight"] = t.to(dtype)
    return {"model": model}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sd=_states(), n=st.integers(1, 5), m=st.integers(1, 4))
def test_laid_out_for_n_then_m_ranks_is_bit_exact(sd: dict, n: int, m: int, tmp_path_factory) -> None:
    tmp = tmp_path_factory.mktemp("n")
    src = _save(sd, tmp / "src")
    a = reshard_dcp_files(src, tmp / "a", files=n).out_dir
    b = reshard_dcp_files(a, tmp / "b", files=m).out_dir  # a source with several chunks per tensor
    ref = _consolidated(src, tmp)
    _same(_consolidated(a, tmp), ref)
    _same(_consolidated(b, tmp), ref)
    ck = DcpCheckpoint.open(b)
    for key, e in ck.tensors.items():
        want = target_chunks(e.shape, m)
        assert {c.rank: (c.offsets, c.sizes) for c in e.chunks} == want, key
        if e.shape and prod(e.shape):
            assert [want[r][1][0] for r in sorted(want)] == [r for _, r in fsdp_chunks(e.shape, m) if r]
        assert {c.file for c in e.chunks} <= {f"__{r}_0.distcp" for r in range(m)}
    verify(b)


def test_fsdp_chunks_follow_torch_chunk() -> None:
    for rows in range(0, 12):
        for n in range(1, 6):
            got = [r for _, r in fsdp_chunks((rows, 3), n)]
            want = [c.shape[0] for c in torch.empty(rows, 3).chunk(n)] if rows else []
            assert got[:len(want)] == want and sum(got) == rows


# -- DCP -> safetensors, DCP -> universal ---------------------------------------------------------


def test_dcp_to_safetensors_equals_torch_consolidation(source: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    multi = reshard_dcp_files(source, tmp_path / "multi", files=3).out_dir
    out = convert(multi, tmp_path / "st", fmt="safetensors", with_optimizer=True).out_dir
    ref = _consolidated(source, tmp_path)["model"]
    got = load_file(out / "model.safetensors")
    assert got.keys() == ref.keys()
    for k in ref:
        assert got[k].dtype == ref[k].dtype and torch.equal(got[k], ref[k]), k
    moments = load(out / "zero" / "embed.weight" / "exp_avg.pt")["param"]
    assert torch.equal(moments, _state()["optim"]["state"]["embed.weight"]["exp_avg"])
    assert not (out / "zero" / "norm.weight").exists()  # no optimizer state, nothing written
    verify(out)


def test_dcp_to_universal(source: Path, tmp_path: Path) -> None:
    out = convert(source, tmp_path / "ucp", fmt="ucp").out_dir
    assert (tmp_path / "ucp" / "latest_universal").read_text() == out.name
    sd = _state()
    assert torch.equal(load(out / "zero" / "embed.weight" / "fp32.pt")["param"], sd["model"]["embed.weight"])
    assert load(out / "zero" / "proj.weight" / "fp32.pt")["param"].dtype == torch.float32
    assert torch.equal(load(out / "zero" / "embed.weight" / "exp_avg_sq.pt")["param"],
                       sd["optim"]["state"]["embed.weight"]["exp_avg_sq"])
    groups = load(out / "zero" / "optimizer_state.pt")["param_groups"]
    assert groups == [{"lr": 0.01, "betas": (0.9, 0.95), "params": [0]}]


# -- DeepSpeed / universal -> DCP -----------------------------------------------------------------


@pytest.fixture(scope="module")
def ds_universal(tmp_path_factory) -> Path:
    return ds_to_universal("llama_zero1_dp2", tmp_path_factory.mktemp("ds_ucp"))


def test_deepspeed_to_dcp_equals_deepspeed_universal_tensors(ds_universal: Path, tmp_path: Path) -> None:
    out = convert(tag_dir("llama_zero1_dp2"), tmp_path / "dcp", fmt="dcp").out_dir
    sd = _consolidated(out, tmp_path)
    names = sorted(d.name for d in (ds_universal / "zero").iterdir() if d.is_dir())
    assert sorted(sd["model"]) == names
    for n in names:
        for state, got in (("fp32", sd["model"][n]), ("exp_avg", sd["optim"]["state"][n]["exp_avg"]),
                           ("exp_avg_sq", sd["optim"]["state"][n]["exp_avg_sq"])):
            want = load(ds_universal / "zero" / n / f"{state}.pt")["param"]
            assert got.dtype == torch.float32 and torch.equal(got, want), (n, state)
        step = load(ds_universal / "zero" / n / "step.pt")
        assert sd["optim"]["state"][n]["step"].item() == float(step)
    (group,) = sd["optim"]["param_groups"]
    assert sorted(group["params"]) == sorted(sd["model"]) and group["lr"] == 0.001 and group["decoupled_weight_decay"]
    # the universal checkpoint itself converts to the same DCP tensors
    again = convert(ds_universal, tmp_path / "dcp2", fmt="dcp").out_dir
    _same(_consolidated(again, tmp_path)["model"], sd["model"])


def test_rename(tmp_path: Path) -> None:
    out = convert(tag_dir("llama_zero1_dp2"), tmp_path / "dcp", fmt="dcp",
                  rename=[r"^model\.=", r"^lm_head=output"]).out_dir
    sd = _consolidated(out, tmp_path)
    assert "output.weight" in sd["model"] and "layers.0.mlp.up_proj.weight" in sd["model"]
    assert "output.weight" in sd["optim"]["param_groups"][0]["params"]
    with pytest.raises(ReshardError, match="several parameters"):
        convert(tag_dir("llama_zero1_dp2"), tmp_path / "x", fmt="dcp", rename=[r"weight$=w", r".*=same"])
    assert not (tmp_path / "x" / "global_step3").exists()


# -- bad input ---------------------------------------------------------------------------------


class _Planted:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_planted_pickle_in_metadata_is_refused_without_running(source: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    md = pickle.loads((source / METADATA).read_bytes())
    md.planner_data = {"model.embed.weight": _Planted(marker)}
    (source / METADATA).write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match=r"\.metadata: refuses to unpickle (posix|os)\.system"):
        DcpCheckpoint.open(source)
    with pytest.raises(CheckpointError, match="refuses to unpickle"):
        convert(source, tmp_path / "out", fmt="safetensors")
    assert not marker.exists() and not (tmp_path / "out" / "src").exists()


def test_planted_pickle_in_a_value_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    folder = tmp_path / "ck"
    folder.mkdir()
    with open(folder / "__0_0.distcp", "wb") as fh:
        f = DcpFile(fh, "__0_0.distcp")
        f.tensor("model.w", (0,), torch.float32, (4,), torch.arange(4.0))
        f.value("optim.param_groups.0.lr", _Planted(marker))
    from reshard.formats.dcp.records import TensorSpec, metadata_bytes

    (folder / METADATA).write_bytes(metadata_bytes(
        {"model.w": TensorSpec(torch.float32, (4,), (((0,), (4,)),))}, ["optim.param_groups.0.lr"], f.records,
        {"model.w": ("model", "w"), "optim.param_groups.0.lr": ("optim", "param_groups", 0, "lr")}))
    ck = DcpCheckpoint.open(folder)
    assert torch.equal(ck.full("model.w"), torch.arange(4.0))
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: entry 'optim.param_groups.0.lr' cannot be loaded"):
        _ = ck.param_groups
    with pytest.raises(CheckpointError, match="cannot be loaded weights-only"):
        reshard_dcp_files(folder, tmp_path / "out", files=2)
    assert not marker.exists() and not (tmp_path / "out" / "ck").exists()


def test_truncated_and_missing_files(source: Path, tmp_path: Path) -> None:
    f = source / "__0_0.distcp"
    data = f.read_bytes()
    f.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: truncated: '[^']+' lies at bytes"):
        DcpCheckpoint.open(source)
    with pytest.raises(CheckpointError, match="truncated"):
        reshard_dcp_files(source, tmp_path / "out", files=2)
    assert not (tmp_path / "out" / "src").exists()
    f.unlink()
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: file is missing \(it holds '"):
        DcpCheckpoint.open(source)


def test_corrupt_chunk_bytes_name_the_tensor(source: Path) -> None:
    ck = DcpCheckpoint.open(source)
    c = ck.entry("model.norm.weight").chunks[0]
    f = source / c.file
    data = bytearray(f.read_bytes())
    data[c.offset:c.offset + c.length] = b"\0" * c.length
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"'model.norm.weight' chunk at \[0\]: not a torch.save record"):
        DcpCheckpoint.open(source).full("model.norm.weight")


def _edit_chunks(source: Path, key: str, chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
    """Rewrite ``key``'s chunk list (each chunk keeps a storage record, so only geometry is wrong)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    md = pickle.loads((source / METADATA).read_bytes())
    entry = md.state_dict_metadata[key]
    info = next(v for k, v in md.storage_data.items() if k.fqn == key)
    md.storage_data = {k: v for k, v in md.storage_data.items() if k.fqn != key}
    entry.chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks]
    for i, (o, _) in enumerate(chunks):
        md.storage_data[MetadataIndex(key, torch.Size(o), i)] = info
    (source / METADATA).write_bytes(pickle.dumps(md))


@pytest.mark.parametrize("chunks, error", [
    ([((0, 0), (6, 6)), ((5, 0), (5, 6))], "chunks overlap"),
    ([((0, 0), (6, 6)), ((7, 0), (3, 6))], "leave a hole"),
    ([((0, 0), (6, 6)), ((6, 0), (5, 6))], "outside it"),
])
def test_chunks_that_overlap_or_leave_holes(source: Path, tmp_path: Path, chunks, error) -> None:
    _edit_chunks(source, "model.embed.weight", chunks)
    with pytest.raises(CheckpointError, match=f"'model.embed.weight'.*{error}|{error}.*'model.embed.weight'"):
        DcpCheckpoint.open(source).param_map("model.embed.weight")
    with pytest.raises(CheckpointError, match=error):
        reshard_dcp_files(source, tmp_path / "out", files=2)
    assert not (tmp_path / "out" / "src").exists()


def test_safetensors_serialization_is_refused_by_name(tmp_path: Path) -> None:
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.randn(4, 3)}}, storage_writer=FileSystemWriter(
            str(tmp_path / "st"), serialization_format=SerializationFormat.SAFETENSORS))
    with pytest.raises(CheckpointError, match="serialization_format=SAFETENSORS"):
        DcpCheckpoint.open(tmp_path / "st").full("model.w")


def test_a_box_listed_twice_is_one_replica(source: Path, tmp_path: Path) -> None:
    _edit_chunks(source, "model.embed.weight", [((0, 0), (10, 6)), ((0, 0), (10, 6))])
    ck = DcpCheckpoint.open(source)
    assert len(ck.entry("model.embed.weight").chunks) == 1
    assert torch.equal(ck.full("model.embed.weight"), _state()["model"]["embed.weight"])


def test_dcp_to_dcp_is_a_route_and_bad_renames_are_refused(source: Path, tmp_path: Path) -> None:
    """DCP -> DCP (one chunk per tensor) is a route like any other: every tensor comes back."""
    out = convert(source, tmp_path / "o", fmt="dcp").out_dir
    a, b = DcpCheckpoint.open(source), DcpCheckpoint.open(out)
    assert set(a.tensors) <= set(b.tensors)
    for key in a.tensors:
        assert torch.equal(a.full(key).float(), b.full(key))
    with pytest.raises(ReshardError, match="--rename takes FROM=TO"):
        convert(tag_dir("llama_zero1_dp2"), tmp_path / "o", fmt="dcp", rename=["nope"])


# -- CLI ---------------------------------------------------------------------------------------


def test_cli_inspect_plan_and_reshard(source: Path, tmp_path: Path, capsys) -> None:
    from reshard.cli import main

    assert main(["reshard", source, tmp_path / "out", "--files", "2"]) == 0
    out = tmp_path / "out" / "src"
    assert main(["inspect", out]) == 0
    text = capsys.readouterr().out
    assert "PyTorch DCP checkpoint, 2 storage ranks" in text and "model.embed.weight" in text
    assert main(["plan", source, "--to", out]) == 0
    assert "segments" in capsys.readouterr().out
    assert main(["reshard", source, tmp_path / "o2", "--files", "2", "--tp", "2"]) == 2
    # a DeepSpeed checkpoint laid out as DCP for 2 loading ranks: a route like any other
    assert main(["reshard", tag_dir("llama_zero1_dp2"), tmp_path / "o3", "--files", "2"]) == 0
    assert sorted(p.name for p in (tmp_path / "o3" / "global_step3").iterdir() if p.suffix == ".distcp") == [
        "__0_0.distcp", "__1_0.distcp"]
    assert main(["plan", source, "--tp", "2"]) == 2


# -- the checkpoints FSDP2 wrote ---------------------------------------------------------------

FSDP = DCP


@pytest.mark.parametrize("name", ["llama_fsdp2_ws2", "llama_fsdp_tp_2x2"])
def test_fsdp_checkpoints_to_safetensors_and_to_n_ranks(name: str, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    src = FSDP / name
    ref = _consolidated(src, tmp_path)
    out = convert(src, tmp_path / "st", fmt="safetensors").out_dir
    got = load_file(out / "model.safetensors")
    assert sorted(got) == sorted(ref["model"])
    for k, t in ref["model"].items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), k
    for n in (1, 3):
        again = reshard_dcp_files(src, tmp_path / f"n{n}", files=n).out_dir
        _same(_consolidated(again, tmp_path), ref)
