"""Verified reads, on committed fixtures damaged in ``tmp_path``: a flipped byte in a tensor record
(DeepSpeed, DCP, legacy Megatron) is refused naming the file and the record; a moved
central-directory offset is refused; a damaged file that would be copied verbatim is refused;
``--no-verify-source`` lets the flipped byte through and says so. Every refusal leaves no output
folder behind, on every route (the checks that can refuse run before the output folder exists,
and what fails later removes what it made). ``reshard verify SRC`` checks a source."""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import pytest

from reshard.cli import main as cli
from reshard.errors import CheckpointError
from reshard.jobs.convert import convert, reshard
from reshard.storage.pickling import save
from reshard.storage.safe_load import load
from tests.support.damage import copy_fixture, flip_record, flip_tensor, shift_central_offset, truncate
from tests.support.paths import DCP, DEEPSPEED, MEGATRON

TAG = "global_step3"


def _run(argv: list, capsys) -> tuple[int, str]:
    code = cli([str(a) for a in argv])
    return code, capsys.readouterr().err


def _names(err: str, victim: Path, record: str) -> bool:
    """The refusal names the file and the record (under its archive folder) and says CRC-32."""
    return bool(re.search(rf"{re.escape(str(victim))}\S*: record \S*/?{re.escape(record)}\b", err)) and "CRC-32" in err


def _distcp_record(folder: Path) -> tuple[Path, int, int]:
    """(file, offset, length) of the largest record in the first .distcp file (the fixture's own
    .metadata, trusted here)."""
    md = pickle.loads((folder / ".metadata").read_bytes())
    infos = [i for i in md.storage_data.values() if i.relative_path == "__0_0.distcp"]
    info = max(infos, key=lambda i: i.length)
    return folder / info.relative_path, info.offset, info.length


def test_flipped_tensor_byte_in_deepspeed_optim_file_is_refused_naming_file_and_record(tmp_path, capsys):
    ck = copy_fixture(DEEPSPEED / "llama_zero1_dp2", tmp_path)
    victim = ck / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    record = flip_tensor(victim)
    out = tmp_path / "out"
    code, err = _run(["convert", ck, out, "--format", "ucp"], capsys)
    assert code == 2 and _names(err, victim, record), err
    assert not out.exists()


def test_flipped_record_in_a_dcp_file_is_refused_naming_file_and_record(tmp_path, capsys):
    ck = copy_fixture(DCP / "llama_fsdp2_ws2", tmp_path)
    victim, offset, length = _distcp_record(ck)
    record = flip_tensor(victim, offset, length)
    out = tmp_path / "out"
    code, err = _run(["convert", ck, out, "--format", "safetensors"], capsys)
    assert code == 2 and _names(err, victim, record), err
    assert not out.exists()


def test_flipped_tensor_byte_in_a_legacy_megatron_file_is_refused(tmp_path, capsys):
    ck = copy_fixture(MEGATRON / "legacy_dp2_distopt", tmp_path)
    victim = ck / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt"
    record = flip_tensor(victim)
    out = tmp_path / "out"
    code, err = _run(["convert", ck, out, "--format", "safetensors"], capsys)
    assert code == 2 and _names(err, victim, record), err
    assert not out.exists()


def test_moved_central_directory_offset_is_refused(tmp_path, capsys):
    ck = copy_fixture(DEEPSPEED / "llama_zero1_dp2", tmp_path)
    victim = ck / TAG / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    shift_central_offset(victim)
    out = tmp_path / "out"
    code, err = _run(["reshard", ck, out, "--dp", "1"], capsys)
    assert code == 2 and str(victim) in err, err
    assert not out.exists()


VERBATIM = {"zero3-rank1": ("llama_zero3_dp2", "zero_pp_rank_1_mp_rank_00_model_states.pt", False),
            "mp-rank-early-copies": ("llama_zero1_dp2", "mp_rank_00_model_states.pt", True)}


@pytest.mark.parametrize("which", sorted(VERBATIM))
@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_file_copied_verbatim_is_refused(tmp_path, capsys, damage, which):
    """Model-state files go into a universal checkpoint as they are (ZeRO-3 ones of DP rank 1;
    ``mp_rank`` ones, copied by the command before torch loads): checked while copied, so a
    manifest never vouches for a damaged copy."""
    fixture, name, early = VERBATIM[which]
    ck = copy_fixture(DEEPSPEED / fixture, tmp_path)
    victim = ck / TAG / name
    if damage == "truncate":
        truncate(victim, 4000)
    else:
        flip_record(victim, ".data/serialization_id")  # its tensors are empty (ZeRO-3)
    out = tmp_path / "out"
    argv = ["convert", str(ck), str(out), "--format", "ucp"]
    if early:  # as `reshard convert` does: the copies start first (jobs.early_copies)
        from reshard.cli import _start_early_copies, build_parser

        parser = build_parser()
        args = parser.parse_args(argv)
        _start_early_copies(args)
        assert args.early_copies is not None
        code = cli(parser=parser, args=args)
        err = capsys.readouterr().err
    else:
        code, err = _run(argv, capsys)
    assert code == 2 and str(victim) in err, err
    assert not out.exists()


def test_no_verify_source_lets_a_flipped_byte_through_and_says_so(tmp_path, capsys):
    ck = copy_fixture(DEEPSPEED / "llama_zero1_dp2", tmp_path)
    flip_tensor(ck / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    out = tmp_path / "out"
    assert cli(["convert", str(ck), str(out), "--format", "ucp", "--no-verify-source"]) == 0
    assert "source not verified (--no-verify-source)" in capsys.readouterr().out
    doc = json.loads((out / TAG / "reshard-manifest.json").read_text())
    assert doc["source_verified"] is False
    report = convert(ck, tmp_path / "lib", verify_source=False)
    assert any("source not verified" in n for n in report.notes)
    assert json.loads((tmp_path / "lib" / TAG / "reshard-manifest.json").read_text())["source_verified"] is False


# -- every route: a refusal leaves no output folder ------------------------------------------------------


def _resave_1xn(path: Path) -> None:
    """The first flat fp32 partition re-saved as [1, N]: the element count still matches."""
    sd = load(path, mmap=False)
    group = sd["optimizer_state_dict"]["single_partition_of_fp32_groups"]
    group[0] = group[0].reshape(1, -1)
    save(sd, path)


def _flip_dcp(folder: Path) -> None:
    victim, offset, length = _distcp_record(folder)
    flip_tensor(victim, offset, length)


ROUTES = {
    "convert-ucp": ("llama_zero1_dp2", ["convert", "{src}", "{out}", "--format", "ucp"], "resave"),
    "convert-safetensors": ("llama_zero1_dp2", ["convert", "{src}", "{out}", "--format", "safetensors"], "flip"),
    "reshard-deepspeed": ("llama_tp2_dp2", ["reshard", "{src}", "{out}", "--tp", "1", "--dp", "2"], "flip"),
    "reshard-dcp": ("dcp", ["reshard", "{src}", "{out}", "--files", "3"], "flip"),
}


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_refused_source_leaves_no_output_folder_on_any_route(tmp_path, capsys, route):
    fixture, argv, damage = ROUTES[route]
    if fixture == "dcp":
        src = copy_fixture(DCP / "llama_fsdp2_ws2", tmp_path)
        _flip_dcp(src)
    else:
        src = copy_fixture(DEEPSPEED / fixture, tmp_path)
        victim = src / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        (_resave_1xn if damage == "resave" else flip_tensor)(victim)
    out = tmp_path / "new" / "out"  # neither folder exists: the job makes both, and removes both
    code, err = _run([a.format(src=src, out=out) for a in argv], capsys)
    assert code == 2 and str(src) in err, err
    assert not (tmp_path / "new").exists()


# -- the six tracebacks of the issue, now reshard errors naming the file ---------------------------------


@pytest.mark.parametrize("content", [b"\xff\xfe\x80global\xc3", b"g" * 300])
def test_latest_that_is_not_a_tag_is_refused_naming_it(tmp_path, content):
    ck = copy_fixture(DEEPSPEED / "llama_zero1_dp2", tmp_path)
    (ck / "latest").write_bytes(content)
    with pytest.raises(CheckpointError, match=re.escape(str(ck / "latest"))):
        convert(ck, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("key", ["single_partition_of_fp32_groups", "exp_avg"])
def test_flat_partition_or_moment_saved_as_1xn_is_refused(tmp_path, key):
    ck = copy_fixture(DEEPSPEED / "llama_zero1_dp2", tmp_path)
    victim = ck / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    sd = load(victim, mmap=False)
    osd = sd["optimizer_state_dict"]
    if key == "exp_avg":
        state = osd["base_optimizer_state"]["state"][0]
        state["exp_avg"] = state["exp_avg"].reshape(1, -1)
    else:
        osd[key][0] = osd[key][0].reshape(1, -1)
    save(sd, victim)
    for run in (lambda: convert(ck, tmp_path / "ucp"), lambda: convert(ck, tmp_path / "st", fmt="safetensors"),
                lambda: reshard(ck, tmp_path / "rs", dp=1)):
        with pytest.raises(CheckpointError, match=re.escape(str(victim))):
            run()
    assert list(tmp_path.glob("*")) == [ck]


def _archive_with_pickle(src: Path, dst: Path, pkl: bytes) -> None:
    """``src``'s records in a valid zip (right CRCs) whose data.pkl is ``pkl``."""
    import zipfile

    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = pkl if info.filename.endswith("/data.pkl") else zin.read(info)
            zout.writestr(info.filename, data)


def test_corrupt_pickle_that_fails_inside_torchs_unpickler_is_refused(tmp_path):
    ck = copy_fixture(DEEPSPEED / "llama_zero1_dp2", tmp_path)
    victim = ck / TAG / "mp_rank_00_model_states.pt"
    bad = tmp_path / "bad.pt"
    _archive_with_pickle(victim, bad, b"\x80\x02h\x63.")  # BINGET of a memo entry never stored: a KeyError
    bad.replace(victim)
    with pytest.raises(CheckpointError, match=re.escape(str(victim)) + ".*corrupt pickle"):
        convert(ck, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("victim", ["zero_pp_rank_1_mp_rank_00_optim_states.pt", "mp_rank_00_model_states.pt"])
def test_a_file_symlinked_to_a_folder_is_refused(tmp_path, victim):
    ck = copy_fixture(DEEPSPEED / "llama_zero1_dp2", tmp_path)
    (tmp_path / "a-folder").mkdir()
    (ck / TAG / victim).unlink()
    (ck / TAG / victim).symlink_to(tmp_path / "a-folder")
    for fmt in ("ucp", "safetensors"):
        with pytest.raises(CheckpointError, match=re.escape(str(ck / TAG / victim))):
            convert(ck, tmp_path / "out", fmt=fmt)
    assert not (tmp_path / "out").exists()


def test_missing_param_slice_mappings_at_dp_rank_1_is_refused_by_every_command(tmp_path, capsys):
    ck = copy_fixture(DEEPSPEED / "llama_zero1_dp2", tmp_path)
    victim = ck / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    sd = load(victim, mmap=False)
    del sd["optimizer_state_dict"]["param_slice_mappings"]
    save(sd, victim)
    for argv in (["inspect", ck], ["convert", ck, tmp_path / "out"], ["reshard", ck, tmp_path / "out", "--dp", "1"]):
        code, err = _run(argv, capsys)
        assert code == 2 and str(victim) in err and "param_slice_mappings" in err, err
    assert not (tmp_path / "out").exists()


# -- reshard verify on a source -----------------------------------------------------------------------


SOURCES = {"deepspeed": (DEEPSPEED / "llama_zero1_dp2", f"{TAG}/mp_rank_00_model_states.pt"),
           "dcp": (DCP / "llama_fsdp2_ws2", None),
           "megatron-legacy": (MEGATRON / "legacy_dp2_distopt", "iter_0000003/mp_rank_00/model_optim_rng.pt")}


@pytest.mark.parametrize("kind", sorted(SOURCES))
def test_verify_a_source_checks_its_records_and_runs_the_deep_check(tmp_path, capsys, kind):
    fixture, rel = SOURCES[kind]
    assert cli(["verify", str(fixture)]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "verified" in printed and "CRC-32" in printed and "deep check" in printed
    ck = copy_fixture(fixture, tmp_path)
    if rel is None:
        victim, offset, length = _distcp_record(ck)
        flip_tensor(victim, offset, length)
    else:
        victim = ck / rel
        flip_tensor(victim)
    code, err = _run(["verify", ck], capsys)
    assert code == 2 and str(victim) in err and "CRC-32" in err, err


def test_verify_a_source_with_swapped_optimizer_files_is_refused(tmp_path, capsys):
    ck = copy_fixture(DEEPSPEED / "llama_zero1_dp2", tmp_path)
    a, b = (ck / TAG / f"zero_pp_rank_{d}_mp_rank_00_optim_states.pt" for d in (0, 1))
    a.rename(tmp_path / "a")
    b.rename(a)
    (tmp_path / "a").rename(b)
    code, err = _run(["verify", ck], capsys)
    assert code == 2 and str(ck) in err, err


def test_verify_fails_on_an_output_holding_a_damaged_copy_made_without_verification(tmp_path, capsys):
    ck = copy_fixture(DEEPSPEED / "llama_zero3_dp2", tmp_path)
    victim = ck / TAG / "zero_pp_rank_1_mp_rank_00_model_states.pt"
    flip_record(victim, ".data/serialization_id")  # its tensors are empty (ZeRO-3): a record nothing else reads
    out = tmp_path / "out"
    assert cli(["convert", str(ck), str(out), "--format", "ucp", "--no-verify-source"]) == 0
    code, err = _run(["verify", out / TAG], capsys)
    assert code == 2 and str(out / TAG / victim.name) in err and "CRC-32" in err and "without verification" in err, err


def test_verify_deep_runs_the_deep_check_and_the_report_says_so(tmp_path, capsys):
    assert cli(["reshard", str(DEEPSPEED / "llama_zero1_dp2"), str(tmp_path / "out"), "--dp", "1",
                "--verify", "deep"]) == 0
    printed = capsys.readouterr().out
    assert "deep check:" in printed and "match their fp32 masters" in printed, printed
    doc = json.loads((tmp_path / "out" / TAG / "reshard-manifest.json").read_text())
    assert doc["source_verified"] is True
