"""vLLM's own loader at TP T, without an engine: T processes (gloo, one per TP rank, as vLLM's workers
are) each build vLLM's model class for MODEL_DIR, load its HF weights with vLLM's default loader
(each parameter's ``weight_loader``) and save the state dict ``load_format="sharded_state"`` fills
on that rank -- the engine's own state *before* post-processing (CPU repacks the linears after
it) -- as ``OUT/rank-{r}.safetensors``.

    python tests_vllm/loader_run.py MODEL_DIR OUT_DIR --tp T [--dtype bfloat16] [--no-fp8-kernel]
                                    [--load-format sharded_state]

``--load-format sharded_state``: MODEL_DIR is a sharded state (``--format vllm``) that vLLM's
``ShardedStateLoader`` loads (refusing a missing or unknown key), saved back the same way.

``--no-fp8-kernel`` (an FP8 block-scale model): vLLM's CPU build chooses an FP8 matmul kernel when
it builds each linear and has one only on AMX CPUs; loading never uses it, so the layers are built
without one (the kernel choice returns ``None``) and every weight_loader runs as vLLM ships it.

No engine starts (a few seconds a rank): this is how the tests read every tensor vLLM loads,
fused linears included, and learn the maps vLLM's loaders lay each HF tensor out in.
"""

from __future__ import annotations

import argparse
import os
import socket


def worker(rank: int, tp: int, port: int, model: str, dtype: str, out: str, no_fp8_kernel: bool = False,
           load_format: str = "auto") -> None:
    import torch
    from safetensors.torch import save_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    if no_fp8_kernel:
        from vllm.model_executor.layers.quantization import fp8

        fp8.init_fp8_linear_kernel = lambda **_: None

    cfg = EngineArgs(model=model, dtype=dtype, tensor_parallel_size=tp, skip_tokenizer_init=True, enforce_eager=True,
                     max_model_len=64, load_format=load_format).create_engine_config()
    os.environ["VLLM_DIST_IDENT"] = str(port)  # what vLLM's CPU worker sets: its shared-memory group's name
    with set_current_vllm_config(cfg):
        init_distributed_environment(tp, rank, f"tcp://127.0.0.1:{port}", rank, "gloo")
        initialize_model_parallel(tensor_model_parallel_size=tp)
        with set_default_torch_dtype(cfg.model_config.dtype), torch.device("cpu"):
            m = initialize_model(vllm_config=cfg)
        get_model_loader(cfg.load_config).load_weights(m, cfg.model_config)
    state = ShardedStateLoader._filter_subtensors(m.state_dict())
    save_file({k: v.detach().contiguous() for k, v in state.items()}, os.path.join(out, f"rank-{rank}.safetensors"))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(model: str, out: str, tp: int, dtype: str = "bfloat16", no_fp8_kernel: bool = False,
        load_format: str = "auto") -> None:
    import torch.multiprocessing as mp

    os.makedirs(out, exist_ok=True)
    mp.start_processes(worker, args=(tp, _port(), model, dtype, out, no_fp8_kernel, load_format), nprocs=tp,
                       start_method="spawn")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--no-fp8-kernel", action="store_true")
    ap.add_argument("--load-format", default="auto", choices=("auto", "sharded_state"))
    a = ap.parse_args()
    run(a.model, a.out, a.tp, a.dtype, a.no_fp8_kernel, a.load_format)
