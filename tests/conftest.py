"""Fixtures shared by test modules."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.e2e.plan import E2E


@pytest.fixture(scope="session")
def e2e(tmp_path_factory: pytest.TempPathFactory) -> E2E:
    """The end-to-end DeepSpeed jobs and their inputs (``tests/e2e/plan.py``), shared by
    ``test_e2e_resume.py`` and ``test_offline.py`` so that each job is launched once per session."""
    pytest.importorskip("deepspeed")
    from tests.e2e.plan import E2E

    return E2E(tmp_path_factory.mktemp("e2e"))
