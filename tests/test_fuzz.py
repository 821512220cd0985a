"""The fuzz suite's small budget (``make fuzz`` runs 520): damaged copies of the committed
fixtures at a fixed seed, every command on each; no traceback, hang, partial folder, pickle run,
silent wrong output or refusal naming no file (``tests/fuzz``, docs/robustness.md)."""

from __future__ import annotations

from tests.fuzz.harness import FAILURES, generate, run_cases, sources, table

SEED, BUDGET = 20261201, 12


def test_a_small_fuzz_budget_finds_no_failure(tmp_path):
    cases = generate(SEED, BUDGET, sources(tmp_path))
    outcomes = run_cases(cases, tmp_path)
    assert len({o.case.index for o in outcomes}) == BUDGET
    bad = [o for o in outcomes if o.cls in FAILURES]
    assert not bad, table(outcomes)
