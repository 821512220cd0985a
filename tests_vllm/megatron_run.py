"""The "reshard" backend fed by a live Megatron-Core trainer: 2 trainer ranks (gloo, CPU) hold a
Qwen2-shaped ``GPTModel`` (local spec; head_dim 64, 4 query heads in 2 groups, q/k/v biases,
SwiGLU, RMSNorm, untied, a 120-token vocabulary padded to 128 rows) at TP 2 and train it with
torch's AdamW on their own parameters; trainer rank 0 also holds an ``LLM`` at TP 2 started on the
model's config with ``load_format="dummy"`` (random weights) and backend "reshard". The source is
``ShardSource.megatron(model, vocab_size=120)``: each rank's views of its own module parameters.
After each optimizer step every rank calls ``send_weights()`` (every gather of ``torch.distributed``
raising meanwhile); rank 0 records what the engine generates and keeps, and the workers' counters.

For the test only (after the sends), the ranks gather their parameters and write them as an HF
folder ``OUT/step{k}``, converted here by hand (not by reshard): Megatron's q/k/v rows per query
group and fc1's ``[gate_t; up_t]`` undone, the vocabulary padding cut. Rank 0 checks that
conversion against Megatron itself: transformers' Qwen2 on that folder against the GPTModel's own
forward (logits, float32).

    python tests_vllm/megatron_run.py OUT_DIR [--steps 2]

Needs megatron-core importable (``make test-vllm`` installs it into its venv) and
``scripts/_megatron_cpu.py`` (Megatron on CPU). Results: ``OUT/megatron.json`` (rank 0),
``OUT/trainer{r}.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(os.path.dirname(HERE), "scripts")
VOCAB, PADDED, HIDDEN, FFN, HEADS, GROUPS, HEAD_DIM, LAYERS = 120, 128, 256, 128, 4, 2, 64, 2
ROPE_THETA, EPS = 10000.0, 1e-6


def hf_config():
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                       num_attention_heads=HEADS, num_key_value_heads=GROUPS, head_dim=HEAD_DIM,
                       max_position_embeddings=128, rms_norm_eps=EPS, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
                       bos_token_id=1, eos_token_id=2, dtype="float32")


def megatron_model(seed: int = 0):
    """The GPTModel on this TP rank (Megatron's parallel state already initialized)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
        kv_channels=HEAD_DIM, ffn_hidden_size=FFN, gated_linear_unit=True, activation_func=F.silu,
        normalization="RMSNorm", layernorm_epsilon=EPS, add_bias_linear=False, add_qkv_bias=True,
        tensor_model_parallel_size=2, pipeline_model_parallel_size=1, use_cpu_initialization=True,
        params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.08,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                     vocab_size=PADDED, max_sequence_length=128, parallel_output=True,
                     share_embeddings_and_output_weights=False, position_embedding_type="rope",
                     rotary_base=int(ROPE_THETA))
    with torch.no_grad():  # norms away from 1, as make_qwen2 (so a wrong norm mapping shows)
        g = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
    return model


def inputs(tokens):
    import torch

    s = tokens.shape[1]
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)  # True: masked (future tokens)
    return dict(input_ids=tokens, position_ids=torch.arange(s).unsqueeze(0).expand_as(tokens), attention_mask=mask)


def gathered(model) -> dict:
    """Every parameter gathered over the TP group (the test's oracle only, after the sends)."""
    import torch
    import torch.distributed as dist

    out = {}
    for name, p in model.named_parameters():
        parts = [torch.empty_like(p) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, p.detach().contiguous())
        out[name] = parts
    return out


def to_hf(parts: dict) -> dict:
    """Megatron's TP parts as HF Qwen2 tensors (by hand; independent of reshard's maps)."""
    import torch

    per = HEADS // GROUPS
    out = {"model.embed_tokens.weight": torch.cat(parts["embedding.word_embeddings.weight"])[:VOCAB],
           "lm_head.weight": torch.cat(parts["output_layer.weight"])[:VOCAB],
           "model.norm.weight": parts["decoder.final_layernorm.weight"][0]}
    for i in range(LAYERS):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        for kind in ("weight", "bias"):
            qkv = torch.cat(parts[m + f"self_attention.linear_qkv.{kind}"]).unflatten(0, (GROUPS, (per + 2) * HEAD_DIM))
            out[h + f"self_attn.q_proj.{kind}"] = qkv[:, :per * HEAD_DIM].flatten(0, 1)
            out[h + f"self_attn.k_proj.{kind}"] = qkv[:, per * HEAD_DIM:(per + 1) * HEAD_DIM].flatten(0, 1)
            out[h + f"self_attn.v_proj.{kind}"] = qkv[:, (per + 1) * HEAD_DIM:].flatten(0, 1)
        out[h + "self_attn.o_proj.weight"] = torch.cat(parts[m + "self_attention.linear_proj.weight"], 1)
        fc1 = [t.chunk(2) for t in parts[m + "mlp.linear_fc1.weight"]]
        out[h + "mlp.gate_proj.weight"] = torch.cat([g for g, _ in fc1])
        out[h + "mlp.up_proj.weight"] = torch.cat([u for _, u in fc1])
        out[h + "mlp.down_proj.weight"] = torch.cat(parts[m + "mlp.linear_fc2.weight"], 1)
        out[h + "input_layernorm.weight"] = parts[m + "input_layernorm.weight"][0]
        out[h + "post_attention_layernorm.weight"] = parts[m + "pre_mlp_layernorm.weight"][0]
    return {n: t.contiguous() for n, t in out.items()}


def replicas_differ(parts: dict) -> list[str]:
    """Replicated parameters (the norms) whose TP copies are not bit for bit equal."""
    import torch

    return [n for n, ps in parts.items() if "layernorm" in n and not all(torch.equal(ps[0], q) for q in ps[1:])]


@contextlib.contextmanager
def no_gathers():
    """Every gather of ``torch.distributed`` (what Megatron's own gathers call) raises inside the block:
    no trainer rank may gather a tensor while it sends."""
    import torch.distributed as dist

    names = ("all_gather", "all_gather_into_tensor", "all_gather_object", "gather", "gather_object")
    saved = {n: getattr(dist, n) for n in names}

    def refuse(*a, **k):
        raise RuntimeError("a gather was called during send_weights")

    for n in names:
        setattr(dist, n, refuse)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)


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


def _trainer(rank: int, args, ports: list[int]) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank, world_size=2)
    model_dir = os.path.join(args.out, "model")
    llm = client = None
    if rank == 0 and not args.no_engine:
        from vllm import LLM
        from vllm.config import WeightTransferConfig
        from vllm.plugins import load_general_plugins

        load_general_plugins()
        from reshard.formats.vllm.trainer import LLMClient

        # started before Megatron's CPU shim is installed in this process (the engine's processes never see it)
        llm = LLM(model=model_dir, load_format="dummy", tensor_parallel_size=2, skip_tokenizer_init=True,
                  dtype="bfloat16", enforce_eager=True, max_model_len=64, max_num_seqs=2,
                  gpu_memory_utilization=0.05, seed=0, weight_transfer_config=WeightTransferConfig(backend="reshard"))
        client = LLMClient(llm)
    dist.barrier()
    sys.path.insert(0, SCRIPTS)
    import _megatron_cpu

    _megatron_cpu.install()
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    model = megatron_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rec: dict = {"rank": rank, "steps": [], "params": {n: list(p.shape) for n, p in model.named_parameters()}}
    out: dict = {"steps": []}
    eng = None
    if not args.no_engine:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.plugins import load_general_plugins

        load_general_plugins()  # registers "reshard" in this process (rank 1 started no engine)
        from reshard.formats.vllm.trainer import ReshardTrainerInitInfo, ShardSource

        source = ShardSource.megatron(model, vocab_size=VOCAB)
        info = ReshardTrainerInitInfo(rank=rank, host="127.0.0.1", port=ports[1], trainer_ranks=2, world_size=4,
                                      timeout_s=args.timeout)
        eng = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
        own = {p.untyped_storage().data_ptr() for p in model.parameters()}
        rec.update(hf_params=len(source.maps), held=len(source.shards),
                   local_numel=sum(t.numel() for t in source.shards.values()),
                   views=all(t.untyped_storage().data_ptr() in own for t in source.shards.values()),
                   whole=sorted(n for n, t in source.shards.items()
                                if t.numel() >= math.prod(source.maps[n].valid_shape)))
        if rank == 0:
            from reader_run import generate

            out["before"] = generate(llm, model_dir)
    g = torch.Generator().manual_seed(100)  # the same batch on both TP ranks
    for step in range(1, args.steps + 1):
        tokens = torch.randint(0, VOCAB, (2, 17), generator=g)
        loss = model(**inputs(tokens[:, :-1]), labels=tokens[:, 1:]).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        srec: dict = {"step": step, "loss": float(loss.detach())}
        if eng is not None:
            t0 = time.perf_counter()
            with no_gathers():
                eng.send_weights()
            srec.update(send_s=time.perf_counter() - t0,
                        sent_bytes={str(q): b for q, b in eng.stats["sent_bytes"].items()})
        parts = gathered(model)  # the oracle only, after the send
        srec["replicas_differ"] = replicas_differ(parts)
        rec["steps"].append(srec)
        if rank == 0:
            hf = to_hf(parts)
            folder = os.path.join(args.out, f"step{step}")
            hf_config().save_pretrained(folder)
            save_file(hf, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
            if llm is not None:
                from live_probe import engine_stats
                from probe import kept
                from reader_run import generate

                out["steps"].append({"step": step, "outputs": generate(llm, model_dir), "kept": llm.apply_model(kept),
                                     "workers": llm.collective_rpc(engine_stats)})
    # Megatron's own forward against transformers' Qwen2 on the hand-converted folder (float32)
    tokens = torch.tensor([[1, 17, 42, 99, 7, 3, 64, 119]])
    with torch.no_grad():
        local = model(**inputs(tokens))
    logits = [torch.empty_like(local) for _ in range(2)]
    dist.all_gather(logits, local.contiguous())
    if rank == 0:
        from transformers import Qwen2ForCausalLM

        hf_model = Qwen2ForCausalLM.from_pretrained(os.path.join(args.out, f"step{args.steps}"), dtype=torch.float32)
        with torch.no_grad():
            ref = hf_model(input_ids=tokens).logits
        meg = torch.cat(logits, -1)[..., :VOCAB]
        out["forward"] = {"max_abs_diff": float((meg - ref).abs().max()), "scale": float(ref.abs().max()),
                          "argmax_equal": bool(torch.equal(meg.argmax(-1), ref.argmax(-1)))}
        with open(os.path.join(args.out, "megatron.json"), "w") as f:
            json.dump(out, f)
    with open(os.path.join(args.out, f"trainer{rank}.json"), "w") as f:
        json.dump(rec, f)
    dist.barrier()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=60.0, help="the transfer group's")
    ap.add_argument("--no-engine", action="store_true", help="Megatron and the oracle only (no vLLM)")
    args = ap.parse_args()
    if os.getpgid(0) != os.getpid():
        os.setsid()  # a process group of its own, ended with it (live_run._end_group)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1" if (os.cpu_count() or 1) > 1 else "0|0")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc pickles functions
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, HERE)
    os.makedirs(os.path.join(args.out, "model"), exist_ok=True)
    hf_config().save_pretrained(os.path.join(args.out, "model"))
    import torch.multiprocessing as mp
    from live_run import _end_group

    from reshard.execute.group import free_port

    try:
        mp.start_processes(trainer, args=(args, [free_port(), free_port()]), nprocs=2, start_method="spawn")
    finally:
        _end_group()


if __name__ == "__main__":
    main()
