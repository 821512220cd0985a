"""The committed PyTorch DCP fixtures (``tests/fixtures/dcp/``) checked with torch alone: their
files, torch's own consolidation against the recorded digests, the chunk layout a reader meets,
the recipe shared with the DeepSpeed fixtures, and a real FSDP2 job at 3 ranks loading them
(one ``torchrun`` launch per fixture, ~10 s each)."""

from __future__ import annotations

import hashlib
import json
import math
import pickle
import pickletools
import warnings
from pathlib import Path

import pytest
import torch

from tests.e2e.digest import digest
from tests.support.dcp_jobs import FIXTURES, run_fsdp_job  # (puts scripts/ on sys.path)

pytest.importorskip("torch.distributed.checkpoint")
from make_fixtures import pickle_bytes_globals  # noqa: E402
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save  # noqa: E402

from tests.support.paths import DEEPSPEED

NAMES = ["llama_fsdp2_ws2", "llama_fsdp_tp_2x2"]
DEEPSPEED = DEEPSPEED
KINDS = ("param", "exp_avg", "exp_avg_sq")
# every global the .metadata pickles of torch 2.13's FileSystemWriter name (a reader's allow-list)
METADATA_GLOBALS = {
    "pathlib.PosixPath",  # StorageMeta.checkpoint_id
    "torch.Size",
    "torch.float32",
    "torch.serialization._get_layout",  # TensorProperties.layout
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    *(f"torch.distributed.checkpoint.metadata.{n}" for n in (
        "BytesStorageMetadata", "ChunkStorageMetadata", "Metadata", "MetadataIndex", "StorageMeta",
        "TensorProperties", "TensorStorageMetadata", "_MEM_FORMAT_ENCODING")),
}


def _fixture(name: str) -> dict:
    return json.loads((FIXTURES / name / "fixture.json").read_text())


def _metadata(name: str):
    # torch's own pickle of a fixture committed here (dcp_to_torch_save unpickles it too)
    with open(FIXTURES / name / ".metadata", "rb") as f:
        return pickle.load(f)


def _consolidated(name: str, tmp: Path) -> dict:
    out = tmp / f"{name}.pt"
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore")
        dcp_to_torch_save(str(FIXTURES / name), str(out))
    return torch.load(out, weights_only=True)


@pytest.mark.parametrize("name", NAMES)
def test_files_are_the_recorded_ones(name: str) -> None:
    fx = _fixture(name)
    folder = FIXTURES / name
    assert sorted(p.name for p in folder.iterdir()) == sorted([*fx["files"], "fixture.json"])
    assert len([f for f in fx["files"] if f.endswith(".distcp")]) == fx["world_size"]
    for fname, info in fx["files"].items():
        data = (folder / fname).read_bytes()
        assert len(data) == info["bytes"], fname
        assert hashlib.sha256(data).hexdigest() == info["sha256"], fname


@pytest.mark.parametrize("name", NAMES)
def test_torch_consolidation_matches_the_recorded_digests(name: str, tmp_path: Path) -> None:
    fx = _fixture(name)
    sd = _consolidated(name, tmp_path)
    assert sorted(sd["model"]) == sorted(fx["digests"])
    for fqn, kinds in fx["digests"].items():
        state = sd["optim"]["state"][fqn]
        got = {"param": sd["model"][fqn], "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}
        for kind in KINDS:
            assert digest(fqn, got[kind]) == kinds[kind], (fqn, kind)
        assert state["step"].shape == () and float(state["step"]) == fx["steps"] == fx["adam_step"]
    (group,) = sd["optim"]["param_groups"]
    assert group["params"] == list(fx["digests"])  # FQNs, in named_parameters() order
    opt = fx["optimizer"]
    assert (group["lr"], list(group["betas"]), group["eps"], group["weight_decay"]) == (
        opt["lr"], opt["betas"], opt["eps"], opt["weight_decay"])


@pytest.mark.parametrize("name", NAMES)
def test_metadata_pickle_and_keys(name: str) -> None:
    fx = _fixture(name)
    data = (FIXTURES / name / ".metadata").read_bytes()
    ops = {op.name for op, _, _ in pickletools.genops(data)}
    assert "STACK_GLOBAL" in ops and "GLOBAL" not in ops  # protocol 4
    assert pickle_bytes_globals(data) == fx["metadata"]["pickle_globals"]
    assert set(fx["metadata"]["pickle_globals"]) <= METADATA_GLOBALS
    md = _metadata(name)
    meta = md.state_dict_metadata
    fqns = list(fx["digests"])
    assert {f"model.{f}" for f in fqns} | {f"optim.state.{f}.{k}" for f in fqns
                                           for k in ("exp_avg", "exp_avg_sq", "step")} <= set(meta)
    groups = {k for k in meta if k.startswith("optim.param_groups.")}
    assert {k.rsplit(".", 1)[1] for k in groups} >= {"lr", "betas", "eps", "weight_decay", "params"}
    assert all(type(meta[k]).__name__ == "BytesStorageMetadata" for k in groups)
    assert len(meta) == len(fqns) * 4 + len(groups)
    step = meta[f"optim.state.{fqns[0]}.step"]  # a 0-d fp32 tensor in one chunk
    assert tuple(step.size) == () and [tuple(c.sizes) for c in step.chunks] == [()]
    assert step.properties.dtype == torch.float32
    # every chunk's bytes live in exactly one storage item, keyed by (fqn, chunk offsets);
    # bytes entries are keyed with offset None
    keys = {(i.fqn, None if i.offset is None else tuple(i.offset)) for i in md.storage_data}
    chunks = {(k, tuple(c.offsets)) for k, v in meta.items() for c in getattr(v, "chunks", [])}
    assert keys == chunks | {(k, None) for k in groups}


def test_two_dimensional_chunks_are_plain_boxes() -> None:
    """FSDP x TP on a (dp=2, tp=2) mesh: column-parallel weights carry (_StridedShard(0, sf=2),
    Shard(0)) and their chunks are row blocks ordered by rank (dp-major), so dp rank d of tp rank
    t holds rows [(2t + d) * n/4, ...); row-parallel weights carry (Shard(0), Shard(1)): quarter
    blocks. Weights outside the TP plan are FSDP halves, once each (TP replicas deduplicated)."""
    fx = _fixture("llama_fsdp_tp_2x2")
    meta = _metadata("llama_fsdp_tp_2x2").state_dict_metadata

    def boxes(key: str) -> list:
        return [(tuple(c.offsets), tuple(c.sizes)) for c in meta[key].chunks]

    q = "model.layers.0.self_attn.q_proj.weight"
    assert fx["params"][q]["placements"] == ["_S(0, 2)", "S(0)"]  # str(_StridedShard(dim=0, sf=2))
    assert boxes(f"model.{q}") == [((0, 0), (8, 32)), ((16, 0), (8, 32)), ((8, 0), (8, 32)), ((24, 0), (8, 32))]
    assert boxes(f"optim.state.{q}.exp_avg") == boxes(f"model.{q}")
    gate = "model.model.layers.1.mlp.gate_proj.weight"  # 88 rows
    assert boxes(gate) == [((0, 0), (22, 32)), ((44, 0), (22, 32)), ((22, 0), (22, 32)), ((66, 0), (22, 32))]
    o = "model.layers.0.self_attn.o_proj.weight"
    assert fx["params"][o]["placements"] == ["S(0)", "S(1)"]
    assert boxes(f"model.{o}") == [((0, 0), (16, 16)), ((0, 16), (16, 16)), ((16, 0), (16, 16)), ((16, 16), (16, 16))]
    down = "model.model.layers.0.mlp.down_proj.weight"  # [32, 88]
    assert boxes(down) == [((0, 0), (16, 44)), ((0, 44), (16, 44)), ((16, 0), (16, 44)), ((16, 44), (16, 44))]
    assert boxes("model.model.norm.weight") == [((0,), (16,)), ((16,), (16,))]
    assert boxes("model.lm_head.weight") == [((0, 0), (48, 32)), ((48, 0), (48, 32))]


@pytest.mark.parametrize("name,deepspeed", [("llama_fsdp2_ws2", "llama_zero1_dp2"),
                                            ("llama_fsdp_tp_2x2", "llama_tp2_dp2")])
def test_same_recipe_as_the_deepspeed_fixture(name: str, deepspeed: str) -> None:
    """Same model, init, batch split, AdamW and clipping as the DeepSpeed fixture of the same DP:
    rank 0's losses of the 3 steps are the very same floats, and the parameter names are
    DeepSpeed's ``param_shapes`` names."""
    fx, ds = _fixture(name), json.loads((DEEPSPEED / deepspeed / "fixture.json").read_text())
    assert fx["model_config"] == ds["model_config"] and fx["seed"] == ds["seed"]
    assert fx["losses_rank0"] == ds["losses"]
    assert fx["deepspeed_same_recipe"]["losses_rank0_equal"] is True
    model_states = next((DEEPSPEED / deepspeed).glob("global_step*/mp_rank_00_model_states.pt"))
    # DeepSpeed's pickle needs its own classes; read only the names (no unpickling of globals)
    import zipfile

    with zipfile.ZipFile(model_states) as zf:
        pkl = zf.read(next(n for n in zf.namelist() if n.endswith("data.pkl")))
    strings = {arg for op, arg, _ in pickletools.genops(pkl) if op.name.endswith("UNICODE")}
    assert set(fx["digests"]) <= strings


@pytest.fixture(scope="module", params=[pytest.param(n, marks=[pytest.mark.slow] if i else []) for i, n in enumerate(NAMES)])
def loaded_at_three(request) -> tuple[str, dict]:
    return request.param, run_fsdp_job("load", 3, FIXTURES / request.param, steps=1)


def test_fsdp2_load_at_three_ranks_reproduces_the_state(loaded_at_three: tuple[str, dict]) -> None:
    name, rep = loaded_at_three
    fx = _fixture(name)
    assert rep["world_size"] == 3 and rep["mesh"] == {"dp": 3, "tp": 1}
    assert rep["digests"] == fx["digests"]  # weights and both moments, bit for bit
    assert rep["adam_step"] == fx["adam_step"] == 3
    uneven = [f for f, p in rep["params"].items() if p["shape"][0] % 3]
    assert "model.layers.0.self_attn.q_proj.weight" in uneven  # 32 rows: FSDP2 pads to 3 x 11
    assert all(p["placements"] == ["S(0)"] for p in rep["params"].values())
    for fqn, kinds in rep["tensors"].items():
        assert {k: digest(fqn, t) for k, t in kinds.items()} == fx["digests"][fqn]
    (group,) = rep["param_groups"]
    assert group["lr"] == fx["optimizer"]["lr"]
    (loss,) = rep["losses"]
    assert math.isfinite(loss) and loss < fx["losses"][-1]  # training goes on from the saved state
