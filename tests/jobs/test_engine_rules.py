"""The engine's own rules, on a fake reader and a fake writer (no format involved): a writer declares
what it fills once, as buffers of slots, and the engine plans what those slots take (each planned
and replica-checked before the output folder exists, each slot inside its buffer on a rank its map
holds); its jobs fill exactly the declared buffers: one it did not declare, or a declared one no job
fills, is an internal error that leaves nothing; what is refused before staging leaves no folder,
and a failure midway leaves nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from reshard.errors import ReplicaMismatchError, ReshardError
from reshard.formats.contract import Buffer, Reader, Slot, Writer, targets_of
from reshard.ir.param_map import ParamMap
from reshard.jobs.engine import run
from reshard.layouts import replicated
from reshard.storage import torch_zip
from reshard.storage.pickling import Pickler
from reshard.storage.safe_load import load


class FakeReader(Reader):
    """``w``: a 4 x 3 weight replicated on ``copies`` ranks (rank r's copy plus ``drift * r``)."""

    format, tag, description = "fake", "fake", "a fake source"
    topology: dict[str, int] = {}

    def __init__(self, root: Path, copies: int = 1, drift: float = 0.0) -> None:
        self.sources = (root,)
        self.names = ["w"]
        self.full = torch.arange(12, dtype=torch.float32).reshape(4, 3)
        self.copies = [(self.full + drift * r).reshape(-1) for r in range(copies)]
        self._map = replicated((4, 3), copies)

    def shape(self, name: str) -> tuple[int, ...]:
        return (4, 3)

    def states(self, name: str) -> tuple[str, ...]:
        return ("weight",)

    def dtype(self, name: str, state: str) -> torch.dtype:
        return torch.float32

    def map(self, name: str, state: str) -> ParamMap:
        return self._map

    def fragment(self, name: str, state: str, rank: int) -> torch.Tensor:
        return self.copies[rank]

    def tp_index(self, name: str, state: str, rank: int) -> int | None:
        return None

    def step(self, name: str) -> Any:
        return None

    def param_groups(self) -> list[dict[str, Any]]:
        return []

    def extras(self, name: str) -> dict[str, Any]:
        return {}


class FakeWriter(Writer):
    """Declares one buffer per file of ``declared`` ((file, map, rank): a slot of ``w`` at offset 0
    of ``numel`` elements); its jobs write the declared files ``fill`` (by default all), and the
    files of ``extra`` from buffers they build themselves (never declared); ``fail_at`` a file
    whose job raises."""

    format, tag, latest, keeps_replicas = "fake", "out", None, False

    def __init__(self, declared: list[tuple[str, ParamMap, int]], fill: list[str] | None = None,
                 fail_at: str | None = None, shape: tuple[int, ...] = (4, 3), numel: int = 12,
                 extra: tuple[tuple[str, ParamMap, int], ...] = ()) -> None:
        self._buffers = {rel: _buffer(rel, m, r, numel) for rel, m, r in declared}
        self._declared = [self._buffers[rel] for rel, _, _ in declared]  # duplicates too, as declared
        self.fill = list(self._buffers) if fill is None else fill
        self.fail_at, self.shape, self.extra = fail_at, shape, extra

    def buffers(self) -> list[Buffer]:
        return list(self._declared)

    def jobs(self, engine: Any, staging: Any) -> list[Any]:
        jobs = [(1, partial(self._file, engine, staging, self._buffers[rel])) for rel in self.fill]
        return jobs + [(1, partial(self._file, engine, staging, _buffer(rel, m, r, 12))) for rel, m, r in self.extra]

    def _file(self, engine: Any, staging: Any, buf: Buffer) -> None:
        if buf.key == self.fail_at:
            raise RuntimeError(f"{buf.key}: the disk is full")
        with staging.open(buf.key) as out:
            torch_zip.save(engine.storage(buf).view(self.shape), out, pickler=Pickler)

    def meta(self) -> dict[str, Any]:
        return {}

    def notes(self) -> list[str]:
        return []


def _buffer(rel: str, m: ParamMap, rank: int, numel: int) -> Buffer:
    return Buffer(rel, torch.float32, numel, (Slot(0, "w", ("weight",), m, rank),))


def _left(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*")) if out.exists() else []


def test_declared_slots_are_filled_from_the_source(tmp_path):
    m = replicated((4, 3), 1)
    run(FakeReader(tmp_path / "src"), FakeWriter([("a.pt", m, 0)]), tmp_path / "out")
    assert torch.equal(load(tmp_path / "out" / "out" / "a.pt"), torch.arange(12.0).reshape(4, 3))


def test_the_engine_plans_what_the_buffers_declare(tmp_path):
    """What the engine plans is derived from the buffers: each (parameter, want, map) once, however
    many slots take it; a writer declares nothing else."""
    m, other = replicated((4, 3), 1), replicated((4, 3), 1)
    writer = FakeWriter([("a.pt", m, 0), ("b.pt", m, 0), ("c.pt", other, 0)])
    assert [(t.name, t.want, t.map) for t in targets_of(writer.buffers())] == [
        ("w", ("weight",), m), ("w", ("weight",), other)]
    run(FakeReader(tmp_path / "src"), writer, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out" / "out").glob("*.pt")) == ["a.pt", "b.pt", "c.pt"]


def test_a_slot_the_writer_did_not_declare_fails_and_leaves_nothing(tmp_path):
    declared, other = replicated((4, 3), 1), replicated((4, 3), 1)  # alike, but not the declared object
    writer = FakeWriter([("a.pt", declared, 0)], extra=(("b.pt", other, 0),))
    with pytest.raises(ReshardError, match="internal: .*did not declare"):
        run(FakeReader(tmp_path / "src"), writer, tmp_path / "out")
    assert _left(tmp_path / "out") == []


def test_a_buffer_built_again_in_jobs_is_not_the_declared_one(tmp_path):
    """A job fills the declared buffer object, never one it builds anew, even with the same key and slots."""
    m = replicated((4, 3), 1)
    writer = FakeWriter([("a.pt", m, 0)], fill=[], extra=(("a.pt", m, 0),))
    with pytest.raises(ReshardError, match="internal: .*'a.pt', which its buffers\\(\\) did not declare"):
        run(FakeReader(tmp_path / "src"), writer, tmp_path / "out")
    assert _left(tmp_path / "out") == []


def test_a_declared_buffer_no_job_fills_is_refused_and_leaves_nothing(tmp_path):
    m = replicated((4, 3), 1)
    writer = FakeWriter([("a.pt", m, 0), ("b.pt", m, 0)], fill=["a.pt"])
    with pytest.raises(ReshardError, match="internal: the writer's jobs did not fill 1 declared buffer.*b.pt"):
        run(FakeReader(tmp_path / "src"), writer, tmp_path / "out")
    assert _left(tmp_path / "out") == []


def test_a_slot_on_a_rank_its_map_does_not_hold_is_refused_before_staging(tmp_path):
    m = replicated((4, 3), 1)
    with pytest.raises(ReshardError, match="internal: .*rank 3"):
        run(FakeReader(tmp_path / "src"), FakeWriter([("a.pt", m, 3)]), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_bad_declaration_is_refused_before_staging(tmp_path):
    m = replicated((4, 3), 1)
    with pytest.raises(ReshardError, match="internal: buffer a.pt: the slot of 'w' .* spans elements 0..12 of its 8"):
        run(FakeReader(tmp_path / "src"), FakeWriter([("a.pt", m, 0)], numel=8), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ReshardError, match="internal: the writer declares buffer 'a.pt' twice"):
        run(FakeReader(tmp_path / "src"), FakeWriter([("a.pt", m, 0), ("a.pt", m, 0)]), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_refusals_come_before_any_output_folder(tmp_path):
    m = replicated((4, 3), 1)
    with pytest.raises(ReplicaMismatchError):  # the source's two copies differ
        run(FakeReader(tmp_path / "src", copies=2, drift=0.5), FakeWriter([("a.pt", m, 0)]), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    wrong = replicated((3, 4), 1)
    with pytest.raises(ReshardError, match="'w'"):  # a target map no plan can make from the source's
        run(FakeReader(tmp_path / "src"), FakeWriter([("a.pt", wrong, 0)], shape=(3, 4)), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_failure_midway_leaves_nothing(tmp_path):
    m = replicated((4, 3), 1)
    writer = FakeWriter([("a.pt", m, 0), ("b.pt", m, 0), ("c.pt", m, 0)], fail_at="b.pt")
    with pytest.raises(RuntimeError, match="disk is full"):
        run(FakeReader(tmp_path / "src"), writer, tmp_path / "out")
    assert _left(tmp_path / "out") == []


def test_the_refusals_hold_under_python_O(tmp_path):
    """No refusal leans on ``assert`` (which ``python -O`` strips): the refusals above, run again
    under -O, raise the same errors and leave no folder (checked here, not by the stripped asserts)."""
    code = ("import sys, tempfile; from pathlib import Path; import tests.jobs.test_engine_rules as t\n"
            "for f in (t.test_a_slot_the_writer_did_not_declare_fails_and_leaves_nothing,\n"
            "          t.test_a_buffer_built_again_in_jobs_is_not_the_declared_one,\n"
            "          t.test_a_declared_buffer_no_job_fills_is_refused_and_leaves_nothing,\n"
            "          t.test_a_slot_on_a_rank_its_map_does_not_hold_is_refused_before_staging,\n"
            "          t.test_a_bad_declaration_is_refused_before_staging, t.test_refusals_come_before_any_output_folder,\n"
            "          t.test_a_failure_midway_leaves_nothing):\n"
            "    d = Path(tempfile.mkdtemp(dir=sys.argv[1]))\n"
            "    f(d)\n"
            "    if t._left(d / 'out'):\n"
            "        sys.exit(f'{f.__name__}: left {t._left(d / \"out\")}')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                         os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-O", "-c", code, str(tmp_path)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
