"""Fixtures of the vLLM tests (``make test-vllm``, in ``.venv-vllm``; ``make test`` does not collect
this folder). vLLM's engine and loader run in processes of their own, one at a time, each killed
with its process group if it outlives its timeout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import vllm  # noqa: F401 -- the engine these tests check: a broken .venv-vllm fails them, never skips them

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def run(args: list, timeout: float, log: Path, env: dict | None = None) -> None:
    """``python ARGS`` in this environment (plus ``env``), output to ``log``; fails the test (after
    killing the process group: vLLM's engine and workers included) on a non-zero exit or a
    timeout. The learned-maps cache stays in each process (``RESHARD_CACHE_DIR=off``: no entry of
    an earlier run is read) unless ``env`` names a cache folder."""
    env = {**os.environ, "RESHARD_CACHE_DIR": "off", **(env or {}),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with open(log, "w") as out:
        p = subprocess.Popen([sys.executable, *map(str, args)], stdout=out, stderr=subprocess.STDOUT, env=env,
                             cwd=ROOT, start_new_session=True)
        try:
            code = p.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            pytest.fail(f"{args[0]} ran past {timeout} s (killed); its output: {log}")
    if code:
        tail = log.read_text(errors="replace")[-4000:]
        pytest.fail(f"{' '.join(map(str, args))} exited {code}:\n{tail}")


def reshard_convert(src: Path, out: Path, tp: int, dtype: str, log: Path) -> None:
    run(["-m", "reshard", "convert", src, out, "--format", "vllm", "--tp", tp, "--dtype", dtype], 300, log)


@pytest.fixture(scope="session")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 model folder vLLM's CPU backend serves (``make_qwen2.py``), float32."""
    out = tmp_path_factory.mktemp("qwen2") / "hf"
    run([HERE / "make_qwen2.py", out], 300, out.parent / "make.log")
    return out


ENGINE_S = 600  # one engine start, a few prompts and its teardown (about a minute here)


@pytest.fixture(scope="session")
def hf_engine(qwen2: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """vLLM's own HF load of ``qwen2`` at TP 2 (``engine_run.py``): what every sharded state made
    from its weights must generate and keep. One engine start for the whole session."""

    work = tmp_path_factory.mktemp("hf-engine")
    run([HERE / "engine_run.py", qwen2, work / "hf.json"], ENGINE_S, work / "hf.log")
    return json.loads((work / "hf.json").read_text())


def sharded_engine(folder: Path, work: Path, sharded: bool = True) -> dict:
    """``engine_run.py --sharded``: vLLM loading ``folder`` with ``load_format="sharded_state"``
    (``sharded=False``: vLLM's own load of the HF folder ``folder``)."""
    name = "sharded" if sharded else "hf"
    run([HERE / "engine_run.py", folder, work / f"{name}.json", *(["--sharded"] if sharded else [])], ENGINE_S,
        work / f"{name}.log")
    return json.loads((work / f"{name}.json").read_text())


MEGATRON = HERE.parent / "tests" / "fixtures" / "megatron" / "torch_dist_tp2_qwen2_vllm"
# the same shape over 2 pipeline stages: TP 2 x PP 2, two layers, hidden 128 (2 query heads of 64)
MEGATRON_PP = HERE.parent / "tests" / "fixtures" / "megatron" / "torch_dist_tp2_pp2_qwen2_vllm"


def megatron_exports(checkpoint: Path, work: Path) -> dict:
    """``checkpoint`` converted with ``--format hf`` in bf16 and fp32, and vLLM's own load of the
    bf16 folder at TP 2: the reference for everything made of that checkpoint."""
    for dtype in ("bf16", "fp32"):
        run(["-m", "reshard", "convert", checkpoint, work / f"hf-{dtype}", "--format", "hf", "--dtype", dtype], 300,
            work / f"convert-hf-{dtype}.log")
    (work / "e-hf").mkdir()
    return {"work": work, "checkpoint": checkpoint, "hf": sharded_engine(work / "hf-bf16", work / "e-hf", sharded=False)}


def megatron_served(exports: dict) -> dict:
    """``exports``, and its checkpoint converted with ``--format vllm --tp 2`` in bf16 and fp32;
    vLLM's own loaders on the fp32 HF folder at TP 2 (``loader_run.py``); an engine on the bf16
    sharded state."""
    work, checkpoint = exports["work"], exports["checkpoint"]
    for dtype in ("bf16", "fp32"):
        run(["-m", "reshard", "convert", checkpoint, work / f"vllm-{dtype}", "--format", "vllm", "--dtype", dtype,
             "--tp", 2], 300, work / f"convert-vllm-{dtype}.log")
    run([HERE / "loader_run.py", work / "hf-fp32", work / "loader", "--tp", 2, "--dtype", "float32"], 600,
        work / "loader.log")
    (work / "e-sharded").mkdir()
    return {**exports, "sharded": sharded_engine(work / "vllm-bf16", work / "e-sharded")}


@pytest.fixture(scope="session")
def megatron_hf(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The committed Megatron-Core fixture ``torch_dist_tp2_qwen2_vllm`` (a Qwen2-shaped GPTModel
    Megatron-LM trained and saved at TP 2, bf16: head_dim 64, 4 query heads in 2 groups, q/k/v
    biases, a 120-token vocabulary padded to 128 by Megatron) exported (``megatron_exports``): a
    model of its own, so not ``hf_engine``."""
    return megatron_exports(MEGATRON, tmp_path_factory.mktemp("megatron"))


@pytest.fixture(scope="session")
def megatron(megatron_hf: dict) -> dict:
    """``megatron_hf`` served (``megatron_served``)."""
    return megatron_served(megatron_hf)


@pytest.fixture(scope="session")
def megatron_pp(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """``torch_dist_tp2_pp2_qwen2_vllm`` (Megatron-LM trained and saved it at TP 2 x PP 2, bf16)
    exported and served: its layers come from two pipeline stages' files."""
    return megatron_served(megatron_exports(MEGATRON_PP, tmp_path_factory.mktemp("megatron-pp")))
