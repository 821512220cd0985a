"""Input is guarded by checks that raise reshard errors, never by ``assert`` (which ``python -O``
removes): no assert statement in ``reshard/``, and the refusal tests pass under ``python -O``
(issues 37, 32)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import reshard

ROOT = Path(__file__).resolve().parents[1]
# The refusals of edited recorded maps, the IR's defect catalogue, what the fuzz suite found, damaged
# Megatron checkpoints, quantized payloads that cannot be decoded, outputs over their source, and the
# routes and targets the format table and the route suite refuse, ZeRO-3 sub-group facts (the cheap refusal
# modules: ~30 s).
REFUSAL_TESTS = ("tests/formats/deepspeed/test_recorded_maps.py", "tests/formats/deepspeed/test_sub_groups_checked.py",
                 "tests/ir/test_check_paths.py",
                 "tests/ir/test_ir_defects.py", "tests/jobs/test_fuzz_regressions.py",
                 "tests/jobs/test_verified_reads.py", "tests/formats/megatron/test_bad_input.py",
                 "tests/formats/hf/test_quantized_refused.py", "tests/jobs/test_source_safety.py",
                 "tests/formats/test_table.py::test_a_target_the_source_cannot_take_is_refused_naming_the_choices",
                 "tests/formats/test_table.py::test_the_command_refuses_a_dcp_source_without_files_in_one_line",
                 "tests/formats/test_routes.py::test_routes_that_cannot_hold_are_refused_before_anything_exists",
                 "tests/formats/test_routes.py::test_targets_a_source_cannot_give_are_refused_before_anything_exists",
                 "tests/formats/deepspeed/test_experts_folded.py::test_a_wrong_folding_record_is_refused_naming_it",
                 "tests/formats/deepspeed/test_autoep_limits.py",
                 "tests/formats/deepspeed/test_autoep_pipe.py::test_a_stages_wrong_layer_record_is_refused_naming_its_file",
                 "tests/formats/deepspeed/test_autoep_pipe.py::test_a_missing_expert_file_is_refused_naming_it",
                 "tests/formats/deepspeed/test_autoep_pipe_write.py::"
                 "test_what_a_pipeline_target_cannot_be_is_refused_leaving_nothing",
                 "tests/formats/deepspeed/test_autoep_pipe_write.py::"
                 "test_pp1_to_pp2_without_a_layout_is_refused_naming_partition_method",
                 "tests/formats/deepspeed/test_experts_folded_zero3.py::"
                 "test_a_wrong_folded_zero3_record_is_refused_naming_it",
                 "tests/formats/deepspeed/test_experts_folded_zero3_target.py::"
                 "test_what_a_folded_zero3_target_cannot_be_is_refused",
                 "tests/formats/deepspeed/test_experts_folded_zero3_target.py::"
                 "test_a_wrong_source_record_is_refused_naming_it_before_a_folded_target",
                 "tests/formats/deepspeed/test_experts_folded_from_any.py::"
                 "test_folded_from_a_universal_without_layout_is_refused",
                 "tests/formats/deepspeed/test_frozen.py::test_planted_defects_are_refused_by_file_and_tensor",
                 "tests/formats/deepspeed/test_moe_tp.py::test_a_wrong_ep_size_record_is_named",
                 "tests/formats/deepspeed/test_moe_tp.py::test_a_missing_expert_shard_of_tp_rank_1_is_named")


def test_no_assert_statement_in_reshard():
    found = []
    for path in sorted(Path(reshard.__file__).parent.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        found += [f"{path}:{node.lineno}" for node in ast.walk(tree) if isinstance(node, ast.Assert)]
    assert not found, found


def test_refusals_hold_under_python_O():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, "-O", "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", *REFUSAL_TESTS],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout.splitlines()[-1], run.stdout[-2000:]
