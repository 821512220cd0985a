"""reshard convert: replica drift, safety against bad input, crash safety, formats, verify."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reshard.cli import main as cli
from reshard.errors import CheckpointError, ReplicaMismatchError
from reshard.jobs.convert import convert
from reshard.storage.pickling import save
from reshard.storage.safe_load import load
from reshard.storage.staging import verify
from tests.support.dsconv import FIXTURES, tag_dir

BIGCODE_DRIFTED = [f"transformer.h.{i}.attn.c_attn.{k}" for i in (0, 1) for k in ("weight", "bias")]


def _copy(name: str, tmp: Path) -> Path:
    dst = tmp / name
    shutil.copytree(FIXTURES / name, dst)
    return dst


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_replica_drift_fails_by_default_naming_every_parameter(tmp_path):
    with pytest.raises(ReplicaMismatchError) as e:
        convert(FIXTURES / "gpt_bigcode_tp2", tmp_path)
    for name in BIGCODE_DRIFTED:
        assert name in str(e.value)
    assert "ranks [0, 1]" in str(e.value)
    assert list(tmp_path.iterdir()) == []  # nothing that looks like output
    assert cli(["convert", str(FIXTURES / "gpt_bigcode_tp2"), str(tmp_path / "cli")]) == 2


def test_replica_drift_resolved_by_explicit_policy(tmp_path):
    report = convert(FIXTURES / "gpt_bigcode_tp2", tmp_path, on_replica_mismatch="rank:0")
    assert {d.param for d in report.drift} == set(BIGCODE_DRIFTED)
    manifest = json.loads((report.out_dir / "reshard-manifest.json").read_text())
    assert manifest["on_replica_mismatch"] == "rank:0" and len(manifest["replica_drift"]) == 12
    # the kv rows come from rank 0's copy
    tag = tag_dir("gpt_bigcode_tp2")
    name = "transformer.h.0.attn.c_attn.weight"
    f = load(report.out_dir / "zero" / name / "fp32.pt")["param"]
    rank0 = _raw_master(tag, name, 0)
    assert torch.equal(f[32:], rank0[32:])
    mean = convert(FIXTURES / "gpt_bigcode_tp2", tmp_path / "mean", on_replica_mismatch="mean")
    fm = load(mean.out_dir / "zero" / name / "fp32.pt")["param"]
    rank1 = _raw_master(tag, name, 1)
    assert torch.allclose(fm[32:], (rank0[32:].double() + rank1.double()).div(2).float())
    assert torch.equal(fm[:32], f[:32])


def _raw_master(tag, name: str, t: int) -> torch.Tensor:
    """TP rank ``t``'s fp32 master of ``name``, read straight from the raw ZeRO-1/2 files: its
    fragments (``param_slice_mappings``) over the DP ranks in order, shaped as ``param_shapes`` says."""
    files = sorted(tag.glob(f"*zero_pp_rank_*_mp_rank_{t:02d}_optim_states.pt"),
                   key=lambda p: int(p.name.split("zero_pp_rank_")[1].split("_")[0]))
    parts = []
    for path in files:
        osd = load(path)["optimizer_state_dict"]
        for g, mapping in enumerate(osd["param_slice_mappings"]):
            if name in mapping:
                frag = mapping[name]
                parts.append(osd["single_partition_of_fp32_groups"][g].narrow(0, int(frag.start), int(frag.numel)))
    shapes = load(tag / f"mp_rank_{t:02d}_model_states.pt")["param_shapes"]
    shape = next(g[name] for g in (shapes if isinstance(shapes, list) else [shapes]) if name in g)
    return torch.cat(parts).view(tuple(shape))


def test_bad_policy_is_refused(tmp_path):
    with pytest.raises(ValueError, match="on_replica_mismatch"):
        convert(FIXTURES / "llama_tp2", tmp_path, on_replica_mismatch="first")


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/reshard-pwned",))


def test_planted_code_executing_pickle_is_refused(tmp_path):
    ck = _copy("llama_tp2", tmp_path)
    target = tag_dir("llama_tp2").name
    victim = ck / target / "mp_rank_00_model_states.pt"
    torch.save({"module": {}, "evil": _Evil()}, victim)
    if os.path.exists("/tmp/reshard-pwned"):
        os.remove("/tmp/reshard-pwned")
    with pytest.raises(CheckpointError) as e:
        convert(ck, tmp_path / "out")
    assert str(victim) in str(e.value) and "system" in str(e.value)
    assert not os.path.exists("/tmp/reshard-pwned")
    assert not (tmp_path / "out" / target).exists()


def test_plain_pickle_of_unknown_class_is_refused(tmp_path):
    p = tmp_path / "x.pt"
    with open(p, "wb") as f:
        pickle.dump({"a": _Evil()}, f)
    with pytest.raises(CheckpointError, match=str(p)):
        load(p)


def test_truncated_file(tmp_path):
    ck = _copy("llama_zero1_dp2", tmp_path)
    victim = ck / tag_dir("llama_zero1_dp2").name / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"{victim}: cannot be read .*truncated or corrupt"):
        convert(ck, tmp_path / "out")
    assert not (tmp_path / "out" / "global_step3").exists()


def test_missing_rank_file(tmp_path):
    ck = _copy("llama_tp2_dp2", tmp_path)
    (ck / tag_dir("llama_tp2_dp2").name / "zero_pp_rank_1_mp_rank_01_optim_states.pt").unlink()
    with pytest.raises(CheckpointError, match=r"optimizer state files are missing for tp 1 dp 1"):
        convert(ck, tmp_path / "out")


def test_missing_latest_target_and_not_a_checkpoint(tmp_path):
    (tmp_path / "latest").write_text("global_step9")
    with pytest.raises(CheckpointError, match="names tag 'global_step9'"):
        convert(tmp_path, tmp_path / "out")
    with pytest.raises(CheckpointError, match="not a DeepSpeed checkpoint"):
        convert(tmp_path / "out", tmp_path / "o2") if (tmp_path / "out").mkdir() is None else None


def _rewrite(path: Path, edit) -> None:
    obj = load(path, mmap=False)
    edit(obj)
    save(obj, path)


def test_shapes_that_disagree_with_the_map(tmp_path):
    ck = _copy("llama_tp2", tmp_path)
    tag = ck / tag_dir("llama_tp2").name
    key = r"^model\.layers\.0\.self_attn\.q_proj\.weight$"

    def edit(sd):
        entry = sd["universal_checkpoint_info"]["affine_map"]["params"][key]
        entry["ranks"][1]["shard_shape"] = [8, 32]

    _rewrite(tag / "mp_rank_00_model_states.pt", edit)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight.*TP rank 1 shard shape"):
        convert(ck, tmp_path / "out")


def test_unknown_optimizer_state_layout(tmp_path):
    ck = _copy("llama_zero1_dp2", tmp_path)
    victim = ck / tag_dir("llama_zero1_dp2").name / "zero_pp_rank_0_mp_rank_00_optim_states.pt"

    def edit(sd):
        del sd["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["exp_avg"]

    _rewrite(victim, edit)
    with pytest.raises(CheckpointError, match=rf"{victim}: group 0 holds \['step', 'exp_avg_sq'\]: a step or moment is missing"):
        convert(ck, tmp_path / "out")


KILL_SCRIPT = """
import os, signal, sys
from reshard.jobs.convert import convert
def progress(done, total):
    if done == 5:
        os.kill(os.getpid(), signal.SIGKILL)
convert(sys.argv[1], sys.argv[2], progress=progress)
"""


def test_killed_conversion_leaves_nothing_finished_and_rerun_matches(tmp_path):
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, "-c", KILL_SCRIPT, str(FIXTURES / "llama_tp2_dp2"), str(out)],
                         capture_output=True, timeout=300)
    assert res.returncode == -9
    assert not (out / "global_step3").exists() and not (out / "latest_universal").exists()
    assert [p.name for p in out.iterdir()] == [".reshard-partial-global_step3"]
    convert(FIXTURES / "llama_tp2_dp2", out)
    clean = convert(FIXTURES / "llama_tp2_dp2", tmp_path / "clean")
    assert not (out / ".reshard-partial-global_step3").exists()
    assert _files(out / "global_step3") == _files(clean.out_dir)  # byte-identical
    verify(out)


def test_existing_output_is_not_clobbered(tmp_path):
    convert(FIXTURES / "llama_zero1_dp2", tmp_path)
    with pytest.raises(CheckpointError, match="already exists"):
        convert(FIXTURES / "llama_zero1_dp2", tmp_path)
    convert(FIXTURES / "llama_zero1_dp2", tmp_path, overwrite=True, workers=2)
    verify(tmp_path / "global_step3")


def test_verify_catches_tampering(tmp_path):
    r = convert(FIXTURES / "llama_zero1_dp2", tmp_path)
    assert cli(["verify", str(tmp_path)]) == 0
    victim = r.out_dir / "zero" / "lm_head.weight" / "fp32.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="differs from the manifest"):
        verify(r.out_dir)
    assert cli(["verify", str(tmp_path)]) == 2


@pytest.mark.parametrize("name", ["llama_tp2_dp2", "llama_zero3_dp2", "llama_zero1_dp2_bf16", "llama_zero3_tp2_dp2",
                                  "tp_pipe_tp2_pp2", "mixtral_autoep_ep2", "mixtral_autoep_ep2_zero3", "moe_ep2"])
def test_safetensors_output(name, tmp_path):
    """One file set per kind of checkpoint (TP, ZeRO-3 with and without TP, bf16, TP x PP, AutoEP
    at ZeRO-1 and ZeRO-3, classic MoE): every tensor is the universal conversion's fp32 master."""
    from safetensors.torch import load_file

    ucp = convert(FIXTURES / name, tmp_path / "ucp").out_dir
    st = convert(FIXTURES / name, tmp_path / "st", fmt="safetensors", max_file_bytes=8 * 1024).out_dir
    index = json.loads((st / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1  # split by size
    tensors = {}
    for f in files:
        tensors.update(load_file(st / f))
    assert set(tensors) == set(index["weight_map"])
    for n, t in tensors.items():
        ref = load(ucp / "zero" / n / "fp32.pt")
        ref = ref["param"] if isinstance(ref, dict) else ref
        assert torch.equal(t.reshape(-1), ref.reshape(-1)), n
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in tensors.values())


def test_parent_folder_with_latest_and_tag_folder_give_the_same_output(tmp_path):
    a = convert(FIXTURES / "llama_tp2", tmp_path / "a").out_dir
    b = convert(tag_dir("llama_tp2"), tmp_path / "b").out_dir
    fa, fb = _files(a), _files(b)
    ma, mb = json.loads(fa.pop("reshard-manifest.json")), json.loads(fb.pop("reshard-manifest.json"))
    assert fa == fb and ma["files"] == mb["files"]


def test_parallel_workers_give_the_same_bytes(tmp_path):
    one = convert(FIXTURES / "gpt_bigcode_tp2", tmp_path / "one", on_replica_mismatch="rank:1")
    two = convert(FIXTURES / "gpt_bigcode_tp2", tmp_path / "two", on_replica_mismatch="rank:1", workers=3)
    assert _files(one.out_dir) == _files(two.out_dir)  # the manifest's drift list included
    assert [str(d) for d in one.drift] == [str(d) for d in two.drift]


LIMIT_SCRIPT = r"""
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[3]), int(sys.argv[3])))
from reshard.cli import main
sys.exit(main(["convert", sys.argv[1], sys.argv[2], "--workers", "2"]))
"""


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs POSIX resource limits")
def test_output_that_cannot_be_written_is_a_clear_error_and_leaves_nothing(tmp_path):
    """A real write failure (the OS refuses a file past RLIMIT_FSIZE, as it would on a full disk):
    exit status 2, the file named with the OS's reason, and no output left behind."""
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, "-c", LIMIT_SCRIPT, str(FIXTURES / "llama_tp2_dp2"), str(out), "20000"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "cannot write the output (File too large)" in res.stderr and ".pt" in res.stderr
    assert "Traceback" not in res.stderr
    assert not out.exists()  # partial folder removed, and the output folder the job made: nothing left


@pytest.mark.parametrize("checksum", ["crc32", "sha256"])
def test_manifest_checksums_are_those_of_the_files(checksum, tmp_path):
    import hashlib
    import zlib

    r = convert(FIXTURES / "llama_zero1_dp2", tmp_path, checksum=checksum, workers=2)
    files = json.loads((r.out_dir / "reshard-manifest.json").read_text())["files"]
    assert "mp_rank_00_model_states.pt" in files  # the verbatim copy is checksummed too
    for rel, entry in files.items():
        data = (r.out_dir / rel).read_bytes()
        want = f"{zlib.crc32(data):08x}" if checksum == "crc32" else hashlib.sha256(data).hexdigest()
        assert entry == {"size": len(data), checksum: want}, rel
    verify(r.out_dir)
    with pytest.raises(ValueError, match="checksum must be one of"):
        convert(FIXTURES / "llama_zero1_dp2", tmp_path / "bad", checksum="md5")
    assert not (tmp_path / "bad").exists()


def test_pipeline_checkpoint_reads_stages_and_layer_files(tmp_path):
    """A deepspeed.pipe checkpoint: two stages, each its own model-parallel rank file, weights in
    layer files. The layer files' weights are the converted fp32 masters in the model dtype."""
    from reshard.formats.deepspeed.checkpoint import DeepSpeedCheckpoint

    for name, dtype in (("pipe_pp2_dp2", torch.float32), ("pipe_pp2_dp2_bf16_odd", torch.bfloat16)):
        ck = DeepSpeedCheckpoint.open(FIXTURES / name)
        assert (ck.pp, ck.tp, ck.dp, ck.mp) == (2, 1, 2, 2)
        assert ck.names[0] == "0.pos" and ck.names[-1] == "5.lm_head.weight" and len(ck.names) == 25
        r = convert(FIXTURES / name, tmp_path / name, workers=2)
        assert json.loads((r.out_dir / "reshard-manifest.json").read_text())["source_topology"]["pp"] == 2
        for n in ck.names:
            weight = ck.module_tensor(n, 0)
            assert weight is not None and weight.dtype == dtype, n
            master = load(r.out_dir / "zero" / n / "fp32.pt")["param"]
            assert torch.equal(master.to(dtype), weight), n
    safetensors = convert(FIXTURES / "pipe_pp2_dp2", tmp_path / "st", fmt="safetensors")
    index = json.loads((safetensors.out_dir / "model.safetensors.index.json").read_text())
    assert len(index["weight_map"]) == 25


def test_pipeline_x_tensor_parallel_is_refused_clearly(tmp_path):
    src = _copy("pipe_pp2_dp2", tmp_path)
    tag = src / "global_step3"
    (tag / "layer_01-model_states.pt").rename(tag / "layer_01-model_01-model_states.pt")
    with pytest.raises(CheckpointError, match="pipeline x tensor parallel"):
        convert(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_target_without_dp_is_reported_at_dp_1(tmp_path):
    """A target that records no DP (an inference engine's shards) is one replica: DP=1 in the report."""
    from reshard.jobs.reports import Report

    r = Report(tmp_path, {"tp": 2, "dp": 2, "pp": 2, "zero_stage": 1}, {"tp": 4}, params=3, files=1, bytes_written=0)
    assert str(r).startswith(f"wrote {tmp_path}: TP=2 x DP=2 x PP=2 ZeRO-1 -> TP=4 x DP=1 (3 parameters")
