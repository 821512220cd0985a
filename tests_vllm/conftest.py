"""Fixtures of the vLLM tests (``make test-vllm``, in ``.venv-vllm``; ``make test`` does not collect
this folder). vLLM's engine and loader run in processes of their own, one at a time, each killed
with its process group if it outlives its timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

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
    import json

    work = tmp_path_factory.mktemp("hf-engine")
    run([HERE / "engine_run.py", qwen2, work / "hf.json"], ENGINE_S, work / "hf.log")
    return json.loads((work / "hf.json").read_text())
