"""The engine's own rules, on a fake reader and a fake writer (no format involved): a writer fills
only the slots it declared (planned and replica-checked before the output folder exists), each slot
on a rank its map holds; what is refused before staging leaves no folder, and a failure midway
leaves nothing."""

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
from reshard.formats.contract import Buffer, Reader, Slot, Target, Writer
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
    """One file per slot it is told to fill (``fill``: (file, map, rank)); ``declared`` the
    targets it says it fills; ``fail_at`` a file whose job raises."""

    format, tag, latest, keeps_replicas = "fake", "out", None, False

    def __init__(self, declared: list[ParamMap], fill: list[tuple[str, ParamMap, int]], fail_at: str | None = None,
                 shape: tuple[int, ...] = (4, 3)) -> None:
        self.declared, self.fill, self.fail_at, self.shape = declared, fill, fail_at, shape

    def targets(self) -> list[Target]:
        return [Target("w", ("weight",), m) for m in self.declared]

    def jobs(self, engine: Any, staging: Any) -> list[Any]:
        return [(1, partial(self._file, engine, staging, rel, m, r)) for rel, m, r in self.fill]

    def _file(self, engine: Any, staging: Any, rel: str, m: ParamMap, rank: int) -> None:
        if rel == self.fail_at:
            raise RuntimeError(f"{rel}: the disk is full")
        buf = Buffer(rel, torch.float32, 12, (Slot(0, "w", ("weight",), m, rank),))
        with staging.open(rel) as out:
            torch_zip.save(engine.storage(buf).view(self.shape), out, pickler=Pickler)

    def meta(self) -> dict[str, Any]:
        return {}

    def notes(self) -> list[str]:
        return []


def _left(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*")) if out.exists() else []


def test_declared_slots_are_filled_from_the_source(tmp_path):
    m = replicated((4, 3), 1)
    run(FakeReader(tmp_path / "src"), FakeWriter([m], [("a.pt", m, 0)]), tmp_path / "out")
    assert torch.equal(load(tmp_path / "out" / "out" / "a.pt"), torch.arange(12.0).reshape(4, 3))


def test_a_slot_the_writer_did_not_declare_fails_and_leaves_nothing(tmp_path):
    declared, other = replicated((4, 3), 1), replicated((4, 3), 1)  # alike, but not the declared object
    writer = FakeWriter([declared], [("a.pt", declared, 0), ("b.pt", other, 0)])
    with pytest.raises(ReshardError, match="internal: .*did not declare"):
        run(FakeReader(tmp_path / "src"), writer, tmp_path / "out")
    assert _left(tmp_path / "out") == []


def test_a_slot_on_a_rank_its_map_does_not_hold_fails(tmp_path):
    m = replicated((4, 3), 1)
    with pytest.raises(ReshardError, match="internal: .*rank 3"):
        run(FakeReader(tmp_path / "src"), FakeWriter([m], [("a.pt", m, 3)]), tmp_path / "out")
    assert _left(tmp_path / "out") == []


def test_refusals_come_before_any_output_folder(tmp_path):
    m = replicated((4, 3), 1)
    with pytest.raises(ReplicaMismatchError):  # the source's two copies differ
        run(FakeReader(tmp_path / "src", copies=2, drift=0.5), FakeWriter([m], [("a.pt", m, 0)]), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    wrong = replicated((3, 4), 1)
    with pytest.raises(ReshardError, match="'w'"):  # a target map no plan can make from the source's
        run(FakeReader(tmp_path / "src"), FakeWriter([wrong], [("a.pt", wrong, 0)], shape=(3, 4)), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_failure_midway_leaves_nothing(tmp_path):
    m = replicated((4, 3), 1)
    writer = FakeWriter([m], [("a.pt", m, 0), ("b.pt", m, 0), ("c.pt", m, 0)], fail_at="b.pt")
    with pytest.raises(RuntimeError, match="disk is full"):
        run(FakeReader(tmp_path / "src"), writer, tmp_path / "out")
    assert _left(tmp_path / "out") == []


def test_the_refusals_hold_under_python_O(tmp_path):
    """No refusal leans on ``assert`` (which ``python -O`` strips): the refusals above, run again
    under -O, raise the same errors and leave no folder (checked here, not by the stripped asserts)."""
    code = ("import sys, tempfile; from pathlib import Path; import tests.jobs.test_engine_rules as t\n"
            "for f in (t.test_a_slot_the_writer_did_not_declare_fails_and_leaves_nothing,\n"
            "          t.test_a_slot_on_a_rank_its_map_does_not_hold_fails, t.test_refusals_come_before_any_output_folder,\n"
            "          t.test_a_failure_midway_leaves_nothing):\n"
            "    d = Path(tempfile.mkdtemp(dir=sys.argv[1]))\n"
            "    f(d)\n"
            "    if t._left(d / 'out'):\n"
            "        sys.exit(f'{f.__name__}: left {t._left(d / \"out\")}')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                         os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-O", "-c", code, str(tmp_path)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
