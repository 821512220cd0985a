"""``reshard convert`` starts copying model-state files before torch loads (``reshard.jobs.early_copies``):
the command's output is byte for byte the library's, copies it does not keep are dropped, and a
conversion that fails afterwards leaves nothing behind."""

from __future__ import annotations

import filecmp
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from reshard.jobs.convert import convert
from reshard.jobs.early_copies import EarlyCopies
from reshard.storage.staging import verify
from tests.support.dsconv import FIXTURES


def _command(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "reshard", "convert", *map(str, args)], capture_output=True,
                          text=True, timeout=300)


def _same_tree(a: Path, b: Path) -> None:
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files_a == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    for rel in files_a:
        assert filecmp.cmp(a / rel, b / rel, shallow=False), rel


@pytest.mark.parametrize("fixture", [
    "llama_zero1_dp2",  # one model-state file, kept as it is
    "llama_tp2_dp2",  # two
    "mixtral_autoep_ep2",  # AutoEP: the model states are rewritten, the early copies dropped
    "llama_zero3_dp2",  # ZeRO-3: no mp_rank files, nothing starts early
])
def test_the_command_writes_what_the_library_writes(fixture, tmp_path):
    res = _command(FIXTURES / fixture, tmp_path / "cmd", "--workers", "2")
    assert res.returncode == 0, res.stderr[-3000:]
    convert(FIXTURES / fixture, tmp_path / "lib", workers=2)
    _same_tree(tmp_path / "lib", tmp_path / "cmd")  # the manifests included


def test_the_copies_start_before_torch_loads(tmp_path):
    probe = (
        "import sys; sys.argv = ['reshard', 'convert', sys.argv[1], sys.argv[2]]\n"
        "from reshard.jobs import early_copies\n"
        "real = early_copies.EarlyCopies._run\n"
        "def run(self):\n"
        "    print('torch loaded when the copies started:', 'torch' in sys.modules, flush=True)\n"
        "    real(self)\n"
        "early_copies.EarlyCopies._run = run\n"
        "from reshard.cli import run as command\n"
        "command()\n")
    res = subprocess.run([sys.executable, "-c", probe, str(FIXTURES / "llama_zero1_dp2"), str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "torch loaded when the copies started: False" in res.stdout
    assert (tmp_path / "out" / "global_step3" / "mp_rank_00_model_states.pt").is_file()


def test_a_conversion_that_fails_after_the_copies_started_leaves_nothing(tmp_path):
    src = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "llama_zero1_dp2", src)
    optim = next(src.rglob("zero_pp_rank_1_*optim_states.pt"))
    optim.write_bytes(optim.read_bytes()[:1000])  # truncated: found only once torch reads it
    out = tmp_path / "out"
    res = _command(src, out)
    assert res.returncode == 2 and "zero_pp_rank_1" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not out.exists()  # no staging folder, no latest_universal, not even the folder it made


def test_nothing_starts_where_the_conversion_would_refuse(tmp_path):
    assert EarlyCopies.start(tmp_path, tmp_path / "out", overwrite=False, checksum="crc32") is None  # no checkpoint
    (tmp_path / "out" / "global_step3").mkdir(parents=True)  # an output the run must not replace
    assert EarlyCopies.start(FIXTURES / "llama_zero1_dp2", tmp_path / "out", overwrite=False, checksum="crc32") is None
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["global_step3"]
    res = _command(FIXTURES / "llama_zero1_dp2", tmp_path / "out")
    assert res.returncode == 2 and "already exists" in res.stderr  # the conversion's own error, as ever


def test_early_copies_of_another_conversion_are_abandoned_and_it_runs_as_without_them(tmp_path):
    for fixture, fmt in (("llama_zero1_dp2", "safetensors"), ("pipe_pp2_dp2", "ucp")):
        out = tmp_path / fixture
        early = EarlyCopies.start(FIXTURES / "llama_zero1_dp2", out, overwrite=False, checksum="crc32")
        assert early is not None and early.staging.tmp.is_dir()
        report = convert(FIXTURES / fixture, out, fmt=fmt, early_copies=early)
        assert not early.staging.tmp.exists()
        assert sorted(p.name for p in report.out_dir.iterdir()) == sorted(
            p.name for p in convert(FIXTURES / fixture, tmp_path / "plain" / fixture, fmt=fmt).out_dir.iterdir())
        verify(report.out_dir)


def test_the_thread_only_has_a_head_start(tmp_path, monkeypatch):
    """A worker that comes to a file the thread has not begun copies it itself (the copies run at
    the workers' parallelism, not one thread's); a file dropped before its turn is never copied;
    abandoning stops what has not begun."""
    import threading

    from reshard.storage import staging as output

    tag = tmp_path / "ckpt" / "global_step1"
    tag.mkdir(parents=True)
    files = [tag / f"mp_rank_{m:02d}_model_states.pt" for m in range(4)]
    for i, f in enumerate(files):
        f.write_bytes(bytes([i]) * 5000)
    release, copied = threading.Event(), []
    real = output.Staging.copy

    def copy(self, src, rel):
        copied.append((threading.current_thread().name, src.name))
        if src == files[0]:
            release.wait(30)  # the thread is held on its first file
        real(self, src, rel)

    monkeypatch.setattr(output.Staging, "copy", copy)
    # the files are stand-in bytes, not archives: copied as they are (this is about who copies what)
    early = EarlyCopies.start(tag, tmp_path / "out", overwrite=False, checksum="crc32", verify_source=False)
    assert early is not None and early.files == frozenset(files)
    early.take(files[2])  # not begun by the thread: copied here, at once
    assert (threading.current_thread().name, files[2].name) in copied
    early.drop(files[3])  # never copied
    release.set()
    early.take(files[0])  # the thread's copy, waited for
    early.take(files[1])
    assert sorted(p.name for p in early.staging.tmp.iterdir()) == [f.name for f in files[:3]]
    assert files[3].name not in [name for _, name in copied]
    for f in files[:3]:
        assert (early.staging.tmp / f.name).read_bytes() == f.read_bytes()
        assert early.staging.digests[f.name]["size"] == 5000
    early.abandon()
    assert not (tmp_path / "out").exists()  # the folder it made, removed with the staging folder
