"""The fuzz suite's small budget (``make fuzz`` runs 520): damaged copies of the committed
fixtures at a fixed seed, every command on each; no traceback, hang, partial folder, pickle run,
silent wrong output or refusal naming no file (``tests/fuzz``, docs/robustness.md)."""

from __future__ import annotations

import pytest

from tests.fuzz.harness import FAILURES, generate, run_cases, sources, table
from tests.fuzz.mutations import Mutation

SEED, BUDGET = 20261201, 12


def test_a_small_fuzz_budget_finds_no_failure(tmp_path):
    cases = generate(SEED, BUDGET, sources(tmp_path))
    outcomes = run_cases(cases, tmp_path)
    assert len({o.case.index for o in outcomes}) == BUDGET
    bad = [o for o in outcomes if o.cls in FAILURES]
    assert not bad, table(outcomes)


def test_a_tensor_renamed_by_a_flipped_header_byte_is_marked_unseen(tmp_path):
    """Fuzz case 168 (``fp8_qwen2``, seed 20261201, budget 240 over the quantized sources; and cases
    3 and 189 of the ``safetensors_header`` family's flips, ``mOdel.embed_tokens.weight``,
    ``model.l`yers.0...``): bit 2 of header byte 2002 flipped renames ``q_proj.bias`` to ``q_prkj.bias``, a valid safetensors file
    every route carries under the new name. Nothing in the format can show it (a model's parameter
    names could; docs/robustness.md), so it is counted as such, as a JSON value that still parses is;
    a flip that breaks the header is not."""
    import random

    from tests.fuzz.mutations import UNSEEN, Mutation, _flip_bytes, copy_folder
    from tests.support.paths import HF

    src = tmp_path / "src"
    copy_folder(HF / "fp8_qwen2", src)

    class At(random.Random):
        def __init__(self, at: int, bit: int) -> None:
            super().__init__(0)
            self.values = [at, bit]

        def randrange(self, *args):  # noqa: ANN002 -- the two draws of _flip: the byte, the bit
            return self.values.pop(0)

    m = Mutation("flip_bytes", "model.safetensors", 0)
    what = _flip_bytes(src, src / "model.safetensors", At(2002, 2), m, HF / "fp8_qwen2", tmp_path)
    assert UNSEEN in what and "renamed" in what, what
    assert b"q_prkj.bias" in (src / "model.safetensors").read_bytes()[:5000]
    copy_folder(HF / "fp8_qwen2", tmp_path / "src2")
    what = _flip_bytes(tmp_path / "src2", tmp_path / "src2" / "model.safetensors", At(2, 6), m, HF / "fp8_qwen2",
                       tmp_path)  # the header's length: not a valid file
    assert UNSEEN not in what, what
    from tests.fuzz.mutations import _safetensors_header

    copy_folder(HF / "mxfp4_gpt_oss", tmp_path / "src3")

    class Flip(At):
        def choice(self, seq):  # the entry (any), then the header edit
            return "flip" if "flip" in seq else seq[0]

    what = _safetensors_header(tmp_path / "src3", tmp_path / "src3" / "model.safetensors", Flip(118, 5), m,
                               HF / "mxfp4_gpt_oss", tmp_path)
    assert UNSEEN in what and "renamed" in what, what


def test_the_quantized_families_damage_a_kept_dcp_and_each_is_refused(tmp_path):
    """The four quantized families on a kept FP8 DCP (``--quantize keep``, 2 files: payload and scale entries of
    their own), each with valid records (a re-saved record, .metadata pointing at it): a NaN / zero / negative
    scale, a scale's record swapped with a payload's, a block the scale grids disagree with, a file cut inside a
    payload, each refused naming a file of the checkpoint by ``convert --format safetensors``, no output left."""
    from tests.fuzz.harness import CONVERT_ST, _kept_dcp, run_command
    from tests.fuzz.mutations import QUANT_FAMILIES, UNSEEN, Mutation, apply, candidates, copy_folder

    pristine = _kept_dcp(tmp_path, "fp8_qwen2")
    seen = set()
    for family in QUANT_FAMILIES:
        files = candidates(pristine, family)
        assert files, family
        for seed in range(40):  # the first draw that is not a valid checkpoint with other values
            src = tmp_path / f"{family}-{seed}"
            copy_folder(pristine, src)
            what = apply(src, Mutation(family, files[seed % len(files)], seed), pristine, tmp_path)
            if UNSEEN not in what:
                break
        out = tmp_path / f"out-{family}"
        run = run_command([a.format(src=src, out=out) for a in CONVERT_ST.argv])
        assert run.code == 2 and not run.error and str(src) in run.stderr, (what, run.stderr, run.error)
        assert not out.exists(), what
        seen.add(what)
    assert len(seen) == len(QUANT_FAMILIES), seen


@pytest.mark.parametrize("source, mutation", [
    # a module entry no optimizer group owns, beside a real one (classic MoE, AutoEP: were carried as weights)
    ("moe_ep2", Mutation("resave_keys", "global_step3/mp_rank_00_model_states.pt", 3574157925)),
    ("mixtral_autoep_ep2", Mutation("resave_keys", "global_step3/mp_rank_00_model_states.pt", 3574157925)),
    # reshard's manifest beside a DCP made a link to junk (its entry order was taken as unknown)
    ("mxfp4_gpt_oss_dcp", Mutation("symlink_junk", "reshard-manifest.json", 3753139486)),
    # a save_pretrained folder without its config.json (its order and tied embeddings were taken as unknown)
    ("pretrained_qwen2_tied", Mutation("delete", "config.json", 1038305411)),
    # TP rank 1's ZeRO-3 model state without num_experts (folded AutoEP; the universal output copied it as it was)
    ("mixtral_autoep_ep2_tp2_zero3", Mutation("resave_keys", "global_step3/zero_pp_rank_0_mp_rank_01_model_states.pt",
                                              3256318980)),
    # Adam's step dropped from DP rank 0's ZeRO-3 optimizer state (the output took another rank's, or none)
    ("llama_zero3_dp2", Mutation("resave_keys", "global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt", 2071141439)),
], ids=["moe-module-entry", "autoep-module-entry", "dcp-manifest-junk", "hf-config-deleted", "autoep-tp1-num-experts",
        "zero3-step-dropped"])
def test_the_silent_outputs_make_fuzz_found_are_refused(tmp_path, source, mutation):
    """``make fuzz`` of f3b94ba (seed 20261201, cases 64, 320, 439, 494) and of 2dbedaf with the folded and
    pipeline AutoEP fixtures among its sources (case 212), and
    of 19b28a6 with classic MoE at TP 2 and frozen parameters among them (case 493): each of these damaged copies was
    converted without a word into an output unlike the undamaged one; now each command refuses it, naming a
    file of the checkpoint."""
    from tests.fuzz.harness import Case, Runner

    src = next(s for s in sources(tmp_path / "cache") if s.name == source)
    outcomes = Runner(tmp_path).run(Case(0, src, mutation, lazy=False))
    assert {o.cls for o in outcomes} == {"refused"}, table(outcomes)
