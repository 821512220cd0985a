"""No command can destroy its source: an output that is, lies inside or contains the checkpoint it
is read from is refused before anything is written, with ``--overwrite`` too and through symbolic
links, by every command and format; the source is left byte for byte as it was."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from reshard.cli import main
from reshard.errors import OutputError
from reshard.jobs.convert import convert, reshard
from tests.support.dsconv import FIXTURES

DCP_FIXTURES = FIXTURES.parent / "dcp"


def _tree(root: Path) -> dict[str, str]:
    """Every file and folder under ``root``: sha256 of files, '<dir>' for folders."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        out[rel] = "<dir>" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.fixture
def workspace(tmp_path: Path):
    """A copy of a fixture (DeepSpeed, DCP or universal) under ``tmp_path/src``."""

    def make(kind: str, name: str) -> Path:
        src = tmp_path / "src"
        if kind == "dcp":
            shutil.copytree(DCP_FIXTURES / name, src)
        elif kind == "universal":
            convert(FIXTURES / name, tmp_path / "made", fmt="ucp")
            shutil.copytree(tmp_path / "made", src)
        else:
            shutil.copytree(FIXTURES / name, src)
        return src

    return make


def _outputs(src: Path, kind: str) -> list[tuple[str, Path, Path]]:
    """(case, path given as the source, OUT_DIR) for every way an output can meet its source."""
    tag = src / (src / ("latest_universal" if kind == "universal" else "latest")).read_text().strip() \
        if kind != "dcp" else src
    link = src.parent / "link"
    link.symlink_to(src, target_is_directory=True)
    cases = [
        ("output is the source's tag folder", src, tag.parent),
        ("output inside the source", src, src / "export"),
        ("output inside the tag folder", tag, tag / "export"),
        ("source through a symlink", link, tag.parent),
        ("output through a symlink", src, (link / tag.relative_to(src)).parent if tag != src else link.parent),
    ]
    if kind != "dcp":
        cases.append(("tag folder named directly", tag, src))
    return cases


def _refused(fn, src_root: Path) -> None:
    before = _tree(src_root)
    with pytest.raises(OutputError, match=r"source .* it is read from; choose an OUT_DIR outside the source"):
        fn()
    assert _tree(src_root) == before  # nothing written, nothing removed, no staging folder left


@pytest.mark.parametrize("fmt", ["ucp", "safetensors", "dcp"])
def test_convert_deepspeed_refuses_its_source(workspace, fmt: str) -> None:
    src = workspace("deepspeed", "llama_zero1_dp2")
    for case, given, out in _outputs(src, "deepspeed"):
        _refused(lambda given=given, out=out: convert(given, out, fmt=fmt, overwrite=True), src)
        assert not any(p.name.startswith(".reshard-") for p in src.parent.rglob("*")), case


@pytest.mark.parametrize("name", ["llama_zero1_dp2", "llama_zero3_dp2", "mixtral_autoep_ep2", "moe_ep2",
                                  "mixtral_autoep_ep2_zero3", "pipe_pp2_dp2"])
def test_reshard_deepspeed_refuses_its_source(workspace, name: str) -> None:
    src = workspace("deepspeed", name)
    for _, given, out in _outputs(src, "deepspeed"):
        _refused(lambda given=given, out=out: reshard(given, out, tp=1, overwrite=True), src)


@pytest.mark.parametrize("fmt", ["ucp", "safetensors"])
def test_convert_dcp_refuses_its_source(workspace, fmt: str) -> None:
    src = workspace("dcp", "llama_fsdp2_ws2")
    for _, given, out in _outputs(src, "dcp"):
        _refused(lambda given=given, out=out: convert(given, out, fmt=fmt, overwrite=True), src)


def test_reshard_dcp_and_convert_universal_refuse_their_source(workspace, tmp_path: Path) -> None:
    src = workspace("dcp", "llama_fsdp2_ws2")
    from reshard.jobs.convert import reshard as reshard_dcp_files

    for _, given, out in _outputs(src, "dcp"):
        _refused(lambda given=given, out=out: reshard_dcp_files(given, out, files=2, overwrite=True), src)
    shutil.rmtree(src)
    (tmp_path / "link").unlink()
    ucp = workspace("universal", "llama_zero1_dp2")
    for _, given, out in _outputs(ucp, "universal"):
        _refused(lambda given=given, out=out: convert(given, out, fmt="dcp", overwrite=True), ucp)


def test_layout_checkpoint_is_a_source_too(workspace, tmp_path: Path) -> None:
    src = workspace("deepspeed", "llama_tp2_dp2")
    layout = tmp_path / "layout"
    shutil.copytree(FIXTURES / "llama_tp2", layout)
    tag = (layout / "latest").read_text().strip()
    before = _tree(layout)
    with pytest.raises(OutputError, match="source"):
        reshard(src, layout, tp=2, dp=1, layout=layout / tag, overwrite=True)
    assert _tree(layout) == before


def test_command_line_refuses_and_names_the_flag(workspace, capsys) -> None:
    """The commands print one line and exit 2; the source keeps every byte; a plain existing
    output names the flag a user types."""
    src = workspace("deepspeed", "llama_zero1_dp2")
    before = _tree(src)
    for argv in (["convert", src, src, "--format", "safetensors", "--overwrite"],
                 ["convert", src, src, "--format", "ucp", "--overwrite"],
                 ["reshard", src, src, "--tp", "1", "--dp", "1", "--overwrite"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "outside the source" in err and err.count("\n") == 1
    assert _tree(src) == before
    out = src.parent / "out"
    assert main(["convert", src, out, "--format", "safetensors"]) == 0
    assert main(["convert", src, out, "--format", "safetensors"]) == 2
    assert "pass --overwrite" in capsys.readouterr().err
    assert os.path.isdir(out / "global_step3")
