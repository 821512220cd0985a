"""What the fuzz suite found (``python -m tests.fuzz --seed 20261201 --budget 520``), each case
rebuilt from its committed fixture in ``tmp_path`` and refused by every command, naming the file,
with no output folder left."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from reshard.cli import main as cli
from reshard.formats.megatron import safe
from reshard.storage.pickling import save
from reshard.storage.safe_load import load
from tests.support.damage import copy_fixture, flip_tensor
from tests.support.paths import DEEPSPEED, MEGATRON

LEGACY_ITER = "iter_0000003"


def _refused_by_all(argvs: list[list], victim: Path, tmp_path: Path, capsys, *needles: str) -> None:
    for argv in argvs:
        code = cli([str(a) for a in argv])
        err = capsys.readouterr().err
        assert code == 2 and str(victim) in err, (argv, err)
        for n in needles:
            assert re.search(n, err), (n, err)
    assert not (tmp_path / "out").exists()


def _convert_both(ck: Path, tmp_path: Path) -> list[list]:
    return [["convert", ck, tmp_path / "out", "--format", fmt] for fmt in ("ucp", "safetensors")]


def _legacy(sd_path: Path) -> dict:
    from reshard.storage import safe_load

    return safe_load.load(sd_path, mmap=False, allow=safe.ALLOW)


@pytest.mark.parametrize("rank_dir", ["mp_rank_00_001", "mp_rank_01_000"])
def test_legacy_megatron_flipped_tensor_record_is_refused(tmp_path, capsys, rank_dir):
    """Cases 55 and 412: legacy files were read by torch.load, which checks no CRC."""
    ck = copy_fixture(MEGATRON / "legacy_tp2_pp2", tmp_path)
    victim = ck / LEGACY_ITER / rank_dir / "model_optim_rng.pt"
    flip_tensor(victim)
    _refused_by_all(_convert_both(ck, tmp_path), victim, tmp_path, capsys, "CRC-32")


def test_legacy_megatron_moment_resaved_as_bf16_is_refused(tmp_path, capsys):
    """Case 138: the distributed optimizer's exp_avg re-saved as bf16 was cast back silently."""
    ck = copy_fixture(MEGATRON / "legacy_dp2_distopt", tmp_path)
    victim = ck / LEGACY_ITER / "mp_rank_00" / "distrib_optim.pt"
    obj = _legacy(victim)
    (buf,) = obj[0].values()
    buf["exp_avg"] = buf["exp_avg"].to(torch.bfloat16)
    victim.write_bytes(safe.dumps(obj))
    _refused_by_all([["convert", ck, tmp_path / "out", "--format", "ucp"]], victim, tmp_path, capsys,
                    "exp_avg", "bfloat16")


def test_legacy_megatron_tp_rank_files_swapped_are_refused(tmp_path, capsys):
    """Cases 13, 202, 223: two TP ranks' files of one stage have the same shapes; each records
    the global rank that saved it (``args.rank``)."""
    ck = copy_fixture(MEGATRON / "legacy_tp2_pp2", tmp_path)
    a, b = (ck / LEGACY_ITER / f"mp_rank_0{t}_000" / "model_optim_rng.pt" for t in (0, 1))
    a.rename(tmp_path / "swap")
    b.rename(a)
    (tmp_path / "swap").rename(b)
    _refused_by_all([*_convert_both(ck, tmp_path), ["inspect", ck]], a, tmp_path, capsys,
                    "saved by global rank 1", "swapped")


def test_zero_step_dropped_from_one_rank_is_refused(tmp_path, capsys):
    """Case 484: rank 0's group 0 lost its step; the step of another rank was written instead."""
    ck = copy_fixture(DEEPSPEED / "llama_zero1_dp2_bf16", tmp_path)
    victim = ck / "global_step3" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    sd = load(victim, mmap=False)
    del sd["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["step"]
    save(sd, victim)
    _refused_by_all([*_convert_both(ck, tmp_path), ["reshard", ck, tmp_path / "out", "--dp", "1"]], victim, tmp_path,
                    capsys, "step or moment is missing")


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="needs /dev/zero")
def test_megatron_metadata_symlinked_to_a_device_is_refused(tmp_path, capsys):
    """Seed 1, case 82: ``.metadata`` -> ``/dev/zero`` was read until memory ran out."""
    ck = copy_fixture(MEGATRON / "torch_dist_tp2_dp2_distopt", tmp_path)
    victim = ck / LEGACY_ITER / ".metadata"
    victim.unlink()
    victim.symlink_to("/dev/zero")
    _refused_by_all([*_convert_both(ck, tmp_path), ["inspect", ck]], victim, tmp_path, capsys, "not a regular file")


@pytest.mark.parametrize("fixture", ["moe_ep2", "mixtral_autoep_ep2"])
def test_expert_checkpoint_dp_rank_optimizer_files_swapped_are_refused(tmp_path, capsys, fixture):
    """Seed 1, case 382: with experts, no route checked the dense groups' recorded layout
    against DeepSpeed's (only --verify deep caught the swap)."""
    ck = copy_fixture(DEEPSPEED / fixture, tmp_path)
    tag = ck / (ck / "latest").read_text().strip()
    a, b = (next(tag.glob(f"*zero_pp_rank_{d}_mp_rank_00_optim_states.pt")) for d in (0, 1))
    a.rename(tmp_path / "swap")
    b.rename(a)
    (tmp_path / "swap").rename(b)
    _refused_by_all([*_convert_both(ck, tmp_path), ["reshard", ck, tmp_path / "out"], ["inspect", ck]], tag, tmp_path,
                    capsys, "param_slice_mappings differ")


def test_universal_model_states_symlinked_to_a_device_is_refused(tmp_path, capsys):
    """Seed 2, case 303: a model-state file beside ``zero/`` that is no regular file was skipped,
    and with it the shapes it records."""
    ucp = tmp_path / "ucp"
    assert cli(["convert", str(DEEPSPEED / "llama_zero1_dp2"), str(ucp)]) == 0
    capsys.readouterr()
    victim = ucp / "global_step3" / "mp_rank_00_model_states.pt"
    victim.unlink()
    victim.symlink_to("/dev/zero")
    _refused_by_all([*_convert_both(ucp, tmp_path), ["inspect", ucp]], victim, tmp_path, capsys, "not a regular file")


def test_trainer_checkpoint_without_its_state_is_refused_by_reshard(tmp_path, capsys):
    """Seed 2, case 217: without ``trainer_state.json`` a Trainer checkpoint was written as a bare
    DeepSpeed one, its RNG states and Trainer files dropped."""
    from tests.support.paths import HF

    ck = copy_fixture(HF / "trainer_llama_zero2" / "checkpoint-3", tmp_path)
    (ck / "trainer_state.json").unlink()
    code = cli(["reshard", str(ck), str(tmp_path / "out" / "checkpoint-3"), "--dp", "1"])
    err = capsys.readouterr().err
    assert code == 2 and str(ck / "trainer_state.json") in err and "missing" in err, err
    assert not (tmp_path / "out").exists()


def test_safetensors_header_entry_dropped_is_refused(tmp_path, capsys):
    """Seed 3, case 137: the tied embedding's header entry dropped from a safetensors file: its
    bytes belonged to no entry, and every route wrote a model without it."""
    import json
    import struct

    from tests.support.paths import HF

    ck = copy_fixture(HF / "pretrained_qwen2_tied", tmp_path)
    victim = ck / "model.safetensors"
    raw = victim.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    del header["model.embed_tokens.weight"]
    body = json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    victim.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n:])
    _refused_by_all([*_convert_both(ck, tmp_path), ["reshard", ck, tmp_path / "out", "--tp", "1", "--dp", "2"],
                     ["inspect", ck]], victim, tmp_path, capsys, "belong to no header entry")


def test_moe_model_states_missing_ds_autoep_layers_is_refused(tmp_path, capsys):
    """Seed 3, case 445: DeepSpeed writes ``ds_autoep_layers`` into every model-state file of a
    checkpoint with experts; a file without it is not one DeepSpeed wrote, and was carried on."""
    ck = copy_fixture(DEEPSPEED / "moe_ep2", tmp_path)
    victim = ck / "global_step3" / "mp_rank_00_model_states.pt"
    sd = load(victim, mmap=False)
    del sd["ds_autoep_layers"]
    save(sd, victim)
    _refused_by_all([*_convert_both(ck, tmp_path), ["reshard", ck, tmp_path / "out"]], victim, tmp_path, capsys,
                    "ds_autoep_layers")


@pytest.mark.parametrize("fixture,metadata", [("megatron/torch_dist_pp2_uneven", "iter_0000003/.metadata"),
                                              ("dcp/llama_fsdp2_ws2", ".metadata")])
def test_dcp_metadata_dtype_disagreeing_with_its_record_is_refused_by_inspect(tmp_path, capsys, fixture, metadata):
    """Fuzz case 149 (seed 20261201, budget 520, ``torch_dist_pp2_uneven``: ``.metadata``'s dtype of
    ``output_layer.weight`` float32 -> float16): ``convert`` refused it when it read the record, but
    ``inspect`` reads no tensor and printed the float16 sizes. Every chunk's record is now checked against
    the metadata's dtype and shape when the reader opens the source (``DcpCheckpoint.check_records``), so
    ``inspect`` and every route refuse it naming the file, before any output."""
    import pickle

    from tests.support.paths import DCP

    base = {"megatron": MEGATRON, "dcp": DCP}[fixture.split("/")[0]]
    ck = copy_fixture(base / fixture.split("/")[1], tmp_path)
    md = pickle.loads((ck / metadata).read_bytes())  # our own fixture: trusted here
    key = next(k for k, e in md.state_dict_metadata.items()
               if getattr(getattr(e, "properties", None), "dtype", None) == torch.float32 and len(e.size) == 2)
    md.state_dict_metadata[key].properties.dtype = torch.float16
    (ck / metadata).write_bytes(pickle.dumps(md))
    _refused_by_all([["inspect", ck], *_convert_both(ck, tmp_path)], ck, tmp_path, capsys,
                    rf"{re.escape(repr(key))} chunk at .* holds a torch.float32 .* the metadata says torch.float16")
