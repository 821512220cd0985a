"""``make bench-vllm`` (in ``.venv-vllm``: vLLM 0.32, CPU build): reshard against vLLM itself, one
run each, ratios printed.

(a) Per live update, on the same model, engine and processes (``tests_vllm/live_run.py --bench``):
    the "reshard" weight-transfer backend (each worker receives exactly its parameters' elements)
    against the common path (the trainer gathers each full tensor with ``full_tensor()`` and sends it
    to every worker, whose ``load_weights`` takes what it needs): wall time and bytes per worker.
(b) A vLLM sharded state at TP 2 from an HF folder: ``reshard convert HF OUT --format vllm --tp 2``
    against vLLM's own way, a full engine load (``LLM(model=HF, tensor_parallel_size=2)``) then
    ``save_sharded_state``: wall time of each command and the peak RSS of its whole process tree
    (psutil, the sum of every process's RSS, sampled every 20 ms: vLLM's engine core and its two
    workers included; shared pages count once per process), and what each output holds.

    .venv-vllm/bin/python -m benchmarks.bench_vllm [--updates N] [--layers L] [--hidden H]

Not part of ``make bench`` (``.venv`` has no vLLM). Engine starts take about a minute each here;
the run makes two (the live loop's and the full load's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests_vllm"
RUN_S = 900  # one command's limit (an engine start is about a minute here)


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0|1"))


def measured(args: list, log: Path) -> tuple[float, int, int]:
    """``python ARGS``: its wall time (s), the peak RSS of its process tree (bytes), sampled, and the
    most processes that tree held at once."""
    import psutil

    from benchmarks.common import tree_rss

    with open(log, "w") as out:
        t0 = time.perf_counter()
        p = psutil.Popen([sys.executable, *map(str, args)], stdout=out, stderr=subprocess.STDOUT, env=env(), cwd=ROOT,
                         start_new_session=True)
        peak = most = 0
        while p.poll() is None:
            total, procs = tree_rss(p)
            peak, most = max(peak, total), max(most, len(procs))
            if time.perf_counter() - t0 > RUN_S:
                os.killpg(p.pid, 9)
                raise SystemExit(f"{args[0]} ran past {RUN_S} s; its output: {log}")
            time.sleep(0.02)
        wall = time.perf_counter() - t0
    if p.returncode:
        raise SystemExit(f"{' '.join(map(str, args))} exited {p.returncode}; its output: {log}")
    return wall, peak, most


def holds(folder: Path) -> dict:
    """What a sharded-state folder holds: files, tensors, bytes, and tensors with no elements."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    tensors = empty = size = 0
    linears = set()
    for f in files:
        size += f.stat().st_size
        with safe_open(f, "pt") as g:
            for k in g.keys():
                tensors += 1
                shape = g.get_slice(k).get_shape()
                if any(d == 0 for d in shape):
                    empty += 1
                elif k.endswith("_proj.weight"):
                    linears.add(k)
    return {"files": len(files), "tensors": tensors, "empty": empty, "linear_weights": len(linears), "bytes": size}


def live(work: Path, updates: int) -> list[str]:
    model = work / "qwen2"
    subprocess.run([sys.executable, TESTS / "make_qwen2.py", model], check=True, env=env(), cwd=ROOT)
    out = work / "live"
    wall, _, _ = measured([TESTS / "live_run.py", model, out, "--steps", 0, "--bench", updates,
                          "--timeout", 300], work / "live.log")
    b = json.loads((out / "trainer0.json").read_text())["bench"]
    # rank 0 drives start/finish through the engine: its time is the update's (rank 1's also holds its
    # wait while rank 0 asks the engine to generate between updates); the first update of each path
    # warms its buffers, the rest are the steady state
    steady = slice(1, None) if updates > 1 else slice(None)
    ours, peer = (statistics.median(b[f"{k}_ms"][steady]) for k in ("reshard", "common"))
    got = [w["received_bytes"] for w in b["reshard_workers"]]
    common = [w["received_bytes"] for w in b["common_workers"]]
    return [
        f"(a) tiny Qwen2 (2 layers, hidden 256, vocabulary 300), 2 FSDP2 trainer ranks -> vLLM TP 2, bf16; "
        f"{updates} updates by each path, interleaved ({wall:.0f} s with the engine start)",
        f"  per update, trainer rank 0, median of updates 2..{updates}: reshard {ours:.1f} ms, "
        f"common path {peer:.1f} ms: {peer / ours:.1f}x",
        f"  all updates (rank 0, ms): reshard {[round(x, 1) for x in b['reshard_ms']]}, "
        f"common {[round(x, 1) for x in b['common_ms']]}",
        f"  bytes received per worker: reshard {got}, common path {common}: {common[0] / got[0]:.2f}x, "
        f"{common[1] / got[1]:.2f}x (the ideal, 1/TP of the common path's for every sharded parameter)",
        f"  engine generates the same after either path: {b['outputs']['reshard'] == b['outputs']['common']}",
    ]


def make_model(folder: Path, layers: int, hidden: int) -> int:
    """A Qwen2 (head_dim 64, GQA 4:1, untied, vocabulary 32000) with random weights, saved in bf16."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    heads = hidden // 64
    config = Qwen2Config(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4 // 64 * 64,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                         head_dim=64, max_position_embeddings=128, tie_word_embeddings=False, bos_token_id=1,
                         eos_token_id=2, dtype="bfloat16")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def convert_vs_save(work: Path, layers: int, hidden: int) -> list[str]:
    hf = work / "big"
    n = make_model(hf, layers, hidden)
    size = sum(f.stat().st_size for f in hf.glob("*.safetensors"))
    ours_s, ours_rss, ours_n = measured(["-m", "reshard", "convert", hf, work / "reshard", "--format", "vllm", "--tp", 2,
                                 "--dtype", "bf16"], work / "convert.log")
    vllm_out = work / "vllm"
    peer_s, peer_rss, peer_n = measured([Path(__file__), "--vllm-save", hf, vllm_out], work / "save.log")
    inner = json.loads((vllm_out / "timing.json").read_text())
    ours_h, peer_h = holds(work / "reshard"), holds(vllm_out)
    mib = 2**20
    return [
        f"(b) Qwen2 of {n / 1e6:.0f}M parameters ({layers} layers, hidden {hidden}, head_dim 64, vocabulary 32000; "
        f"HF folder {size / mib:.0f} MiB bf16) -> sharded state at TP 2, bf16",
        f"  reshard convert --format vllm --tp 2: {ours_s:.1f} s, peak RSS {ours_rss / mib:.0f} MiB ({ours_n} processes)",
        f"  vLLM LLM(tp=2) + save_sharded_state: {peer_s:.1f} s (engine start {inner['load_s']:.1f} s, "
        f"save_sharded_state {inner['save_s']:.2f} s), peak RSS {peer_rss / mib:.0f} MiB ({peer_n} processes)",
        f"  ratios: time {peer_s / ours_s:.1f}x, peak RSS {peer_rss / ours_rss:.1f}x",
        f"  reshard wrote {ours_h}",
        f"  vLLM wrote    {peer_h}",
    ]


def vllm_save(model: str, out: str) -> None:
    """vLLM's own way to a sharded state (its ``save_sharded_state`` example): a full engine load,
    then each worker saves its model's state dict."""
    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(model=model, tensor_parallel_size=2, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
              max_model_len=64, max_num_seqs=2, gpu_memory_utilization=0.05, seed=0)
    t1 = time.perf_counter()
    os.makedirs(out, exist_ok=True)
    llm.llm_engine.engine_core.save_sharded_state(path=out)
    t2 = time.perf_counter()
    with open(os.path.join(out, "timing.json"), "w") as f:
        json.dump({"load_s": t1 - t0, "save_s": t2 - t1}, f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--updates", type=int, default=5)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--only", choices=("live", "convert"))
    ap.add_argument("--vllm-save", nargs=2, metavar=("MODEL", "OUT"))
    ap.add_argument("--work", help="keep the models, outputs and logs here (default: a temporary folder)")
    a = ap.parse_args()
    if a.vllm_save:
        vllm_save(*a.vllm_save)
        return
    from benchmarks.common import machine

    print(f"machine: {machine()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(a.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        if a.only != "convert":
            for line in live(work, a.updates):
                print(line, flush=True)
        if a.only != "live":
            for line in convert_vs_save(work, a.layers, a.hidden):
                print(line, flush=True)


if __name__ == "__main__":
    main()
