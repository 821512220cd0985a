#!/usr/bin/env python
"""Build the real Megatron-Core checkpoint fixtures under ``tests/fixtures/megatron/``.

Each fixture is a tiny Megatron ``GPTModel`` (Llama-like: RMSNorm, SwiGLU, RoPE, GQA, untied
embeddings, no biases) trained for 3 steps with Adam by Megatron-LM's own ``train_step`` on CPU
(``gloo``) and saved by Megatron-LM's own ``save_checkpoint`` -- both from the
``megatron.training`` package that ships in the megatron-core 0.19.2 wheel -- then reloaded by
Megatron itself at TP=1, PP=1 (``scripts/megatron_oracle.py``) to give the oracle data.

It runs in a separate venv, never reshard's own (megatron-core is no dependency of reshard)::

    /work/venvs/megatron/bin/python scripts/make_megatron_fixtures.py            # all fixtures
    /work/venvs/megatron/bin/python scripts/make_megatron_fixtures.py --only torch_dist_tp2_pp2
    /work/venvs/megatron/bin/python scripts/make_megatron_fixtures.py --list
    python scripts/make_megatron_fixtures.py --venv-help    # how to make that venv

``--venv DIR`` (or ``$MEGATRON_VENV``) names the venv whose ``torchrun`` runs the jobs (default
``/work/venvs/megatron``); this script itself needs only the standard library plus, for the
checks it runs on what was written, that venv's torch and safetensors (so run it with that
venv's python).

A fixture folder holds the ``--save`` folder exactly as Megatron wrote it
(``latest_checkpointed_iteration.txt`` and ``iter_0000003/``), a ``fixture.json`` (the recipe:
Megatron-LM command line, topology, model and optimizer settings, seeds, per-rank losses, the
pickled globals of every pickle, the size and sha256 of every file) and ``oracle/`` (Megatron's
own TP=1/PP=1 reload: weights, Adam moments, forward logits; see ``megatron_oracle.py``).

Jobs run in ``/tmp/reshard-megatron-fixtures/<name>/`` (a fixed path, since the saved ``args``
record ``--save``); a fixture is swapped into place only when the job, the oracle reloads and
the checks all succeeded, so a failure leaves the existing fixture alone.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import os
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ds_launch import job_env, root_cause, run_job  # noqa: E402
from make_fixtures import pickle_bytes_globals  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts"
WORKER = SCRIPTS / "_fixture_megatron.py"
ORACLE = SCRIPTS / "megatron_oracle.py"
DEFAULT_OUT = REPO / "tests" / "fixtures" / "megatron"
DEFAULT_VENV = os.environ.get("MEGATRON_VENV", "/work/venvs/megatron")
WORK_ROOT = Path("/tmp/reshard-megatron-fixtures")
STEPS = 3
EXPERT_BIAS_SEED = 2025  # _fixture_megatron.set_expert_bias
LAUNCH_TIMEOUT_S = 600

VENV_HELP = """\
The Megatron venv (CPU only; megatron-core 0.19.2 declares Python >= 3.12, but its cp311 wheel
runs on 3.11 with the typing.override shim in scripts/_megatron_cpu.py):

    python3.11 -m venv /work/venvs/megatron
    /work/venvs/megatron/bin/pip install torch==2.13.0      # FIRST, the CPU build (local wheel here;
        # elsewhere: --index-url https://download.pytorch.org/whl/cpu); an unpinned torch pulls CUDA
    /work/venvs/megatron/bin/pip download --no-deps --ignore-requires-python megatron-core==0.19.2 -d /tmp/mc
    /work/venvs/megatron/bin/pip install --no-deps --ignore-requires-python /tmp/mc/megatron_core-0.19.2-*.whl
    /work/venvs/megatron/bin/pip install numpy packaging einops psutil safetensors transformers==5.24.0

No Transformer Engine, apex, triton, tensorstore or zarr is needed. Then:

    /work/venvs/megatron/bin/python scripts/make_megatron_fixtures.py [--only NAME]
"""

# --------------------------------------------------------------------------------------------
# The model and the training recipe (Megatron-LM command-line flags)
# --------------------------------------------------------------------------------------------

# Pairwise distinct sizes, so a swapped or transposed axis cannot go unnoticed: hidden 24,
# head dim (kv_channels) 10, q rows 4*10 = 40, QKV rows (4 + 2*2)*10 = 80, ffn 36 (fc1 rows 72),
# vocab 120 padded to 128 (make_vocab_size_divisible_by 64 -> a multiple of 64*TP).
MODEL_ARGV = [
    "--hidden-size", "24", "--num-attention-heads", "4", "--kv-channels", "10",
    "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "36",
    "--seq-length", "16", "--max-position-embeddings", "16",
    "--swiglu", "--normalization", "RMSNorm", "--norm-epsilon", "1e-5", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope", "--rotary-base", "10000",
    "--attention-dropout", "0", "--hidden-dropout", "0",
    "--vocab-size", "120", "--tokenizer-type", "NullTokenizer", "--make-vocab-size-divisible-by", "64",
    "--init-method-std", "0.02",
]
TRAIN_ARGV = [
    "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", str(STEPS),
    "--optimizer", "adam", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
    "--lr-warmup-iters", "1", "--weight-decay", "0.01", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
    "--adam-eps", "1e-8", "--clip-grad", "1.0", "--seed", "1234",
    "--save-interval", str(STEPS),
]
# What running Megatron-LM on CPU takes (see _megatron_cpu.py / _megatron_common.py).
CPU_ARGV = [
    "--transformer-impl", "local", "--use-cpu-initialization", "--distributed-backend", "gloo",
    "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion",
    "--no-rope-fusion", "--no-bias-dropout-fusion", "--no-persist-layer-norm",
]


@dataclass
class Fixture:
    name: str
    description: str
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    etp: int | None = None  # expert TP (--expert-tensor-parallel-size); None: TP
    layers: int = 2
    ckpt_format: str = "torch_dist"
    distopt: bool = False
    fully_reshardable: bool = False
    moe: bool = False
    save_optim: bool = True  # False: --no-save-optim (the oracle then reloads the model only)
    # after training, before save_checkpoint: every router's expert_bias buffer set to N(0, this^2)
    # (seeded per layer), so a converter that drops or zeroes it changes the routing (None: as trained)
    expert_bias_std: float | None = None
    extra_argv: list[str] = field(default_factory=list)
    model_argv: list[str] = field(default_factory=lambda: MODEL_ARGV)
    # (tp, pp, dp, ep) reloads compared against the TP=1/PP=1 oracle (Megatron's own resharding)
    cross_checks: list[tuple[int, int, int, int]] = field(default_factory=list)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def argv(self, save: Path) -> list[str]:
        a = ["--num-layers", str(self.layers),
             "--tensor-model-parallel-size", str(self.tp), "--pipeline-model-parallel-size", str(self.pp),
             *self.model_argv, *TRAIN_ARGV, *CPU_ARGV,
             "--save", str(save), "--ckpt-format", self.ckpt_format]
        if self.ep > 1 or self.moe:
            a += ["--expert-model-parallel-size", str(self.ep)]
        if self.etp is not None:
            a += ["--expert-tensor-parallel-size", str(self.etp)]
        if self.distopt:
            a.append("--use-distributed-optimizer")
        if self.fully_reshardable:
            a.append("--dist-ckpt-optim-fully-reshardable")
        if not self.save_optim:
            a.append("--no-save-optim")
        return a + self.extra_argv

    def optimizer_loads_at_tp1(self) -> bool:
        """Megatron refuses a TP/PP change for a dp_reshardable distributed optimizer, and any
        topology change for a legacy checkpoint; with experts, EP=2 -> EP=1 changes the
        optimizer's param groups (and the chained optimizer), so it cannot load those either."""
        if self.ep > 1:
            return False
        if self.ckpt_format == "torch":
            return self.tp == 1 and self.pp == 1
        if self.distopt and not self.fully_reshardable:
            return self.tp == 1 and self.pp == 1 and self.ep == 1
        return True

    def optimizer_reload_topology(self) -> tuple[int, int, int, int]:
        """Where the optimizer is reloaded when not at TP=1/PP=1: the saved TP, PP and EP (and
        expert TP) with the smallest DP whose TP x DP holds expert TP x EP."""
        fold = (self.etp or self.tp) * self.ep
        return (self.tp, self.pp, fold // math.gcd(self.tp, fold), self.ep)

    def model_reload_topology(self) -> tuple[int, int, int, int]:
        """Where the oracle reloads the model: TP=1/PP=1, except for legacy checkpoints (Megatron
        reads those only at the topology that wrote them)."""
        if self.ckpt_format == "torch":  # with EP the saved DP and EP too (files per EP rank)
            return (self.tp, self.pp, self.dp, self.ep) if self.ep > 1 else (self.tp, self.pp, 1, 1)
        return (1, 1, 1, 1)


MOE_ARGV = ["--num-experts", "4", "--moe-ffn-hidden-size", "16", "--moe-router-topk", "2",
            "--moe-token-dispatcher-type", "alltoall", "--moe-router-load-balancing-type", "aux_loss",
            "--moe-aux-loss-coeff", "1e-2"]

SHARED_MOE_ARGV = ["--num-experts", "4", "--moe-ffn-hidden-size", "16", "--moe-router-topk", "2",
                   "--moe-token-dispatcher-type", "allgather", "--moe-router-load-balancing-type", "none",
                   "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                   "--moe-shared-expert-intermediate-size", "28", "--moe-shared-expert-gate",
                   "--moe-layer-freq", "[0,1,1]", "--sequence-parallel"]

# Multi-latent attention (DeepSeek-V3's attention, MLATransformerConfig): no GQA; q down 24 -> 12
# (q_lora_rank), kv down 24 -> 14 + 4 (kv_lora_rank + the key's rope part), q up 12 -> 4 x (6 + 4)
# rows, kv up 14 -> 4 x (6 + 5) rows, out 4 x 5 -> 24; RMSNorm q / kv latent norms
# (--qk-layernorm); plain RoPE (--rope-type rope; MLA's default is YaRN), MLA's own interleaved
# rope part. --kv-channels = v head dim (the local core attention's output reshape uses it).
# eps 1e-6: transformers' DeepseekV3 builds its latent norms with a fixed 1e-6.
MLA_MODEL_ARGV = [a for a in MODEL_ARGV if a not in ("--group-query-attention",)]
for _flag, _value in (("--num-query-groups", None), ("--kv-channels", "5"), ("--norm-epsilon", "1e-6")):
    _i = MLA_MODEL_ARGV.index(_flag)
    MLA_MODEL_ARGV[_i:_i + 2] = [] if _value is None else [_flag, _value]
MLA_MODEL_ARGV += ["--multi-latent-attention", "--q-lora-rank", "12", "--kv-lora-rank", "14", "--qk-head-dim", "6",
                   "--qk-pos-emb-head-dim", "4", "--v-head-dim", "5", "--rope-type", "rope", "--qk-layernorm"]
# Tied embeddings (the output layer reuses the word embeddings; over several stages the last one
# keeps a copy as output_layer.weight, which Megatron all-reduces with the first stage's).
TIED_MODEL_ARGV = [a for a in MODEL_ARGV if a != "--untie-embeddings-and-output-weights"]
# Several DDP buckets per buffer: Megatron buckets only with --overlap-grad-reduce; 3000 elements
# cut the 17208 parameters of the 2-layer model into buckets of one to four parameters.
BUCKETS_ARGV = ["--overlap-grad-reduce", "--ddp-bucket-size", "3000"]
# Qwen2 shaped for a real vLLM (its CPU attention wants head_dim 64; its Qwen2 takes head_dim as
# hidden / heads): hidden 256 = 4 query heads of 64, 2 query groups (GQA, one per TP rank), q/k/v
# biases, ffn 64, max positions 128 (vLLM's tests serve 64 tokens); bf16 and no optimizer state
# (--no-save-optim), one layer, so that the folder with its oracle stays near 1.3 MB.
QWEN2_VLLM_ARGV = list(MODEL_ARGV)
for _flag, _value in (("--hidden-size", "256"), ("--kv-channels", "64"), ("--ffn-hidden-size", "64"),
                      ("--max-position-embeddings", "128")):
    QWEN2_VLLM_ARGV[QWEN2_VLLM_ARGV.index(_flag) + 1] = _value
QWEN2_VLLM_ARGV += ["--add-qkv-bias"]
# the same at hidden 128 (2 query heads of 64 in 2 groups: vLLM's head_dim is hidden / heads, and
# Megatron wants the groups divisible by TP), so two layers over 2 pipeline stages stay small
QWEN2_VLLM_PP_ARGV = list(QWEN2_VLLM_ARGV)
for _flag, _value in (("--hidden-size", "128"), ("--num-attention-heads", "2")):
    QWEN2_VLLM_PP_ARGV[QWEN2_VLLM_PP_ARGV.index(_flag) + 1] = _value

# DeepSeek-V3 shaped MoE: 8 experts in 2 groups (group-limited routing: the best group by the sum of
# its top-2 biased scores, then the top-2 experts in it), a sigmoid router with an expert bias,
# routing weights renormalised and scaled by 2.5 (routed_scaling_factor), a shared expert twice the
# expert's width (n_shared_experts 2) with no gate, layer 0 dense (first_k_dense_replace 1). Two
# layers: each expert is a record of its own, a third layer took the folder to 1.6 MB.
DEEPSEEK_V3_MOE_ARGV = ["--num-experts", "8", "--moe-ffn-hidden-size", "8", "--moe-router-topk", "2",
                        "--moe-token-dispatcher-type", "allgather", "--moe-router-load-balancing-type", "none",
                        "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                        "--moe-router-num-groups", "2", "--moe-router-group-topk", "1",
                        "--moe-router-topk-scaling-factor", "2.5", "--moe-shared-expert-intermediate-size", "16",
                        "--moe-layer-freq", "[0,1]", "--sequence-parallel"]
# DeepSeek-V3 shaped with one multi-token-prediction layer (--mtp-num-layers 1): get_gpt_mtp_block_spec gives
# the MTP layer the decoder block's last layer spec, so it is an MLA + MoE layer (router, expert bias, experts,
# shared expert) between enorm / hnorm / eh_proj and its final norm. 4 experts in 2 groups (not 8: each expert
# is a record of its own, and the MTP layer is a second MoE layer; 8 took the folder past 1.5 MB).
DEEPSEEK_V3_MTP_ARGV = ["--num-experts", "4", *DEEPSEEK_V3_MOE_ARGV[2:], "--mtp-num-layers", "1"]
# Qwen-MoE shaped: a softmax router (as transformers' Qwen2-MoE / Qwen3-MoE compute), a dense layer 0
QWEN_MOE_ARGV = ["--num-experts", "4", "--moe-ffn-hidden-size", "16", "--moe-router-topk", "2",
                 "--moe-token-dispatcher-type", "allgather", "--moe-router-load-balancing-type", "none",
                 "--moe-layer-freq", "[0,1]"]

FIXTURES = {f.name: f for f in [
    Fixture("torch_dist_tp2_pp2", "TP=2 x PP=2, DP=1; plain (non-distributed) Adam; torch_dist",
            tp=2, pp=2, layers=4, cross_checks=[(2, 1, 1, 1), (1, 2, 1, 1), (2, 2, 1, 1)]),
    Fixture("torch_dist_tp2_dp2_distopt", "TP=2 x DP=2; distributed optimizer, dp_reshardable (default); torch_dist",
            tp=2, dp=2, distopt=True, cross_checks=[(2, 1, 2, 1)]),
    Fixture("torch_dist_pp2_dp2_distopt", "PP=2 x DP=2; distributed optimizer, dp_reshardable; torch_dist",
            pp=2, dp=2, distopt=True, cross_checks=[(1, 2, 2, 1)]),
    Fixture("torch_dist_dp2_fully_reshardable",
            "DP=2; distributed optimizer with --dist-ckpt-optim-fully-reshardable; torch_dist",
            dp=2, distopt=True, fully_reshardable=True, cross_checks=[(2, 1, 1, 1)]),
    Fixture("torch_dist_dp2_distopt_bf16",
            "DP=2; --bf16 with fp32 grad accumulation; distributed optimizer, dp_reshardable "
            "(bucket 'param' = the fp32 main parameters); torch_dist",
            dp=2, distopt=True, extra_argv=["--bf16", "--accumulate-allreduce-grads-in-fp32"]),
    Fixture("legacy_tp2_pp2", "TP=2 x PP=2, DP=1; plain Adam; legacy --ckpt-format torch",
            tp=2, pp=2, layers=4, ckpt_format="torch"),
    Fixture("legacy_dp2_distopt", "DP=2; distributed optimizer; legacy --ckpt-format torch (distrib_optim.pt)",
            dp=2, distopt=True, ckpt_format="torch"),
    Fixture("torch_dist_moe_ep2", "MoE (4 experts, top-2, SequentialMLP), EP=2 x DP=2 (world 2); plain Adam; torch_dist",
            dp=2, ep=2, moe=True, extra_argv=MOE_ARGV, cross_checks=[(1, 1, 2, 2)]),
    Fixture("torch_dist_moe_ep2_distopt",
            "MoE (4 experts, top-2, SequentialMLP), EP=2 x DP=2 (world 2); distributed optimizer; torch_dist",
            dp=2, ep=2, moe=True, distopt=True, extra_argv=MOE_ARGV),
    Fixture("torch_dist_pp2_vpp2",
            "PP=2 x virtual PP=2 (--num-layers-per-virtual-pipeline-stage 1: stage 0 holds layers 0 and 2, "
            "stage 1 layers 1 and 3; interleaved schedule); plain Adam; torch_dist",
            pp=2, layers=4, extra_argv=["--num-layers-per-virtual-pipeline-stage", "1"],
            cross_checks=[(1, 2, 1, 1), (2, 1, 1, 1)]),
    Fixture("torch_dist_pp2_vpp2_distopt",
            "PP=2 x virtual PP=2 as torch_dist_pp2_vpp2; distributed optimizer, dp_reshardable (a DDP buffer "
            "per model chunk: gbuf_idx_0, gbuf_idx_1); torch_dist",
            pp=2, layers=4, distopt=True, extra_argv=["--num-layers-per-virtual-pipeline-stage", "1"]),
    Fixture("legacy_pp2_vpp2",
            "PP=2 x virtual PP=2 as torch_dist_pp2_vpp2; plain Adam; legacy --ckpt-format torch (model0, model1 "
            "per file)", pp=2, layers=4, ckpt_format="torch", extra_argv=["--num-layers-per-virtual-pipeline-stage", "1"]),
    Fixture("torch_dist_pp2_uneven",
            "PP=2, uneven (--decoder-first-pipeline-num-layers 1: stage 0 holds layer 0, stage 1 layers 1 "
            "and 2); plain Adam; torch_dist",
            pp=2, layers=3, extra_argv=["--decoder-first-pipeline-num-layers", "1"],
            cross_checks=[(1, 2, 1, 1), (1, 3, 1, 1)]),
    Fixture("torch_dist_moe_tp2_ep2_shared_distopt",
            "MoE, TP=2 x EP=2 on 2 processes (MoE parallel folding: expert TP 1, --sequence-parallel), layer 0 "
            "dense and layers 1-2 MoE (--moe-layer-freq [0,1,1]: per-layer keys), 4 experts top-2 (SequentialMLP, "
            "allgather dispatcher), a shared expert (ffn 28) with its sigmoid gate, a sigmoid router with an "
            "expert bias; distributed optimizer, dp_reshardable; torch_dist",
            tp=2, ep=2, etp=1, layers=3, moe=True, distopt=True, extra_argv=SHARED_MOE_ARGV),
    Fixture("torch_dist_moe_ep2_shared_bf16",
            "MoE, EP=2 x DP=2 (world 2), every layer MoE (stacked keys), a shared expert (ffn 28) with its gate, a "
            "sigmoid router with an fp32 expert bias; --bf16 with fp32 grad accumulation; distributed optimizer, "
            "dp_reshardable; torch_dist",
            dp=2, ep=2, moe=True, distopt=True,
            extra_argv=[a for a in SHARED_MOE_ARGV if a not in ("--moe-layer-freq", "[0,1,1]", "--sequence-parallel")]
            + ["--bf16", "--accumulate-allreduce-grads-in-fp32"]),
    Fixture("torch_dist_dp2_distopt_buckets",
            "DP=2; distributed optimizer, dp_reshardable, several DDP buckets (--overlap-grad-reduce "
            "--ddp-bucket-size 3000: bucket_idx_0..N per buffer); torch_dist",
            dp=2, distopt=True, extra_argv=BUCKETS_ARGV, cross_checks=[(1, 1, 2, 1)]),
    Fixture("legacy_dp2_distopt_buckets",
            "DP=2; distributed optimizer with several DDP buckets as torch_dist_dp2_distopt_buckets; legacy "
            "--ckpt-format torch (distrib_optim.pt: the buckets' unpadded parts back to back)",
            dp=2, distopt=True, ckpt_format="torch", extra_argv=BUCKETS_ARGV),
    Fixture("torch_dist_moe_ep2_grouped_gemm_local",
            "MoE as torch_dist_moe_ep2_distopt with --moe-grouped-gemm under --transformer-impl local: Megatron "
            "0.19.2's LocalSpecProvider builds SequentialMLP whatever the flag (args.moe_grouped_gemm = True); "
            "distributed optimizer, dp_reshardable; torch_dist",
            dp=2, ep=2, moe=True, distopt=True, extra_argv=MOE_ARGV + ["--moe-grouped-gemm"]),
    Fixture("torch_dist_mtp1",
            "TP=1, DP=1; one multi-token-prediction layer (--mtp-num-layers 1: mtp.layers.0.{enorm,hnorm,eh_proj,"
            "transformer_layer.*,final_layernorm}); plain Adam; torch_dist",
            extra_argv=["--mtp-num-layers", "1"]),
    Fixture("torch_dist_pp2_vpp2_mtp1",
            "PP=2 x virtual PP=2 as torch_dist_pp2_vpp2 (stage 0 holds layers 0 and 2, stage 1 layers 1 and 3) with "
            "one multi-token-prediction layer (--mtp-num-layers 1: on the last stage's last model chunk, beside "
            "layer 3, the final norm and the output layer); plain Adam; torch_dist",
            pp=2, layers=4, extra_argv=["--num-layers-per-virtual-pipeline-stage", "1", "--mtp-num-layers", "1"],
            cross_checks=[(1, 2, 1, 1)]),
    Fixture("legacy_tp2_pp2_mtp1",
            "TP=2 x PP=2, DP=1 with one multi-token-prediction layer (--mtp-num-layers 1, on the last stage: "
            "mp_rank_TT_001's model); plain Adam; legacy --ckpt-format torch",
            tp=2, pp=2, layers=2, ckpt_format="torch", extra_argv=["--mtp-num-layers", "1"]),
    Fixture("torch_dist_mtp2",
            "TP=1, DP=1; two multi-token-prediction layers (--mtp-num-layers 2: mtp.layers.{0,1}.{enorm,hnorm,eh_proj,"
            "mtp_model_layer.*,final_layernorm}, each its own layer); plain Adam; torch_dist",
            extra_argv=["--mtp-num-layers", "2"]),
    Fixture("torch_dist_mtp2_repeated",
            "TP=1, DP=1; two multi-token-prediction depths through one repeated layer (--mtp-num-layers 2 "
            "--mtp-use-repeated-layer: mtp.layers.0 only, used at both depths); plain Adam; torch_dist",
            extra_argv=["--mtp-num-layers", "2", "--mtp-use-repeated-layer"]),
    Fixture("legacy_pp2_dp2_mtp1_distopt",
            "PP=2 x DP=2 with one multi-token-prediction layer (--mtp-num-layers 1, on the last stage, whose model "
            "and distrib_optim.pt also hold the embedding copy); distributed optimizer; legacy --ckpt-format torch",
            pp=2, dp=2, distopt=True, ckpt_format="torch", extra_argv=["--mtp-num-layers", "1"]),
    Fixture("torch_dist_pp2_dp2_mtp1_distopt",
            "PP=2 x DP=2 with one multi-token-prediction layer (--mtp-num-layers 1, on the last stage, whose DDP buffer "
            "also holds the embedding copy, first registered, in a bucket of its own); distributed optimizer, "
            "dp_reshardable; torch_dist",
            pp=2, dp=2, distopt=True, extra_argv=["--mtp-num-layers", "1"], cross_checks=[(1, 2, 2, 1)]),
    Fixture("torch_dist_pp2_dp2_tied_distopt",
            "PP=2 x DP=2 with tied embeddings (no --untie-embeddings-and-output-weights: the last stage keeps "
            "output_layer.weight, a copy of the word embeddings, in a bucket of its own); distributed optimizer, "
            "dp_reshardable; torch_dist",
            pp=2, dp=2, distopt=True, model_argv=TIED_MODEL_ARGV, cross_checks=[(1, 2, 2, 1)]),
    Fixture("legacy_pp2_dp2_tied_distopt",
            "PP=2 x DP=2 with tied embeddings as torch_dist_pp2_dp2_tied_distopt (the last stage's model and "
            "distrib_optim.pt hold output_layer.weight, the embedding copy); distributed optimizer; legacy "
            "--ckpt-format torch",
            pp=2, dp=2, distopt=True, ckpt_format="torch", model_argv=TIED_MODEL_ARGV),
    Fixture("torch_dist_tp2_qk_layernorm",
            "TP=2, DP=1; --qk-layernorm (RMSNorm q_layernorm / k_layernorm over the head dim, replicated over "
            "TP); plain Adam; torch_dist", tp=2, extra_argv=["--qk-layernorm"]),
    Fixture("torch_dist_tp2_mla",
            "TP=2, DP=1; multi-latent attention (q_lora_rank 12, kv_lora_rank 14, qk head 6 + rope 4, v head 5; "
            "RMSNorm q / kv latent norms; local spec: down projections column-parallel, their norms separate "
            "and replicated); plain Adam; torch_dist", tp=2, model_argv=MLA_MODEL_ARGV,
            cross_checks=[(2, 1, 1, 1)]),
    Fixture("torch_dist_tp2_dp2_mla_distopt",
            "TP=2 x DP=2; multi-latent attention as torch_dist_tp2_mla; distributed optimizer, dp_reshardable "
            "(the MLA linears and latent norms in the bucket's registration order); torch_dist",
            tp=2, dp=2, distopt=True, model_argv=MLA_MODEL_ARGV),
    Fixture("torch_dist_tp2_mla_q_proj",
            "TP=2, DP=1; multi-latent attention without q_lora_rank (one column-parallel linear_q_proj) and "
            "without latent norms (no --qk-layernorm); plain Adam; torch_dist", tp=2,
            model_argv=[a for i, a in enumerate(MLA_MODEL_ARGV) if a not in ("--q-lora-rank", "--qk-layernorm")
                        and MLA_MODEL_ARGV[i - 1] != "--q-lora-rank"]),
    Fixture("legacy_tp2_mla", "TP=2, DP=1; multi-latent attention as torch_dist_tp2_mla; plain Adam; legacy "
            "--ckpt-format torch", tp=2, ckpt_format="torch", model_argv=MLA_MODEL_ARGV),
    Fixture("torch_dist_mla_moe_tp2_ep2",
            "DeepSeek-V3 shaped: multi-latent attention as torch_dist_tp2_mla and MoE as "
            "torch_dist_moe_tp2_ep2_shared_distopt (TP=2 x EP=2 on 2 processes, expert TP 1, layer 0 dense, "
            "layers 1-2 MoE, 4 experts top-2, a shared expert with its gate, a sigmoid router with an expert "
            "bias); plain Adam; torch_dist",
            tp=2, ep=2, etp=1, layers=3, moe=True, model_argv=MLA_MODEL_ARGV, extra_argv=SHARED_MOE_ARGV),
    Fixture("torch_dist_deepseek_v3_tp2_ep2",
            "DeepSeek-V3 shaped MoE: multi-latent attention as torch_dist_tp2_mla, TP=2 x EP=2 on 2 processes "
            "(expert TP 1, --sequence-parallel), layer 0 dense and layer 1 MoE, 8 experts top-2 in 2 groups "
            "(group-limited routing, 1 group per token), sigmoid router with an expert bias (set to N(0, 0.05^2) "
            "before the save), routing weights scaled by 2.5, a shared expert (ffn 16 = 2 x 8) without a gate; "
            "plain Adam; torch_dist",
            tp=2, ep=2, etp=1, layers=2, moe=True, expert_bias_std=0.05, model_argv=MLA_MODEL_ARGV,
            extra_argv=DEEPSEEK_V3_MOE_ARGV),
    Fixture("torch_dist_deepseek_v3_mtp_tp2_ep2",
            "DeepSeek-V3 shaped MoE with one multi-token-prediction layer: multi-latent attention as torch_dist_tp2_mla, "
            "TP=2 x EP=2 on 2 processes (expert TP 1, --sequence-parallel), layer 0 dense and layer 1 MoE, 4 experts "
            "top-2 in 2 groups (1 group per token), sigmoid router with an expert bias (set to N(0, 0.05^2) before "
            "the save, the MTP layer's router too), routing weights scaled by 2.5, a shared expert (ffn 16) without a "
            "gate; --mtp-num-layers 1 (mtp.layers.0: enorm, hnorm, eh_proj, an MLA + MoE transformer_layer -- the "
            "decoder's last layer spec -- and final_layernorm); plain Adam; torch_dist",
            tp=2, ep=2, etp=1, layers=2, moe=True, expert_bias_std=0.05, model_argv=MLA_MODEL_ARGV,
            extra_argv=DEEPSEEK_V3_MTP_ARGV, cross_checks=[(1, 2, 2, 2)]),
    Fixture("torch_dist_moe_tp2_ep2_qk_layernorm",
            "Qwen3-MoE shaped: --qk-layernorm with MoE, TP=2 x EP=2 on 2 processes (MoE parallel folding: expert "
            "TP 1, --sequence-parallel), layer 0 dense and layer 1 MoE (--moe-layer-freq [0,1]: per-layer keys), "
            "4 experts top-2 (SequentialMLP, allgather), softmax router (top-k then softmax: norm_topk_prob); "
            "plain Adam; torch_dist",
            tp=2, ep=2, etp=1, moe=True, extra_argv=QWEN_MOE_ARGV + ["--sequence-parallel", "--qk-layernorm"]),
    Fixture("legacy_moe_tp2_ep2_shared",
            "MoE as torch_dist_moe_tp2_ep2_shared_distopt (TP=2 x EP=2 on 2 processes, MoE parallel folding: expert "
            "TP 1; layer 0 dense, layers 1-2 MoE; 4 experts top-2, a shared expert with its gate, a sigmoid router "
            "with an expert bias); plain Adam (a chained optimizer: [dense, experts] per file); legacy --ckpt-format "
            "torch (mp_rank_TT_EEE: the files of global ranks 0 and 1, mp_rank_00_000 and mp_rank_01_001)",
            tp=2, ep=2, etp=1, layers=3, moe=True, ckpt_format="torch", extra_argv=SHARED_MOE_ARGV),
    Fixture("legacy_moe_tp2_ep2_shared_distopt",
            "MoE as legacy_moe_tp2_ep2_shared; distributed optimizer: distrib_optim.pt per file is the chained "
            "optimizer's [dense, experts] buffers, each gathered to its own DP group's rank 0; legacy --ckpt-format "
            "torch", tp=2, ep=2, etp=1, layers=3, moe=True, distopt=True, ckpt_format="torch",
            extra_argv=SHARED_MOE_ARGV),
    Fixture("legacy_moe_tp2_dp2_ep2",
            "MoE, TP=2 x DP=2 x EP=2 with expert TP = TP (world 4, no folding: EP carved out of DP), layer 0 dense "
            "and layer 1 MoE (--moe-layer-freq [0,1]), 4 experts top-2 (SequentialMLP, allgather), softmax router; "
            "plain Adam (chained [dense, experts]); legacy --ckpt-format torch: every rank saves (DP rank 0 or "
            "expert-DP rank 0), mp_rank_{00,01}_{000,001}, the dense TP parts twice",
            tp=2, dp=2, ep=2, etp=2, moe=True, ckpt_format="torch", extra_argv=QWEN_MOE_ARGV + ["--sequence-parallel"]),
    Fixture("torch_dist_moe_ep2_shared_softmax",
            "Qwen2-MoE shaped: q/k/v biases, EP=2 x DP=2 (world 2), layer 0 dense and layer 1 MoE (--moe-layer-freq "
            "[0,1]), 4 experts top-2, softmax router with --moe-router-pre-softmax (softmax, top-k, not "
            "renormalised), a shared expert (ffn 28) with its sigmoid gate; plain Adam; torch_dist",
            dp=2, ep=2, moe=True, extra_argv=QWEN_MOE_ARGV + [
                "--add-qkv-bias", "--moe-router-pre-softmax", "--moe-shared-expert-intermediate-size", "28",
                "--moe-shared-expert-gate"]),
    Fixture("torch_dist_tp2_qwen2_vllm",
            "Qwen2 shaped for vLLM (tests_vllm): hidden 256, 4 query heads of 64 in 2 groups (GQA), q/k/v biases, "
            "ffn 64, vocabulary 120 (padded to 128), one layer, untied; TP=2, DP=1; --bf16, plain Adam, "
            "--no-save-optim (weights only); torch_dist",
            tp=2, layers=1, save_optim=False, model_argv=QWEN2_VLLM_ARGV,
            extra_argv=["--bf16", "--accumulate-allreduce-grads-in-fp32"]),
    Fixture("torch_dist_tp2_pp2_qwen2_vllm",
            "Qwen2 shaped for vLLM over pipeline stages (tests_vllm): hidden 128, 2 query heads of 64 in 2 groups, "
            "q/k/v biases, ffn 64, vocabulary 120 (padded to 128), two layers, untied; TP=2 x PP=2, DP=1; --bf16, "
            "plain Adam, --no-save-optim (weights only); torch_dist",
            tp=2, pp=2, layers=2, save_optim=False, model_argv=QWEN2_VLLM_PP_ARGV,
            extra_argv=["--bf16", "--accumulate-allreduce-grads-in-fp32"]),
]}

# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------


def _torchrun(venv: Path) -> Path:
    return venv / "bin" / "torchrun"


def _env() -> dict[str, str]:
    env = job_env(SCRIPTS)
    env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # validate_args wants it with TP > 1 (pre-Blackwell)
    return env


def _run(cmd: list[str], log: Path, what: str) -> float:
    t0 = time.monotonic()
    rc = run_job(cmd, cwd=REPO, env=_env(), log_path=log, timeout_s=LAUNCH_TIMEOUT_S)
    if rc != 0:
        lines = log.read_text(errors="replace").splitlines()
        raise RuntimeError(f"{what} failed (exit {rc}): {root_cause(lines)}; log: {log}")
    return time.monotonic() - t0


def _oracle(venv: Path, ckpt: Path, out: Path, topo, *, no_optim: bool, forward: bool, log: Path,
            etp: int | None = None) -> float:
    tp, pp, dp, ep = topo
    cmd = [str(venv / "bin" / "python"), str(ORACLE), str(ckpt), "--out", str(out), "--venv", str(venv),
           "--tp", str(tp), "--pp", str(pp), "--dp", str(dp), "--ep", str(ep)]
    if etp is not None:
        cmd += ["--etp", str(etp)]
    if no_optim:
        cmd.append("--no-optim")
    if forward:
        cmd.append("--forward")
    return _run(cmd, log, f"oracle reload at tp{tp} pp{pp} dp{dp} ep{ep}")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _zip_pickle_globals(data: bytes) -> list[str]:
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        (pkl,) = [n for n in zf.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
        return pickle_bytes_globals(zf.read(pkl))


def pickle_report(iter_dir: Path) -> dict:
    """The globals of every pickle in a checkpoint (read with pickletools; nothing is loaded)."""
    report: dict[str, list[str]] = {}
    meta = iter_dir / ".metadata"
    if meta.exists():
        import pickle  # noqa: F401  (the .metadata pickle itself is loaded with torch's classes)

        from torch.distributed.checkpoint import FileSystemReader

        report[".metadata"] = pickle_bytes_globals(meta.read_bytes())
        md = FileSystemReader(str(iter_dir)).read_metadata()
        for idx, info in md.storage_data.items():
            if idx.offset is not None:
                continue  # tensor records: torch.save archives of one tensor
            with open(iter_dir / info.relative_path, "rb") as f:
                f.seek(info.offset)
                record = f.read(info.length)
            base = idx.fqn.split("/")[0]
            report.setdefault(base, [])
            report[base] = sorted(set(report[base]) | set(_zip_pickle_globals(record)))
        tensor_globals: set[str] = set()
        for idx, info in list(md.storage_data.items()):
            if idx.offset is None:
                continue
            with open(iter_dir / info.relative_path, "rb") as f:
                f.seek(info.offset)
                tensor_globals |= set(_zip_pickle_globals(f.read(info.length)))
        report["<tensor records>"] = sorted(tensor_globals)
    for pt in sorted(iter_dir.rglob("*.pt")):
        report[str(pt.relative_to(iter_dir))] = _zip_pickle_globals(pt.read_bytes())
    return report


def _files(root: Path) -> dict:
    return {str(p.relative_to(root)): {"size": p.stat().st_size, "sha256": sha256(p)}
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "fixture.json"}


def _compare(a_dir: Path, b_dir: Path, filename: str) -> dict:
    """Max |a - b| over the tensors two oracle dumps share (and which names differ)."""
    from safetensors.torch import load_file

    a, b = load_file(str(a_dir / filename)), load_file(str(b_dir / filename))
    common = sorted(set(a) & set(b))
    worst = max((float((a[k] - b[k]).abs().max()) for k in common if a[k].shape == b[k].shape), default=0.0)
    return {"tensors": len(common), "only_in_reference": sorted(set(a) - set(b)),
            "only_here": sorted(set(b) - set(a)),
            "shape_mismatch": [k for k in common if a[k].shape != b[k].shape], "max_abs_diff": worst}


def _versions(venv: Path) -> dict:
    code = ("import torch, importlib.metadata as m; print(torch.__version__); "
            "print(m.version('megatron-core')); import sys; print(sys.version.split()[0])")
    out = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, check=True)
    torch_v, mcore_v, py_v = out.stdout.split()
    return {"torch": torch_v, "megatron_core": mcore_v, "python": py_v}


def generate(fx: Fixture, out_root: Path, venv: Path) -> dict:
    work = WORK_ROOT / fx.name
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    save = work / "ckpt"
    reports = work / "reports"
    spec = {"mlm_argv": fx.argv(save), "steps": STEPS, "report_dir": str(reports),
            "expert_bias_std": fx.expert_bias_std}
    (work / "spec.json").write_text(json.dumps(spec, indent=1))
    t_train = _run([str(_torchrun(venv)), "--standalone", f"--nproc-per-node={fx.world}", str(WORKER),
                    str(work / "spec.json")], work / "train.log", f"{fx.name} training job")
    tracker = save / "latest_checkpointed_iteration.txt"
    if not tracker.exists() or tracker.read_text().strip() != str(STEPS):
        raise RuntimeError(f"{fx.name}: no {tracker} saying {STEPS}")

    # Megatron's own reloads: the model (and forward logits) at TP=1/PP=1; the optimizer there
    # too where Megatron allows it, else at the saved TP/PP with DP=1.
    oracle = work / "oracle"
    topo = fx.model_reload_topology()
    optim_here = fx.optimizer_loads_at_tp1() or topo != (1, 1, 1, 1) or not fx.save_optim
    times = {"train_s": round(t_train, 1)}
    times["oracle_s"] = round(_oracle(venv, save, oracle, topo, no_optim=not optim_here or not fx.save_optim,
                                      forward=True, log=work / "oracle.log",
                                      etp=fx.etp if topo[3] > 1 else None), 1)
    if not optim_here:
        side = work / "oracle_optim"
        times["oracle_optimizer_s"] = round(_oracle(venv, save, side, fx.optimizer_reload_topology(), no_optim=False,
                                                    forward=False, log=work / "oracle_optim.log", etp=fx.etp), 1)
        shutil.copy(side / "optimizer.safetensors", oracle / "optimizer.safetensors")
        info = json.loads((side / "oracle.json").read_text())
        for k in ("names", "key_shapes"):
            info.pop(k, None)
        (oracle / "optimizer.json").write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
        check = _compare(oracle, side, "model.safetensors")
        if check["max_abs_diff"] != 0.0 or check["only_here"] or check["only_in_reference"]:
            raise RuntimeError(f"{fx.name}: the two reloads disagree on the model: {check}")

    cross = []
    for i, ctopo in enumerate(fx.cross_checks):
        cdir = work / f"cross_{i}"
        dt = _oracle(venv, save, cdir, ctopo, no_optim=not fx.save_optim, forward=True, log=work / f"cross_{i}.log")
        entry = {"tp": ctopo[0], "pp": ctopo[1], "dp": ctopo[2], "ep": ctopo[3], "seconds": round(dt, 1),
                 "model": _compare(oracle, cdir, "model.safetensors"),
                 "forward": _compare(oracle, cdir, "forward.safetensors")}
        if (cdir / "optimizer.safetensors").exists() and (oracle / "optimizer.safetensors").exists():
            entry["optimizer"] = _compare(oracle, cdir, "optimizer.safetensors")
        cross.append(entry)

    # The fixture folder: what Megatron wrote, the oracle, fixture.json.
    stage = work / "fixture"
    shutil.copytree(save, stage)
    shutil.copytree(oracle, stage / "oracle")
    ranks = sorted((json.loads(p.read_text()) for p in reports.glob("rank*.json")), key=lambda r: r["rank"])
    recipe = {
        "name": fx.name,
        "description": fx.description,
        "format": "megatron-" + fx.ckpt_format,
        "checkpoint_dir": ".",
        "iteration": STEPS,
        "made_by": "scripts/make_megatron_fixtures.py (Megatron-LM save_checkpoint from the megatron-core wheel)",
        "regenerate": f"{venv}/bin/python scripts/make_megatron_fixtures.py --only {fx.name}",
        "versions": _versions(venv),
        "topology": {"world": fx.world, "tp": fx.tp, "pp": fx.pp, "dp": fx.dp, "ep": fx.ep,
                     "layers": fx.layers, "layers_per_stage": fx.layers // fx.pp, "extra_argv": fx.extra_argv},
        "expert_bias": None if fx.expert_bias_std is None else
        f"set after training, before save_checkpoint: N(0, {fx.expert_bias_std}^2) per router, generator seeded "
        f"{EXPERT_BIAS_SEED} + the router's layer_number (1-based; an MTP layer's router: + num_layers; "
        "_fixture_megatron.set_expert_bias)",
        "optimizer": {"type": "adam", "distributed": fx.distopt,
                      "dist_ckpt_sharding": ("fully_reshardable" if fx.fully_reshardable else "dp_reshardable")
                      if fx.distopt else None,
                      "lr": 1e-3, "min_lr": 1e-4, "lr_decay_style": "cosine", "lr_warmup_iters": 1,
                      "weight_decay": 0.01, "betas": [0.9, 0.95], "eps": 1e-8, "clip_grad": 1.0},
        "seeds": {"megatron --seed": 1234, "per stage": "seed + 100 * pp_rank (Megatron's _set_random_seed)",
                  "data": "_megatron_common.DATA_SEED + step", "forward batch": "megatron_oracle.FORWARD_SEED"},
        "steps": STEPS,
        "data": "step s: torch.randint(0, 120, (4, 17), generator=torch.Generator().manual_seed(4321 + s)); "
                "DP rank d takes rows [2d, 2d + 2) (DP=1: both microbatches); tokens = [:, :-1], labels = [:, 1:]",
        "mlm_argv": [a if a != str(save) else "<save>" for a in fx.argv(save)],
        "save_path_in_args": str(save),
        "ranks": ranks,
        "losses_last_stage": next((r["losses"] for r in ranks if r["losses"]), []),
        "timing": times,
        "oracle": {"model_reload_topology": dict(zip(("tp", "pp", "dp", "ep"), topo, strict=True)),
                   "optimizer_in": "oracle/optimizer.safetensors" if (oracle / "optimizer.safetensors").exists()
                   else None,
                   "optimizer_reload": "oracle/optimizer.json" if not optim_here else "oracle/oracle.json"},
        "oracle_cross_checks": cross,
        "pickle_globals": pickle_report(stage / f"iter_{STEPS:07d}"),
        "files": _files(stage),
    }
    for entry in cross:
        for what in ("model", "forward", "optimizer"):
            c = entry.get(what)
            if c and (c["max_abs_diff"] != 0.0 or c["shape_mismatch"] or c["only_here"] or c["only_in_reference"]):
                print(f"  note: {fx.name} reload at {entry['tp'], entry['pp'], entry['dp'], entry['ep']} "
                      f"differs in {what}: {c}", flush=True)
    (stage / "fixture.json").write_text(json.dumps(recipe, indent=1) + "\n")

    dest = out_root / fx.name
    if dest.exists():
        shutil.rmtree(dest)
    out_root.mkdir(parents=True, exist_ok=True)
    shutil.move(str(stage), str(dest))
    return recipe


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", action="append", default=[], metavar="NAME", help="make only this fixture (repeatable)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--venv", type=Path, default=Path(DEFAULT_VENV),
                   help="the Megatron venv (default $MEGATRON_VENV or %(default)s)")
    p.add_argument("--list", action="store_true")
    p.add_argument("--venv-help", action="store_true", help="print how to create the Megatron venv")
    p.add_argument("--keep-work", action="store_true", help=f"keep {WORK_ROOT}/<name> afterwards")
    opts = p.parse_args(argv)
    if opts.venv_help:
        print(VENV_HELP)
        return 0
    if opts.list:
        for f in FIXTURES.values():
            print(f"{f.name:34s} world {f.world}  {f.description}")
        return 0
    if not _torchrun(opts.venv).exists():
        print(f"no Megatron venv at {opts.venv} (no bin/torchrun).\n\n{VENV_HELP}", file=sys.stderr)
        return 2
    names = opts.only or list(FIXTURES)
    unknown = [n for n in names if n not in FIXTURES]
    if unknown:
        p.error(f"unknown fixture(s) {unknown}; --list shows them")
    failed = []
    for name in names:
        t0 = time.monotonic()
        print(f"{name}: world {FIXTURES[name].world} ...", flush=True)
        try:
            recipe = generate(FIXTURES[name], opts.out, opts.venv)
        except Exception as e:  # noqa: BLE001 - report and go on with the others
            print(f"{name}: FAILED: {e}", flush=True)
            failed.append(name)
            continue
        size = sum(v["size"] for v in recipe["files"].values())
        print(f"{name}: ok in {time.monotonic() - t0:.0f}s ({recipe['timing']}), {size / 1e6:.2f} MB, "
              f"losses {recipe['losses_last_stage']}", flush=True)
        if not opts.keep_work:
            shutil.rmtree(WORK_ROOT / name, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
