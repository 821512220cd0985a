"""A Trainer + DeepSpeed ``checkpoint-N`` resharded by ``reshard reshard CKPT OUT/checkpoint-N --dp D``
resumes under HF ``Trainer`` at the new world size as it stands (nothing copied by hand), and its
losses equal DeepSpeed's own universal route at that world size (``ds_to_universal`` and
``load_universal``), bit for bit. The per-device batch keeps the recipe's global batch of 4, as the
report says it must."""

from __future__ import annotations

from pathlib import Path

import pytest

from reshard.jobs.convert import reshard
from tests.support.paths import HF

pytestmark = pytest.mark.e2e
pytest.importorskip("accelerate")


@pytest.fixture(scope="module")
def universal(tmp_path_factory):
    from tests.e2e.hf_universal import make_universal

    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = make_universal(HF / name / "checkpoint-3", tmp_path_factory.mktemp(name) / "checkpoint-3")
        return made[name]

    return get


# ZeRO-3 down to one rank, and a tied ZeRO-2 model up to four (each pair of launches ~40-50 s here)
# both in the slow tier (~30 s and ~50 s): make test keeps the Trainer routes of tests/formats/test_routes.py
@pytest.mark.parametrize("name,world", [pytest.param("trainer_llama_zero3", 1, marks=pytest.mark.slow),
                                        pytest.param("trainer_qwen2_tied_zero2", 4, marks=pytest.mark.slow)])
def test_a_resharded_trainer_checkpoint_resumes_as_deepspeeds_universal_route(name, world, universal, tmp_path):
    from tests.e2e.hf_launch import resume

    out = tmp_path / "resharded" / "checkpoint-3"
    report = reshard(HF / name / "checkpoint-3", out, dp=world)
    per_device = 4 // world
    assert f"{per_device} x 1" in " ".join(report.notes)  # the batch that keeps the global batch of 4
    rng = "rng_state.pth" if world == 1 else "rng_state_3.pth"
    assert (out / rng).is_file() and (out / "trainer_state.json").is_file() and (out / "latest").is_file()
    ours = resume(HF / name, checkpoint=out, world_size=world, per_device_batch=per_device, out_dir=tmp_path / "a")
    theirs = resume(HF / name, checkpoint=universal(name), universal=True, world_size=world,
                    per_device_batch=per_device, out_dir=tmp_path / "b")
    assert ours["ok"], ours.get("error")
    assert theirs["ok"], theirs.get("error")
    assert [s["step"] for s in ours["losses"]] == [4, 5, 6]
    assert [s["loss"] for s in ours["losses"]] == [s["loss"] for s in theirs["losses"]]
