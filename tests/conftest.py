"""Fixtures shared by test modules."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

import pytest

# One thread per process, as the fixtures were made: two xdist workers and the ranks they launch
# share 2 cores, and oversubscribed OpenMP pools burn them waiting.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# DeepSpeed JIT-builds its CPU all-reduce op on first use: one build per virtual environment, shared
# by every launch (the default ~/.cache folder is shared by every environment here, and each one
# taking a turn there rebuilds it)
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))

if TYPE_CHECKING:
    from tests.e2e.plan import E2E


@pytest.fixture(scope="session")
def e2e(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> E2E:
    """The end-to-end DeepSpeed jobs and their inputs (``tests/e2e/plan.py``), shared by
    ``tests/jobs/test_e2e_resume.py`` and ``tests/formats/deepspeed/test_zero12_reshard.py`` so that each job is launched once per session."""
    pytest.importorskip("deepspeed")
    from tests.e2e.plan import E2E

    slow = any(item.get_closest_marker("slow") for item in request.session.items)  # else its loads are left out
    return E2E(tmp_path_factory.mktemp("e2e"), slow=slow)


# The test modules whose tests share the session's ``e2e`` jobs: one xdist work unit, so that each
# job runs once (collection refuses a module that uses the fixture and is not listed here).
E2E_MODULES = frozenset({
    "tests/jobs/test_e2e_resume.py",
    "tests/formats/deepspeed/test_zero12_reshard.py",
    "tests/formats/deepspeed/test_zero3_reshard.py",
    "tests/formats/dcp/test_dcp_e2e.py",
})


def _unit(nodeid: str) -> str:
    """The xdist work unit of a test: its module, so that module-scoped fixtures are built once, or
    one unit for all of :data:`E2E_MODULES`."""
    module = nodeid.split("::")[0]
    return "e2e-jobs" if module in E2E_MODULES else module


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The units holding end-to-end (``e2e``-marked) tests go first, so that the long ones do not
    start last (``--no-loadscope-reorder`` keeps this order)."""
    stray = sorted({i.nodeid.split("::")[0] for i in items if "e2e" in getattr(i, "fixturenames", ())} - E2E_MODULES)
    if stray:
        raise pytest.UsageError(f"{', '.join(stray)} use the e2e fixture: add them to E2E_MODULES in tests/conftest.py")
    heavy = {_unit(i.nodeid) for i in items if i.get_closest_marker("e2e")}
    items.sort(key=lambda i: _unit(i.nodeid) not in heavy)  # stable: the order within each part is kept


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """``-n 2 --dist loadscope`` (``pyproject.toml``), its scopes being :func:`_unit`'s."""
    from xdist.scheduler import LoadScopeScheduling

    class ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    return ByUnit(config, log)
