"""The "reshard" backend fed by a checkpoint folder's reader: 2 trainer ranks, no training
framework, each opens CHECKPOINT with reshard under HF names (``reshard.open(..., names="hf")``)
and offers the fragments of its own storage rank (``ShardSource.checkpoint``: memory-mapped, never
gathered); trainer rank 0 also holds an ``LLM`` at TP 2 started on MODEL_DIR (the same
architecture) with ``load_format="dummy"`` (random weights) and backend "reshard". One
``send_weights()``; rank 0 records what the engine generates and keeps before and after it and
the workers' counters, each rank what it held and sent.

    python tests_vllm/reader_run.py CHECKPOINT MODEL_DIR OUT_DIR

Results: ``OUT_DIR/reader.json`` (rank 0) and ``OUT_DIR/trainer{r}.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def trainer(rank: int, args, ports: list[int]) -> None:
    """One trainer rank; it leaves with ``os._exit`` (as ``live_run.trainer``)."""
    try:
        _trainer(rank, args, ports)
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


def generate(llm, model: str) -> list:
    from engine_run import MAX_TOKENS, TOP, prompts_for
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts_for(model)], params, use_tqdm=False)
    return [{"tokens": list(o.outputs[0].token_ids),
             "logprobs": [{str(t): lp.logprob for t, lp in sorted(step.items())} for step in o.outputs[0].logprobs]}
            for o in outs]


def _trainer(rank: int, args, ports: list[int]) -> None:
    import torch.distributed as dist
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.plugins import load_general_plugins

    import reshard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank, world_size=2)
    load_general_plugins()
    from reshard.formats.vllm.trainer import LLMClient, ReshardTrainerInitInfo, ShardSource

    llm = client = None
    if rank == 0:
        from vllm import LLM
        from vllm.config import WeightTransferConfig

        llm = LLM(model=args.model, load_format="dummy", tensor_parallel_size=2, skip_tokenizer_init=True,
                  dtype="bfloat16", enforce_eager=True, max_model_len=64, max_num_seqs=2,
                  gpu_memory_utilization=0.05, seed=0, weight_transfer_config=WeightTransferConfig(backend="reshard"))
        client = LLMClient(llm)
    dist.barrier()  # the engine is up: the transfer group can form
    reader = reshard.open(args.checkpoint, names="hf")
    source = ShardSource.checkpoint(reader, rank)
    info = ReshardTrainerInitInfo(rank=rank, host="127.0.0.1", port=ports[1], trainer_ranks=2, world_size=4,
                                  timeout_s=120)
    eng = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
    rec: dict = {"rank": rank, "params": len(source.maps), "held": len(source.shards),
                 "local_numel": sum(t.numel() for t in source.shards.values()),
                 "whole": sorted(n for n, t in source.shards.items()  # held whole on this rank
                                 if t.numel() >= math.prod(source.maps[n].valid_shape))}
    if rank == 0:
        from live_probe import engine_stats
        from probe import kept

        out = {"before": generate(llm, args.model), "kept_before": llm.apply_model(kept)}
    eng.send_weights()
    rec["sent_bytes"] = {str(q): b for q, b in eng.stats["sent_bytes"].items()}
    if rank == 0:
        out.update(after=generate(llm, args.model), kept=llm.apply_model(kept),
                   workers=llm.collective_rpc(engine_stats))
        with open(os.path.join(args.out, "reader.json"), "w") as f:
            json.dump(out, f)
    with open(os.path.join(args.out, f"trainer{rank}.json"), "w") as f:
        json.dump(rec, f)
    dist.barrier()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("model")
    ap.add_argument("out")
    args = ap.parse_args()
    if os.getpgid(0) != os.getpid():
        os.setsid()  # a process group of its own, ended with it (live_run._end_group)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1" if (os.cpu_count() or 1) > 1 else "0|0")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc pickles functions
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, HERE)
    os.makedirs(args.out, exist_ok=True)
    import torch.multiprocessing as mp
    from live_run import _end_group

    from reshard.execute.group import free_port

    try:
        mp.start_processes(trainer, args=(args, [free_port(), free_port()]), nprocs=2, start_method="spawn")
    finally:
        _end_group()


if __name__ == "__main__":
    main()
