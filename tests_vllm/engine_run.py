"""One vLLM engine (CPU, TP 2) on a model folder: greedy tokens and top-20 logprobs of a few prompts,
and a digest of every tensor each rank's model keeps after loading, written to a JSON file.

    python tests_vllm/engine_run.py MODEL_DIR OUT.json [--sharded]

``--sharded`` loads ``MODEL_DIR`` with ``load_format="sharded_state"``. A script of its own (and a
process per engine) because vLLM spawns its engine processes: one engine at a time, torn down with
its process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

PROMPTS = [[1, 17, 42, 99, 7], [250, 3, 3, 3, 128, 64, 299], [5]]  # token ids modulo the model's vocabulary
MAX_TOKENS = 8
TOP = 20


def prompts_for(model: str) -> list[list[int]]:
    """``PROMPTS`` with each token id modulo the vocabulary of MODEL_DIR's ``config.json``."""
    with open(os.path.join(model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    return [[t % vocab for t in p] for p in PROMPTS]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--sharded", action="store_true")
    ap.add_argument("--tp", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1))
                                                                for i in range(args.tp)))
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model pickles a function
    # ... by reference: from a module every engine process imports (not __main__)
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, here)
    from probe import kept
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, load_format="sharded_state" if args.sharded else "auto",
              tensor_parallel_size=args.tp, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
              max_model_len=64, max_num_seqs=2, gpu_memory_utilization=0.05, seed=0)
    prompts = prompts_for(args.model)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    result = {"outputs": [], "kept": llm.apply_model(kept)}
    for o in outs:
        c = o.outputs[0]
        result["outputs"].append({
            "tokens": list(c.token_ids),
            "logprobs": [{str(t): lp.logprob for t, lp in sorted(step.items())} for step in c.logprobs],
        })
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
