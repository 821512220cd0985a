"""reshard.present.demo: ``make demo`` runs end to end, and its bit-for-bit comparison of universal
checkpoints catches what it claims to (a flipped bit, a signed zero, a missing state)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from reshard.present import demo
from reshard.present.demo import DemoFailed, compare_universal


def test_demo_runs_its_whole_tour(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Every step of ``make demo`` runs here (nothing is skipped: a missing fixture fails the demo)
    and prints its proof."""
    monkeypatch.chdir(tmp_path)
    demo.main()
    out = capsys.readouterr().out
    steps = [line.split()[0] for line in out.splitlines() if line.startswith("  ")]
    assert steps == ["derive"] * 4 + ["plan"] * 2 + ["reshard", "convert", "hf", "hf", "names", "names", "picture"]
    assert "TP=2 x DP=2 ZeRO-1 -> TP=1 x DP=4 ZeRO-1" in out
    assert "84 tensors" in out and "all identical" in out
    assert out.count("from_pretrained loads LlamaForCausalLM (21 tensors); logits on a probe equal") == 2
    assert "logits vs Megatron's own forward" in out and "PyTorch DCP (FSDP2, 2 ranks)" in out
    assert out.rstrip().endswith("Every step ran and every check held.")
    png = tmp_path / "demo-out" / "plan_tp2_dp2_to_tp1_dp4.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(png.relative_to(tmp_path)) in out
    for folder in ("tp1_dp4", "ucp_source", "ucp_resharded"):
        assert (tmp_path / "demo-out" / folder / "global_step3").is_dir()
    for folder in ("hf_source", "hf_resharded", "hf_megatron", "hf_dcp"):
        assert (tmp_path / "demo-out" / folder / "config.json").is_file()


def test_demo_fails_rather_than_skip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fixture it tours, missing: the demo fails (make demo exits non-zero), naming it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(demo, "FIXTURE", tmp_path / "nowhere")
    with pytest.raises(DemoFailed, match="nowhere"):
        demo.reshard_tour()


def test_fixture_paths_exist() -> None:
    """The demo finds the committed fixtures from its own module's place in the checkout."""
    for path in (demo.FIXTURE, demo.MEGATRON, demo.DCP):
        assert path.is_dir(), path


def _universal(root: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """A minimal universal checkpoint: zero/<param>/<state>.pt holding {"param": tensor}."""
    for name, t in tensors.items():
        f = root / "zero" / f"{name}.pt"
        f.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"param": t, "cat_dim": 0}, f)
    return root


def _states(w: torch.Tensor) -> dict[str, torch.Tensor]:
    return {f"w/{s}": w.clone() for s in ("fp32", "exp_avg", "exp_avg_sq")}


def test_compare_accepts_identical(tmp_path: Path) -> None:
    w = torch.randn(4, 3)
    a, b = _universal(tmp_path / "a", _states(w)), _universal(tmp_path / "b", _states(w))
    assert compare_universal(a, b) == ["w/exp_avg", "w/exp_avg_sq", "w/fp32"]


@pytest.mark.parametrize("change", ["flip one bit", "signed zero", "missing state", "dtype"])
def test_compare_catches(tmp_path: Path, change: str) -> None:
    w = torch.randn(4, 3)
    w[0, 0] = 0.0
    other = _states(w)
    if change == "flip one bit":
        other["w/fp32"].view(torch.int32)[1, 1] ^= 1
    elif change == "signed zero":
        other["w/exp_avg"][0, 0] = -0.0
    elif change == "missing state":
        del other["w/exp_avg_sq"]
    else:
        other["w/fp32"] = other["w/fp32"].double()
    a, b = _universal(tmp_path / "a", _states(w)), _universal(tmp_path / "b", other)
    with pytest.raises(DemoFailed):
        compare_universal(a, b)
    with pytest.raises(DemoFailed):
        compare_universal(b, a)
