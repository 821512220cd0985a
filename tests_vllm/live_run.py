"""A live RL-style loop: 2 trainer ranks (FSDP2 over gloo, CPU) train the tiny Qwen2 of MODEL_DIR;
trainer rank 0 also holds a vLLM ``LLM`` at TP 2 with ``weight_transfer_config`` backend "reshard".
After each optimizer step every trainer rank calls ``send_weights()``; then rank 0 records the
engine's greedy tokens and top-20 logprobs, what it keeps as loaded (``probe.kept``) and each
worker's counters, and the trainer's weights (gathered for the test only, after the send) are
saved as an HF folder ``OUT/step{k}`` for a fresh vLLM load to compare against.

    python tests_vllm/live_run.py MODEL_DIR OUT_DIR [--steps 3] [--kill-worker-at K]

``--kill-worker-at K``: update K kills vLLM worker 1 (SIGKILL) right after ``start_weight_update``;
each trainer rank records whether ``send_weights`` raised ``TransferError`` and how long it took.
``--extra-param``: the trainers offer one parameter more than the model has; each records what
``trainer_init`` raised. ``--bench N`` first times N updates by the backend and N by the common path (``bench``);
``--timeout S`` sets the transfer group's timeout (30 s).
``--kill-trainer-at K``: trainer rank 1 exits instead of sending update K; rank 0 records its error and
what the engine generates and keeps afterwards (``after_failure``, ``kept_after_failure``).
Results: ``OUT/live.json`` (rank 0) and ``OUT/trainer{r}.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT_S = 30.0  # the transfer group's
EXTRA = "model.layers.0.mlp.extra_proj.weight"  # --extra-param's name


def llm_for(model: str):
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    return LLM(model=model, tensor_parallel_size=2, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
               max_model_len=64, max_num_seqs=2, gpu_memory_utilization=0.05, seed=0,
               weight_transfer_config=WeightTransferConfig(backend="reshard"))


def generate(llm) -> list:
    from engine_run import MAX_TOKENS, PROMPTS, TOP
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    return [{"tokens": list(o.outputs[0].token_ids),
             "logprobs": [{str(t): lp.logprob for t, lp in sorted(step.items())} for step in o.outputs[0].logprobs]}
            for o in outs]


def bench(rank: int, args, eng, model, llm, record: dict) -> None:
    """``--bench N``: N updates by the reshard backend and N by the common path (whole tensors
    gathered with ``full_tensor()`` and sent to every worker, ``load_weights`` there), alternating,
    on the same weights; rank 0 also records what the engine generates after each path's last."""
    from torch.distributed.tensor import DTensor

    def pairs():
        for n, p in model.named_parameters():
            yield n, p.full_tensor() if isinstance(p, DTensor) else p

    out: dict = {"reshard_ms": [], "common_ms": [], "outputs": {}}
    for _ in range(args.bench):
        for kind in ("reshard", "common"):
            t0 = time.perf_counter()
            eng.send_weights() if kind == "reshard" else eng.send_full_tensors(pairs())
            out[f"{kind}_ms"].append(1000 * (time.perf_counter() - t0))
            if rank == 0:
                from live_probe import engine_stats

                out[f"{kind}_workers"] = llm.collective_rpc(engine_stats)
                out["outputs"][kind] = generate(llm)
    out["common_sent_bytes"] = eng.stats.get("full_sent_bytes")
    out["reshard_sent_bytes"] = eng.stats.get("sent_bytes")
    record["bench"] = out


def compare_learned(llm, eng, model: str) -> dict:
    """``learned_targets`` of the running engine against the backend's own targets (workers at
    group ranks 2, 3) and ``layouts.arch.LLAMA_VLLM``'s: the names of parameters that differ."""
    from reshard.formats.vllm.trainer import learned_targets
    from reshard.ir.canonical import canonicalize
    from reshard.layouts.arch import LLAMA_VLLM, inference_targets

    def same(a, b) -> bool:
        return (a.into == b.into and dict(a.offsets) == dict(b.offsets)
                and {r: tuple(x) for r, x in a.shapes.items()} == {r: tuple(x) for r, x in b.shapes.items()}
                and canonicalize(a.map) == canonicalize(b.map))

    shapes = eng.shard_source.shapes
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    got = learned_targets(llm, shapes, ranks=[2, 3], use_cache=False)  # learned afresh from markers
    cached = learned_targets(llm, shapes)  # the workers' cache, which the backend's init filled
    arch = inference_targets(LLAMA_VLLM, shapes, tp=2, num_heads=config["num_attention_heads"],
                             num_kv_heads=config["num_key_value_heads"], ranks=[2, 3])
    return {"params": len(got), "differ_from_backend": [n for n in shapes if not same(got[n], eng.targets[n])],
            "differ_from_cached": [n for n in shapes if not same(cached[n].with_ranks({0: 2, 1: 3}), got[n])],
            "differ_from_arch": [n for n in shapes if not same(got[n], arch[n])]}


class Server:
    """``--http``: ``vllm serve`` of MODEL_DIR at TP 2 with the backend, its RL routes on
    (``VLLM_SERVER_DEV_MODE``), in this script's process group (ended with it)."""

    def __init__(self, model: str, out: str) -> None:
        import subprocess
        import urllib.request

        from reshard.execute.group import free_port

        self.model, port = model, free_port()
        self.url = f"http://127.0.0.1:{port}"
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
               "--tensor-parallel-size", "2", "--skip-tokenizer-init", "--dtype", "bfloat16", "--enforce-eager",
               "--max-model-len", "64", "--max-num-seqs", "2", "--gpu-memory-utilization", "0.05", "--seed", "0",
               "--weight-transfer-config", json.dumps({"backend": "reshard"})]
        self.proc = subprocess.Popen(cmd, env=env, stdout=open(os.path.join(out, "server.log"), "w"),
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited {self.proc.returncode}; see server.log")
            try:
                urllib.request.urlopen(self.url + "/health", timeout=5)
                return
            except OSError:
                time.sleep(2)
        raise RuntimeError("vllm serve did not come up in 400 s")

    def generate(self) -> list:
        """Greedy tokens of the prompts, over ``/v1/completions``."""
        import urllib.request

        from engine_run import MAX_TOKENS, PROMPTS

        out = []
        for p in PROMPTS:
            body = json.dumps({"model": self.model, "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                               "return_token_ids": True}).encode()
            req = urllib.request.Request(self.url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                out.append({"tokens": json.load(r)["choices"][0]["token_ids"]})
        return out


class KillingClient:
    """The offline client, killing vLLM worker ``victim`` once update ``at`` has started."""

    def __init__(self, inner, pids: list[int], at: int) -> None:
        self.inner, self.pids, self.at, self.starts = inner, pids, at, 0

    def init_weight_transfer_engine(self, info):
        self.inner.init_weight_transfer_engine(info)

    def start_weight_update(self):
        self.inner.start_weight_update()
        self.starts += 1
        if self.starts == self.at:
            os.kill(self.pids[1], signal.SIGKILL)

    def update_weights(self, info):
        self.inner.update_weights(info)

    def finish_weight_update(self, weight_version=None):
        self.inner.finish_weight_update(weight_version)


def trainer(rank: int, args, ports: list[int]) -> None:
    """One trainer rank; it always leaves with ``os._exit`` (a process holding a vLLM engine whose
    workers failed may otherwise wait at exit on the engine's processes)."""
    try:
        _trainer(rank, args, ports)
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


def _trainer(rank: int, args, ports: list[int]) -> None:
    import torch
    import torch.distributed as dist
    from probe import kept
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import Qwen2ForCausalLM
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.plugins import load_general_plugins

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank, world_size=2)
    load_general_plugins()
    from reshard.formats.vllm.trainer import LLMClient, ReshardTrainerInitInfo, ShardSource

    llm = client = None
    if rank == 0:
        from live_probe import pid

        if args.http:  # a vLLM server; the trainer drives it over its RL routes, with vLLM's own client
            from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

            llm = Server(args.model, args.out)
            client = HTTPVLLMWeightSyncClient(llm.url)
        else:
            llm = llm_for(args.model)
            client = LLMClient(llm)
        if args.kill_worker_at:
            client = KillingClient(client, llm.collective_rpc(pid), args.kill_worker_at)
    dist.barrier()

    torch.manual_seed(0)
    model = Qwen2ForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (2,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    info = ReshardTrainerInitInfo(rank=rank, host="127.0.0.1", port=ports[1], trainer_ranks=2, world_size=4,
                                  timeout_s=args.timeout)
    source = ShardSource.fsdp2(model)
    if args.extra_param:  # a parameter the engine's model does not have: every rank must refuse it at init
        from reshard.layouts.tp import replicated

        source = ShardSource({**source.maps, EXTRA: replicated((4,), 2)}, {**source.shards, EXTRA: torch.zeros(4)})
        t0 = time.perf_counter()
        try:
            WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
            raised = None
        except Exception as e:
            raised = f"{type(e).__name__}: {e}"
        with open(os.path.join(args.out, f"trainer{rank}.json"), "w") as f:
            json.dump({"rank": rank, "raised": raised, "init_s": time.perf_counter() - t0}, f)
        return
    eng = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
    if rank == 0 and not args.http:
        from live_probe import engine_stats

        init_workers = llm.collective_rpc(engine_stats)  # before learned_targets: where init took the maps from
        live_learned = compare_learned(llm, eng, args.model)
    local_bytes = {n: t.numel() * t.element_size() for n, t in eng.source.shards.items()}
    record: dict = {"rank": rank, "init_s": eng.stats["init_s"], "steps": [],
                    "common_bytes_per_worker": eng.common_bytes_per_worker,
                    "local_numel": sum(t.numel() for t in eng.source.shards.values()), "local_bytes": local_bytes}
    before = (llm.generate() if args.http else generate(llm)) if rank == 0 else None
    live: dict = {"steps": [], "before": before,
                  "learned": live_learned if rank == 0 and not args.http else None,
                  "init_workers": init_workers if rank == 0 and not args.http else None}
    if args.bench:
        bench(rank, args, eng, model, llm, record)
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(1, args.steps + 1):
        ids = torch.randint(0, 300, (2, 16), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        real = DTensor.full_tensor

        def refuse(self):  # no trainer rank may gather a whole tensor inside send_weights
            raise RuntimeError("full_tensor() called during send_weights")

        DTensor.full_tensor = refuse  # type: ignore[method-assign]
        if rank == 1 and step == args.kill_trainer_at:
            os._exit(0)  # dies before sending (exit 0: torch's launcher would otherwise end rank 0 too)
        t0 = time.perf_counter()
        try:
            eng.send_weights()
            raised = None
        except Exception as e:  # recorded by type: the test wants TransferError, and only on a killed worker
            raised = f"{type(e).__name__}: {e}"
        finally:
            DTensor.full_tensor = real  # type: ignore[method-assign]
        elapsed = time.perf_counter() - t0
        record["steps"].append({"step": step, "loss": float(loss.detach()), "send_s": elapsed, "raised": raised,
                                "sent_bytes": {str(q): b for q, b in eng.stats.get("sent_bytes", {}).items()}})
        if raised is not None:
            if rank == 0 and args.kill_trainer_at:  # the engine must still serve the last good update
                live["after_failure"] = generate(llm)
                live["kept_after_failure"] = llm.apply_model(kept)
            break
        full = {n: p.full_tensor().detach().clone() if isinstance(p, DTensor) else p.detach().clone()
                for n, p in model.named_parameters()}
        if rank == 0:
            from live_probe import engine_stats

            folder = os.path.join(args.out, f"step{step}")
            os.makedirs(folder, exist_ok=True)
            for f in ("config.json", "generation_config.json"):
                shutil.copy(os.path.join(args.model, f), folder)
            save_file({n: t.contiguous() for n, t in full.items()}, os.path.join(folder, "model.safetensors"),
                      metadata={"format": "pt"})
            if args.http:
                live["steps"].append({"step": step, "outputs": llm.generate()})
            else:
                live["steps"].append({"step": step, "outputs": generate(llm), "kept": llm.apply_model(kept),
                                      "workers": llm.collective_rpc(engine_stats)})
        dist.barrier()
    with open(os.path.join(args.out, f"trainer{rank}.json"), "w") as f:
        json.dump(record, f)
    if rank == 0:
        with open(os.path.join(args.out, "live.json"), "w") as f:
            json.dump(live, f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--kill-worker-at", type=int, default=0)
    ap.add_argument("--kill-trainer-at", type=int, default=0)
    ap.add_argument("--bench", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=TIMEOUT_S, help="the transfer group's (benchmarks: longer, for "
                    "a busy machine where rank 0's engine calls outlast it)")
    ap.add_argument("--http", action="store_true")
    ap.add_argument("--extra-param", action="store_true")
    args = ap.parse_args()
    if os.getpgid(0) != os.getpid():
        os.setsid()  # a process group of its own, ended with it (_end_group)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1" if (os.cpu_count() or 1) > 1 else "0|0")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc pickles functions
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, HERE)
    os.makedirs(args.out, exist_ok=True)
    import torch.multiprocessing as mp

    from reshard.execute.group import free_port

    try:
        mp.start_processes(trainer, args=(args, [free_port(), free_port()]), nprocs=2, start_method="spawn")
    finally:
        _end_group()


def _end_group() -> None:
    """The trainers leave with ``os._exit`` (a killed worker leaves vLLM's engine unable to shut down
    cleanly), so vLLM's engine processes may outlive them: end every other process of this
    script's own process group (``main`` makes one), by id."""
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != me:
            try:
                if os.getpgid(int(entry)) == me:
                    os.kill(int(entry), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


if __name__ == "__main__":
    main()
