"""An output on another file system than its source: the kernel's file-to-file copy
(``copy_file_range``) is refused there (EXDEV between, say, ext4 and tmpfs), and every byte must
then go through user memory instead, the output identical."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from reshard.jobs.convert import convert
from reshard.storage.staging import copy_mapped
from tests.support.dsconv import FIXTURES

NAME = "llama_zero1_dp2"


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _refuse_kernel_copies(monkeypatch) -> list[int]:
    calls = []

    def copy_file_range(*args, **kwargs):
        calls.append(1)
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))

    monkeypatch.setattr(os, "copy_file_range", copy_file_range)
    return calls


def test_a_verbatim_copy_the_kernel_refuses_is_written_the_same(tmp_path, monkeypatch):
    """``--format ucp`` keeps the model-state files as they are (``Staging.copy``)."""
    want = _files(convert(FIXTURES / NAME, tmp_path / "kernel").out_dir)
    calls = _refuse_kernel_copies(monkeypatch)
    got = _files(convert(FIXTURES / NAME, tmp_path / "user").out_dir)
    assert calls, "the route no longer asks the kernel to copy: this test tests nothing"
    assert got == want


def test_mapped_bytes_the_kernel_refuses_are_left_to_the_caller(tmp_path, monkeypatch):
    """``copy_mapped`` (a writer's run of mapped source bytes) copies nothing then: the caller
    writes them from memory."""
    import mmap

    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(3 << 20))
    calls = _refuse_kernel_copies(monkeypatch)
    with open(src, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m, \
            open(tmp_path / "dst.bin", "wb") as out:
        view = memoryview(m)
        try:
            assert copy_mapped(view[1 << 20:], out.fileno()) == 0
        finally:
            view.release()
    assert calls


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_convert_onto_another_file_system(tmp_path):
    other = Path("/dev/shm")
    if os.stat(other).st_dev == os.stat(FIXTURES).st_dev:
        pytest.skip("/dev/shm is on the fixtures' file system")
    want = _files(convert(FIXTURES / NAME, tmp_path / "same").out_dir)
    out = other / f"reshard-test-{os.getpid()}"
    try:
        got = _files(convert(FIXTURES / NAME, out).out_dir)
    finally:
        import shutil

        shutil.rmtree(out, ignore_errors=True)
    assert got == want
