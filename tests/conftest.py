"""Fixtures shared by test modules."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import pytest

# One thread per process, as the fixtures were made: two xdist workers and the ranks they launch
# share 2 cores, and oversubscribed OpenMP pools burn them waiting.
os.environ.setdefault("OMP_NUM_THREADS", "1")

if TYPE_CHECKING:
    from tests.e2e.plan import E2E


@pytest.fixture(scope="session")
def e2e(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> E2E:
    """The end-to-end DeepSpeed jobs and their inputs (``tests/e2e/plan.py``), shared by
    ``test_e2e_resume.py`` and ``test_offline.py`` so that each job is launched once per session."""
    pytest.importorskip("deepspeed")
    from tests.e2e.plan import E2E

    slow = any(item.get_closest_marker("slow") for item in request.session.items)  # else its loads are left out
    return E2E(tmp_path_factory.mktemp("e2e"), slow=slow)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``-n 2 --dist loadgroup``, ``pyproject.toml``): one work unit per test
    module, so that its module-scoped fixtures are built once, and one for every test of the
    session-scoped ``e2e`` jobs, which are shared across modules; the units holding end-to-end
    (``e2e``-marked) tests go first, so that the long ones do not start last."""
    def group(item: pytest.Item) -> str:
        return "e2e-jobs" if "e2e" in getattr(item, "fixturenames", ()) else item.nodeid.split("::")[0]

    heavy = {group(i) for i in items if i.get_closest_marker("e2e")}
    for item in items:
        item.add_marker(pytest.mark.xdist_group(group(item)))
    items.sort(key=lambda i: group(i) not in heavy)  # stable: the order within each part is kept
