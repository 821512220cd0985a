#!/usr/bin/env python
"""Build the real DeepSpeed checkpoint fixtures under ``tests/fixtures/deepspeed/``.

Each fixture is a tiny ``transformers`` model (built from a config object, random init, fixed
seed, nothing downloaded) trained for a few steps with DeepSpeed on CPU (``gloo``), then saved
with ``engine.save_checkpoint(dir, tag="global_step<N>")``.  The fixture folder is the parent
folder DeepSpeed writes (``latest`` plus the tag folder), next to a ``fixture.json`` that
records how it was made and what training printed.

Usage::

    python scripts/make_fixtures.py                       # all fixtures
    python scripts/make_fixtures.py --only llama_tp2 --only qwen2_tp2
    python scripts/make_fixtures.py --out /tmp/fixtures   # somewhere else
    python scripts/make_fixtures.py --list
    python scripts/make_fixtures.py --bench-200m /tmp/bench200m   # ~200M Llama, ZeRO-1, DP=2
    python scripts/make_fixtures.py --bench-400m /tmp/bench400m   # ~417M Llama, ZeRO-1, DP=2
    python scripts/make_fixtures.py --bench-zero3-200m /tmp/bench   # the ~200M Llama, ZeRO-3, DP=2
    python scripts/make_fixtures.py --dcp                  # only the PyTorch DCP fixtures
    python scripts/make_fixtures.py --bench-dcp-200m /tmp/bench200m   # ~200M Llama, FSDP2 DCP, 2 ranks

The PyTorch DCP fixtures (``tests/fixtures/dcp/``, part of the default set) are FSDP2 (or FSDP x TP)
jobs of ``_fixture_dcp.py`` under ``torchrun`` with the Llama fixtures' recipe, saved with
``torch.distributed.checkpoint.save``; each folder holds what DCP wrote plus a ``fixture.json``.

Every fixture is generated into a temporary folder first and swapped into place only when the
launch succeeded and the checkpoint looks complete; a failure leaves the existing fixture alone.

DeepSpeed's CPU all-reduce (the ``deepspeed_shm_comm_op`` extension) leaves one shared-memory
buffer (~66 MiB) per rank in ``/dev/shm`` named ``deepspeed_allreduce_buffer_*_<port>_*``; this
script deletes the ones for every port it used after each launch, whether it succeeded or not.

DeepSpeed also copies ``zero_to_fp32.py`` and ``zero_to_torch.py`` next to ``latest``; they are
dropped from the fixtures (they are generic helper scripts, not checkpoint data, and ``ruff``
would lint them under ``tests/``).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import pickle
import pickletools
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from ds_launch import cleanup_shm, job_env, launcher_cmd, port_is_free, root_cause, run_job

REPO = Path(__file__).resolve().parent.parent
TRAIN_SCRIPT = Path(__file__).resolve().parent / "_fixture_train.py"
PIPE_SCRIPT = Path(__file__).resolve().parent / "_fixture_pipe.py"  # deepspeed.pipe.PipelineModule
TP_PIPE_SCRIPT = Path(__file__).resolve().parent / "_fixture_tp_pipe.py"  # Megatron-style TP x PP
AUTOEP_SCRIPT = Path(__file__).resolve().parent / "_fixture_autoep.py"  # AutoEP MoE (expert parallel)
AUTOEP_PIPE_SCRIPT = Path(__file__).resolve().parent / "_fixture_autoep_pipe.py"  # AutoEP in a PipelineModule
MOE_SCRIPT = Path(__file__).resolve().parent / "_fixture_moe.py"  # classic deepspeed.moe.layer.MoE
DCP_SCRIPT = Path(__file__).resolve().parent / "_fixture_dcp.py"  # FSDP2 (x TP) jobs saving DCP
DEFAULT_OUT = REPO / "tests" / "fixtures" / "deepspeed"
DEFAULT_DCP_OUT = REPO / "tests" / "fixtures" / "dcp"
HELPER_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")

SEED = 1234
STEPS = 3
SEQ_LEN = 16
MICRO_BATCH = 2
LAUNCH_TIMEOUT_S = 900

# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------

# Dimensions are tiny (so all fixtures stay well under 10 MB) but pairwise distinct
# (hidden 32, q 32, kv 16, intermediate 88, vocab 96) so a transposed or swapped axis cannot
# go unnoticed in tests.
LLAMA = {
    "hidden_size": 32,
    "num_attention_heads": 4,  # head_dim 8
    "num_key_value_heads": 2,  # GQA: 2 query heads per kv head
    "num_hidden_layers": 2,
    "intermediate_size": 88,
    "vocab_size": 96,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

FROZEN = ["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight"]

QWEN2 = dict(LLAMA)  # the same sizes; Qwen2's q/k/v projections carry a bias

PIPE = {"vocab": 64, "hidden": 32, "layers": 4, "stages": 2}  # see _fixture_pipe.py
# Megatron-style TP x PP (see _fixture_tp_pipe.py): SwiGLU ffn 40 (dense_h_to_4h [80, 24])
TP_PIPE = {"vocab": 48, "hidden": 24, "ffn": 40, "layers": 4, "stages": 2, "tp": 2}
TP_PIPE_NOTE = (
    "scripts/_fixture_tp_pipe.py build(model_config): a deepspeed.pipe.PipelineModule over "
    "PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1) with Megatron-style vocabulary-, column- and "
    "row-parallel layers on the module grid's slice group, each parameter drawn whole from a generator "
    "seeded by the seed and its name and then sliced; saved with client_state={'universal_checkpoint_info': "
    "...} (the patterns Megatron-DeepSpeed records)."
)

# AutoEP (see _fixture_autoep.py): 4 experts, top-2, expert ffn 48
MIXTRAL = {
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 96,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "tie_word_embeddings": False,
}
# AutoEP's qwen3_moe preset: Qwen3-MoE (q/k norms, no shared expert), 4 experts top-2, expert ffn 24,
# dense ffn 72 (unused: every layer sparse), head_dim 8 given (Qwen3's default would be hidden / heads)
QWEN3_MOE = {
    "hidden_size": 32,
    "intermediate_size": 72,
    "moe_intermediate_size": 24,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_hidden_layers": 2,
    "vocab_size": 96,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "tie_word_embeddings": False,
    "max_position_embeddings": 64,
}
# AutoEP's deepseek_v3 preset: DeepSeek-V3 (MLA attention as tests/fixtures/hf/pretrained_deepseek_v3), layer 0
# dense (first_k_dense_replace 1), layer 1 MoE: 4 routed experts top-2 (sigmoid, e_score_correction_bias),
# one shared expert (ffn 16), n_group 1
DEEPSEEK_V3_MOE = {
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 16,
    "kv_lora_rank": 12,
    "qk_nope_head_dim": 6,
    "qk_rope_head_dim": 4,
    "v_head_dim": 8,
    "num_hidden_layers": 2,
    "intermediate_size": 72,
    "first_k_dense_replace": 1,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "moe_intermediate_size": 16,
    "rope_interleave": True,
    "rms_norm_eps": 1e-6,
    "vocab_size": 96,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}
# AutoEP's qwen3_moe preset on Qwen2-MoE (its hf_model_types): QWEN3_MOE's sizes without head_dim/q-k norms, a
# shared expert (ffn 40) and its sigmoid gate
QWEN2_MOE = dict({k: v for k, v in QWEN3_MOE.items() if k != "head_dim"}, shared_expert_intermediate_size=40)
# AutoEP's deepseek_v2 preset: DEEPSEEK_V3_MOE's sizes on DeepSeek-V2 (MLA, softmax router, greedy top-k, no
# router bias); head_dim the rope head (transformers' DeepSeek-V2 rotary takes it)
DEEPSEEK_V2_MOE = dict({k: v for k, v in DEEPSEEK_V3_MOE.items() if k not in ("n_group", "topk_group", "rope_interleave")},
                       head_dim=4)
# AutoEP's qwen3_5_moe preset (model_type qwen3_5_moe_text, the text backbone): layer 0 linear attention (gated
# delta rule: transformers' PyTorch fallback on CPU), layer 1 full attention; both MoE, 4 experts top-2 (ffn 24), a
# shared expert (ffn 40) and its gate
QWEN3_5_MOE = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "layer_types": ["linear_attention", "full_attention"],
    "moe_intermediate_size": 24,
    "shared_expert_intermediate_size": 40,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "vocab_size": 96,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}
# AutoEP's minimax_m3 preset (model_type minimax_m3_vl_text, the text backbone): layer 0 dense, layer 1 MoE: 4
# experts top-2 (ffn 24, GPT-OSS's clamped SwiGLU), a shared expert, a sigmoid router with e_score_correction_bias
MINIMAX_M3 = {
    "hidden_size": 32,
    "intermediate_size": 24,
    "dense_intermediate_size": 72,
    "shared_intermediate_size": 24,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "rotary_dim": 4,
    "mlp_layer_types": ["dense", "sparse"],
    "layer_types": ["full_attention", "full_attention"],
    "index_n_heads": 2,
    "index_head_dim": 8,
    "index_block_size": 4,
    "index_topk_blocks": 2,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "vocab_size": 96,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
AUTOEP_NOTE = (
    "Trained through scripts/_fixture_autoep.py, which patches transformers' _CanRecordRegistry.get to "
    "accept DeepSpeed AutoEP's (key, default) call (string keys: a plain dict lookup); without it "
    "deepspeed.initialize fails. The checkpoint files are written by DeepSpeed unmodified."
)

# classic deepspeed.moe.layer.MoE (see _fixture_moe.py): 2 MoE blocks, 4 experts over EP=2, top-1
MOE = {"vocab": 40, "hidden": 16, "ffn": 24, "layers": 2, "num_experts": 4, "ep_size": 2, "k": 1}
MOE_NOTE = (
    "Trained through scripts/_fixture_moe.py: deepspeed.moe.layer.MoE with use_rts=False and no token dropped, "
    "optimizer groups from split_params_into_different_moe_groups_for_optimizer. ds_to_universal cannot convert "
    "it (docs/deepspeed-checkpoints.md)."
)
MOE_TP_NOTE = (
    "TP 2 through scripts/_fixture_moe.py's Mpu (a Megatron-style mpu over gloo handed to deepspeed.initialize: "
    "TP groups [0, 1], [2, 3], DP groups [0, 2], [1, 3]); each block a dense column/row-parallel MLP before its "
    "MoE. oracle.json: the saving job's own digests of every whole master, moment and module weight."
)
GPT_BIGCODE = {
    "n_embd": 32,
    "n_head": 4,
    "n_layer": 2,
    "n_inner": 88,
    "n_positions": 64,
    "vocab_size": 96,
    "multi_query": True,  # MQA: one fused c_attn = [q (n_embd) | k (head_dim) | v (head_dim)]
    # Dropout off: with TP every rank must compute the same activations (and losses).
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# ~200M-parameter Llama for the benchmark checkpoint:
# embed + lm_head 2 * 32000 * 1024 = 65.5M; per layer attn 3.1M + mlp 8.65M; 12 layers -> ~207M.
LLAMA_200M = {
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "num_hidden_layers": 12,
    "intermediate_size": 2816,
    "vocab_size": 32000,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}

# ~400M-parameter Llama (about twice LLAMA_200M's bytes), wider rather than deeper:
# embed + lm_head 2 * 32000 * 1536 = 98.3M; per layer attn 7.1M (q/o 1536^2, k/v 1536 * 768) +
# mlp 3 * 1536 * 4224 = 19.5M; 12 layers -> ~417M.
LLAMA_400M = dict(LLAMA_200M, hidden_size=1536, num_attention_heads=24, num_key_value_heads=12,
                  intermediate_size=4224)  # head_dim 64, GQA 2 as in LLAMA_200M


GPT_BIGCODE_NOTE = (
    "DeepSpeed 0.19.8 AutoTP splits GPT-BigCode's fused c_attn query rows by the kv-head count "
    "(1 under MQA), so TP rank 0 holds all 32 query rows + the k/v block and TP rank 1 holds only "
    "the replicated k/v block (c_attn weight [16, 32]) and a 0-column c_proj shard. Unpatched, the "
    "HF eager attention then fails on rank 1 with 'RuntimeError: The size of tensor a (0) must "
    "match the size of tensor b (4) at non-singleton dimension 1'. Training runs with the patch "
    "'gpt_bigcode_empty_query_shard' (scripts/_fixture_train.py): on a rank with no query rows the "
    "attention output is an empty (batch, seq, 0) tensor fed to the row-parallel c_proj. The "
    "checkpoint files are written by DeepSpeed unmodified."
)


ZERO3_DP3_NOTE = (
    "Not trained: llama_zero3_dp2 converted by DeepSpeed's ds_to_universal (--inject_missing_state), "
    "loaded by a 3-rank DeepSpeed job with checkpoint.load_universal and saved at once with "
    "engine.save_checkpoint (tag global_step3): DeepSpeed's own native ZeRO-3 files at DP=3 of exactly "
    "llama_zero3_dp2's state. 'losses' is empty; 'ds_config' is the loading job's."
)


def ds_config(stage: int, *, bf16: bool = False, autotp: int = 0, micro_batch: int = MICRO_BATCH) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        # torch_adam=True -> plain torch.optim.AdamW (no FusedAdam / CPUAdam extension to compile).
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01, "torch_adam": True},
        },
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
        "wall_clock_breakdown": False,
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if autotp:
        cfg["tensor_parallel"] = {"autotp_size": autotp}
    return cfg


@dataclass
class Fixture:
    name: str
    model_type: str
    model_config: dict
    ds_config: dict
    world_size: int
    tp: int = 1
    pp: int = 1
    train_script: Path = TRAIN_SCRIPT
    steps: int = STEPS
    seq_len: int = SEQ_LEN
    micro_batch: int = MICRO_BATCH
    seed: int = SEED
    patches: list = field(default_factory=list)  # names from _fixture_train.PATCHES
    notes: list = field(default_factory=list)
    # Not trained: DeepSpeed's ds_to_universal of this (committed) fixture, loaded with
    # load_universal at this fixture's topology and saved natively at once (steps = 0).
    derived_from: str | None = None
    tag_name: str | None = None  # default global_step<steps>
    frozen: list = field(default_factory=list)  # parameter names frozen (requires_grad_(False)) before initialize

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    @property
    def zero_stage(self) -> int:
        return int(self.ds_config["zero_optimization"]["stage"])

    @property
    def tag(self) -> str:
        return self.tag_name or f"global_step{self.steps}"


FIXTURES = [
    Fixture("llama_zero1_dp2", "llama", LLAMA, ds_config(1), world_size=2),
    Fixture("llama_zero2_dp2", "llama", LLAMA, ds_config(2), world_size=2),
    Fixture("llama_zero3_dp2", "llama", LLAMA, ds_config(3), world_size=2),
    # DeepSpeed's own ZeRO-3 files at DP=3 (padded partitions) holding exactly llama_zero3_dp2's state
    Fixture("llama_zero3_dp3", "llama", LLAMA, dict(ds_config(3), checkpoint={"load_universal": True}),
            world_size=3, steps=0, derived_from="llama_zero3_dp2", tag_name="global_step3",
            notes=[ZERO3_DP3_NOTE]),
    Fixture("llama_zero1_dp2_bf16", "llama", LLAMA, ds_config(1, bf16=True), world_size=2),
    # ZeRO-3 in bf16: bf16_ optimizer files, bf16 placeholders in the per-rank model states
    Fixture("llama_zero3_dp2_bf16", "llama", LLAMA, ds_config(3, bf16=True), world_size=2),
    Fixture("llama_tp2", "llama", LLAMA, ds_config(1, autotp=2), world_size=2, tp=2),
    Fixture("qwen2_tp2", "qwen2", QWEN2, ds_config(1, autotp=2), world_size=2, tp=2),
    Fixture("gpt_bigcode_tp2", "gpt_bigcode", GPT_BIGCODE, ds_config(1, autotp=2), world_size=2, tp=2,
            patches=["gpt_bigcode_empty_query_shard"],
            notes=[GPT_BIGCODE_NOTE]),
    Fixture("llama_tp2_dp2", "llama", LLAMA, ds_config(1, autotp=2), world_size=4, tp=2),
    # AutoTP x ZeRO-3: zero_pp_rank_D_mp_rank_TT files, each TP shard partitioned over its DP ranks
    Fixture("llama_zero3_tp2_dp2", "llama", LLAMA, ds_config(3, autotp=2), world_size=4, tp=2),
    Fixture("llama_zero3_tp2_dp2_bf16", "llama", LLAMA, ds_config(3, bf16=True, autotp=2), world_size=4, tp=2),
    Fixture("pipe_pp2_dp2", "pipe", PIPE, dict(ds_config(1), gradient_accumulation_steps=2), world_size=4, pp=2,
            seq_len=8, train_script=PIPE_SCRIPT),
    # odd sizes: each stage's flat partition is padded, and parameters straddle the DP split
    Fixture("pipe_pp2_dp2_bf16_odd", "pipe", dict(PIPE, hidden=15, vocab=37),
            dict(ds_config(1, bf16=True), gradient_accumulation_steps=2), world_size=4, pp=2, seq_len=8,
            train_script=PIPE_SCRIPT),
    # tensor x pipeline parallel (Megatron-DeepSpeed layout): layer_XX-model_YY files, mp_rank = stage * TP + TP rank
    Fixture("tp_pipe_tp2_pp2", "tp_pipe", TP_PIPE, dict(ds_config(1), gradient_accumulation_steps=2), world_size=4,
            tp=2, pp=2, seq_len=8, train_script=TP_PIPE_SCRIPT, notes=[TP_PIPE_NOTE]),
    # AutoEP: a tiny Mixtral, 4 experts over EP=2 (layer_L_expert_E files, ds_autoep_layers)
    Fixture("mixtral_autoep_ep2", "mixtral", MIXTRAL,
            dict(ds_config(1), expert_parallel={"enabled": True, "autoep_size": 2, "preset_model": "mixtral"}),
            world_size=2, train_script=AUTOEP_SCRIPT, patches=["transformers_can_record_registry_default"],
            notes=[AUTOEP_NOTE]),
    # the same AutoEP recipe at world 4: EP=2 x EDP=2, each expert group's ZeRO partition split over
    # the EDP group of its EP rank (DP ranks {0, 2} and {1, 3})
    Fixture("mixtral_autoep_ep2_dp4", "mixtral", MIXTRAL,
            dict(ds_config(1), expert_parallel={"enabled": True, "autoep_size": 2, "preset_model": "mixtral"}),
            world_size=4, train_script=AUTOEP_SCRIPT, patches=["transformers_can_record_registry_default"],
            notes=[AUTOEP_NOTE]),
    # the AutoEP recipe under ZeRO-3: each EP rank's fused experts partitioned per parameter over its EDP group
    Fixture("mixtral_autoep_ep2_zero3", "mixtral", MIXTRAL,
            dict(ds_config(3), expert_parallel={"enabled": True, "autoep_size": 2, "preset_model": "mixtral"}),
            world_size=2, train_script=AUTOEP_SCRIPT, patches=["transformers_can_record_registry_default"],
            notes=[AUTOEP_NOTE]),
    # AutoEP's qwen3_moe preset: a tiny Qwen3-MoE, 4 experts over EP=2, one step
    Fixture("qwen3_moe_autoep_ep2", "qwen3_moe", QWEN3_MOE,
            dict(ds_config(1), expert_parallel={"enabled": True, "autoep_size": 2, "preset_model": "qwen3_moe"}),
            world_size=2, steps=1, train_script=AUTOEP_SCRIPT, patches=["transformers_can_record_registry_default"],
            notes=[AUTOEP_NOTE]),
    # AutoEP's qwen3_moe preset on a tiny Qwen2-MoE (shared expert + gate), one step
    Fixture("qwen2_moe_autoep_ep2", "qwen2_moe", QWEN2_MOE,
            dict(ds_config(1), expert_parallel={"enabled": True, "autoep_size": 2, "preset_model": "qwen3_moe"}),
            world_size=2, steps=1, train_script=AUTOEP_SCRIPT, patches=["transformers_can_record_registry_default"],
            notes=[AUTOEP_NOTE]),
    # AutoEP's deepseek_v3 preset: a tiny DeepSeek-V3 (a dense layer, then shared + routed experts), one step
    Fixture("deepseek_v3_autoep_ep2", "deepseek_v3", DEEPSEEK_V3_MOE,
            dict(ds_config(1), expert_parallel={"enabled": True, "autoep_size": 2, "preset_model": "deepseek_v3"}),
            world_size=2, steps=1, train_script=AUTOEP_SCRIPT, patches=["transformers_can_record_registry_default"],
            notes=[AUTOEP_NOTE]),
    # AutoEP's deepseek_v2, qwen3_5_moe and minimax_m3 presets (DeepSpeed 0.19.8), each one step at EP 2, world 2
    Fixture("deepseek_v2_autoep_ep2", "deepseek_v2", DEEPSEEK_V2_MOE,
            dict(ds_config(1), expert_parallel={"enabled": True, "autoep_size": 2, "preset_model": "deepseek_v2"}),
            world_size=2, steps=1, train_script=AUTOEP_SCRIPT, patches=["transformers_can_record_registry_default"],
            notes=[AUTOEP_NOTE]),
    Fixture("qwen3_5_moe_autoep_ep2", "qwen3_5_moe_text", QWEN3_5_MOE,
            dict(ds_config(1), expert_parallel={"enabled": True, "autoep_size": 2, "preset_model": "qwen3_5_moe"}),
            world_size=2, steps=1, train_script=AUTOEP_SCRIPT, patches=["transformers_can_record_registry_default"],
            notes=[AUTOEP_NOTE]),
    Fixture("minimax_m3_autoep_ep2", "minimax_m3_vl_text", MINIMAX_M3,
            dict(ds_config(1), expert_parallel={"enabled": True, "autoep_size": 2, "preset_model": "minimax_m3"}),
            world_size=2, steps=1, train_script=AUTOEP_SCRIPT, patches=["transformers_can_record_registry_default"],
            notes=[AUTOEP_NOTE]),
    # AutoEP x AutoTP ("folding"): TP=2 x EP=2 on the same 2 ranks (EP rank g % 2 of global rank g),
    # dense weights AutoTP shards, experts whole per EP rank; every file carries a "folding" record
    Fixture("mixtral_autoep_ep2_tp2", "mixtral", MIXTRAL,
            dict(ds_config(1), tensor_parallel={"autotp_size": 2, "preset_model": "mixtral"},
                 expert_parallel={"enabled": True, "autoep_size": 2, "preset_model": "mixtral"}),
            world_size=2, tp=2, train_script=AUTOEP_SCRIPT, patches=["transformers_can_record_registry_default"],
            notes=[AUTOEP_NOTE]),
    # ... and the same fold at ZeRO-3: every rank's sub-groups partition its own TP lane's parameters over
    # DP=1; DeepSpeed still writes per-expert files and a "folding" record in every file
    Fixture("mixtral_autoep_ep2_tp2_zero3", "mixtral", MIXTRAL,
            dict(ds_config(3), tensor_parallel={"autotp_size": 2, "preset_model": "mixtral"},
                 expert_parallel={"enabled": True, "autoep_size": 2, "preset_model": "mixtral"}),
            world_size=2, tp=2, train_script=AUTOEP_SCRIPT, patches=["transformers_can_record_registry_default"],
            notes=[AUTOEP_NOTE]),
    # ... and at world 4: TP 2 x DP 2, EP 2 x EDP 2 (EDP groups {0, 2}, {1, 3} of global ranks dp * 2 + tp)
    Fixture("mixtral_autoep_ep2_tp2_dp2_zero3", "mixtral", MIXTRAL,
            dict(ds_config(3), tensor_parallel={"autotp_size": 2, "preset_model": "mixtral"},
                 expert_parallel={"enabled": True, "autoep_size": 2, "preset_model": "mixtral"}),
            world_size=4, tp=2, train_script=AUTOEP_SCRIPT, patches=["transformers_can_record_registry_default"],
            notes=[AUTOEP_NOTE]),
    # AutoEP under pipeline parallelism (TP 1): PP 2 x DP 2, EP 2 in each stage; one mp_rank_0S model state and
    # per-expert files per stage, no layer_XX files (reshard refuses it by name, docs/deepspeed-checkpoints.md §11.4)
    Fixture("mixtral_autoep_ep2_pp2", "mixtral", dict(MIXTRAL, pipeline_stages=2),
            dict(ds_config(1), gradient_accumulation_steps=2,
                 expert_parallel={"enabled": True, "autoep_size": 2, "preset_model": "mixtral",
                                  "moe_layer_pattern": r"\d+\.mlp"}),
            world_size=4, pp=2, train_script=AUTOEP_PIPE_SCRIPT, patches=["transformers_can_record_registry_default"],
            notes=[AUTOEP_NOTE, "scripts/_fixture_autoep_pipe.py: a PipelineModule of an embedding, 2 blocks "
                   "(LayerNorm + transformers' MixtralSparseMoeBlock) and a head, 2 stages; AutoEP finds the blocks "
                   "by moe_layer_pattern '\\d+\\.mlp'"]),
    # ... the same PipelineModule run at pipeline_stages 1 (world 2, EP 2): what DeepSpeed writes at the topology
    # reshard's `--pp 1` target of mixtral_autoep_ep2_pp2 takes (the reference for its structure)
    Fixture("mixtral_autoep_ep2_pipe1", "mixtral", dict(MIXTRAL, pipeline_stages=1),
            dict(ds_config(1), gradient_accumulation_steps=2,
                 expert_parallel={"enabled": True, "autoep_size": 2, "preset_model": "mixtral",
                                  "moe_layer_pattern": r"\d+\.mlp"}),
            world_size=2, pp=1, train_script=AUTOEP_PIPE_SCRIPT, patches=["transformers_can_record_registry_default"],
            notes=[AUTOEP_NOTE, "scripts/_fixture_autoep_pipe.py: the PipelineModule of mixtral_autoep_ep2_pp2 at one "
                   "stage (world 2, EP 2); AutoEP finds the blocks by moe_layer_pattern '\\d+\\.mlp'"]),
    # a fine-tuning job's frozen parameters (the embedding and one LayerNorm): kept out of the optimizer;
    # ZeRO-2/3 record them as frozen_param_shapes / frozen_param_fragments (ZeRO-3: each rank its partition),
    # ZeRO-1 writes None there (the module state dict holds them)
    *[Fixture(f"llama_frozen_zero{stage}_dp2", "llama", LLAMA, ds_config(stage), world_size=2, frozen=FROZEN)
      for stage in (1, 2, 3)],
    # classic deepspeed.moe.layer.MoE: 4 experts over EP=2 (layer_L_expert_E files, per-EP-rank local names)
    Fixture("moe_ep2", "moe", MOE, ds_config(1), world_size=2, train_script=MOE_SCRIPT, notes=[MOE_NOTE]),
    # the same classic MoE recipe in bf16 under ZeRO-2 (bf16_ optimizer files, bf16 module and expert weights)
    Fixture("moe_ep2_bf16_zero2", "moe", MOE, ds_config(2, bf16=True), world_size=2, train_script=MOE_SCRIPT,
            notes=[MOE_NOTE]),
    # ... and at world 4: EP=2 x EDP=2, each EP rank's expert group cut over DP ranks {e, e + 2}
    Fixture("moe_ep2_dp4", "moe", MOE, ds_config(1), world_size=4, train_script=MOE_SCRIPT, notes=[MOE_NOTE]),
    # classic MoE at TP 2 x DP 2 (EP 2) through a hand-written Megatron-style mpu: the dense MLP tensor-parallel,
    # the experts replicated modules (enable_expert_tensor_parallelism=False) or split over TP (True)
    Fixture("moe_ep2_tp2", "moe", dict(MOE, tp=2), ds_config(1), world_size=4, tp=2, train_script=MOE_SCRIPT,
            notes=[MOE_NOTE, MOE_TP_NOTE]),
    Fixture("moe_ep2_tp2_etp", "moe", dict(MOE, tp=2, expert_tp=True), ds_config(1), world_size=4, tp=2,
            train_script=MOE_SCRIPT, notes=[MOE_NOTE, MOE_TP_NOTE]),
]
BY_NAME = {f.name: f for f in FIXTURES}


def bench_200m_fixture(name: str = "llama_200m_zero1_dp2", model_config: dict = LLAMA_200M) -> Fixture:
    return Fixture(
        name,
        "llama",
        model_config,
        ds_config(1, micro_batch=1),
        world_size=2,
        steps=1,
        seq_len=64,
        micro_batch=1,
    )


def bench_400m_fixture() -> Fixture:
    """The same recipe as ``bench_200m_fixture`` with LLAMA_400M."""
    return bench_200m_fixture("llama_400m_zero1_dp2", LLAMA_400M)


def bench_zero3_200m_fixture() -> Fixture:
    """The same recipe as ``bench_200m_fixture`` (LLAMA_200M, DP=2, fp32, 1 step) under ZeRO-3."""
    return Fixture("llama_200m_zero3_dp2", "llama", LLAMA_200M, ds_config(3, micro_batch=1), world_size=2, steps=1,
                   seq_len=64, micro_batch=1)


@dataclass
class DcpFixture:
    """A PyTorch DCP checkpoint saved by ``_fixture_dcp.py save`` (FSDP2, or FSDP x TP with
    ``mesh``) after ``steps`` AdamW steps with the Llama fixtures' recipe."""

    name: str
    world_size: int
    mesh: str | None = None  # "DPxTP"; None: a 1-D FSDP2 mesh over every rank
    steps: int = STEPS
    model: str = "tiny"  # _fixture_dcp.MODELS: "tiny" (LLAMA), "200m" (LLAMA_200M) or "mixtral" (MIXTRAL)
    digests: str = "full"  # _fixture_dcp --digests: "full" (tests/e2e/digest.py), "sha", "none"
    # the DeepSpeed fixture trained with the same model, data split and optimizer: its losses
    # are recorded next to ours
    same_recipe_as: str | None = None
    notes: list = field(default_factory=list)


DCP_FIXTURES = [
    DcpFixture("llama_fsdp2_ws2", 2, same_recipe_as="llama_zero1_dp2"),
    DcpFixture("llama_fsdp_tp_2x2", 4, mesh="2x2", same_recipe_as="llama_tp2_dp2"),
    # an MoE model's FSDP2 save: transformers' fused experts (mlp.experts.gate_up_proj [E, ...])
    DcpFixture("mixtral_fsdp2_ws2", 2, model="mixtral"),
]
DCP_BY_NAME = {f.name: f for f in DCP_FIXTURES}


def bench_dcp_200m_fixture() -> DcpFixture:
    """LLAMA_200M (the ``--bench-200m`` model and data recipe) under FSDP2 on 2 ranks, 1 step."""
    return DcpFixture("llama_200m_dcp_ws2", 2, steps=1, model="200m", digests="sha")


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def log(msg: str) -> None:
    print(f"[make_fixtures] {msg}", flush=True)


class PortAllocator:
    """Hands out a distinct free TCP port per launch, starting from ``base``."""

    def __init__(self, base: int):
        self.next = base

    def take(self) -> int:
        while True:
            port = self.next
            self.next += 1
            if port_is_free(port):
                return port


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def pickle_globals(path: Path) -> list[str]:
    """Fully qualified names of every GLOBAL / STACK_GLOBAL in a torch zip checkpoint's pickle."""
    with zipfile.ZipFile(path) as zf:
        names = [n for n in zf.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
        data = zf.read(names[0])
    return pickle_bytes_globals(data)


def pickle_bytes_globals(data: bytes) -> list[str]:
    """Fully qualified names of every GLOBAL / STACK_GLOBAL in a pickle stream."""
    found: set[str] = set()
    stack_strings: list[str] = []  # string values pushed so far, for STACK_GLOBAL
    memo: dict[int, object] = {}
    last: object = None  # value of the most recent push, for PUT / MEMOIZE
    for op, arg, _pos in pickletools.genops(data):
        name = op.name
        if name == "GLOBAL":
            mod, qual = arg.split(" ", 1)
            found.add(f"{mod}.{qual}")
            last = None
        elif name == "STACK_GLOBAL":
            if len(stack_strings) >= 2:
                found.add(f"{stack_strings[-2]}.{stack_strings[-1]}")
            last = None
        elif name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"):
            last = arg
            stack_strings.append(arg)
        elif name in ("BINGET", "LONG_BINGET", "GET"):
            last = memo.get(int(arg))
            if isinstance(last, str):
                stack_strings.append(last)
        elif name in ("BINPUT", "LONG_BINPUT", "PUT"):
            memo[int(arg)] = last
        elif name == "MEMOIZE":
            memo[len(memo)] = last
        else:
            last = None
    return sorted(found)


def versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for mod in ("torch", "deepspeed", "transformers"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as exc:  # pragma: no cover
            out[mod] = f"unavailable: {exc}"
    return out


def full_model_config(fx: Fixture) -> dict | None:
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.for_model(fx.model_type, **fx.model_config)
        return json.loads(cfg.to_json_string(use_diff=False))
    except Exception:  # pragma: no cover - informational only
        return None


def check_checkpoint(ckpt: Path, fx: Fixture) -> list[str]:
    """Raise if the saved folder is not a complete DeepSpeed checkpoint; return its files."""
    latest = ckpt / "latest"
    if not latest.is_file():
        raise RuntimeError(f"no 'latest' file in {ckpt}")
    tag = latest.read_text().strip()
    if tag != fx.tag:
        raise RuntimeError(f"'latest' says {tag!r}, expected {fx.tag!r}")
    tag_dir = ckpt / tag
    files = sorted(p.name for p in tag_dir.iterdir())
    want_optim = fx.world_size  # one zero_pp_rank_<d>_mp_rank_<t>_optim_states.pt per rank
    optim = [f for f in files if f.endswith("_optim_states.pt")]
    model = [f for f in files if f.endswith("_model_states.pt")]
    if len(optim) != want_optim:
        raise RuntimeError(f"expected {want_optim} optimizer-state files, found {optim}")
    if not model:
        raise RuntimeError(f"no model-state files in {tag_dir}: {files}")
    return files


# --------------------------------------------------------------------------------------------
# One launch
# --------------------------------------------------------------------------------------------


def universal_of(fixture_dir: Path, out_tag_dir: Path, log_path: Path) -> Path:
    """DeepSpeed's ``ds_to_universal`` of a fixture into ``out_tag_dir``; returns its parent
    (which holds ``latest_universal``)."""
    src = fixture_dir / (fixture_dir / "latest").read_text().strip()
    cmd = [sys.executable, "-W", "ignore", "-m", "deepspeed.checkpoint.ds_to_universal",
           "--input_folder", str(src), "--output_folder", str(out_tag_dir), "--inject_missing_state",
           "--num_extract_workers", "1", "--num_merge_workers", "1"]
    with open(log_path, "w") as log_file:
        res = subprocess.run(cmd, stdout=log_file, stderr=subprocess.STDOUT, cwd=REPO, timeout=600)
    if res.returncode != 0:
        raise RuntimeError(f"ds_to_universal of {fixture_dir} failed (log: {log_path})")
    return out_tag_dir.parent



def launch(cmd: list[str], env: dict, log_path: Path, timeout_s: float) -> float:
    """Run one launcher command to completion; its seconds, or a RuntimeError with the root cause
    and the log's tail."""
    t0 = time.time()
    try:
        rc = run_job(cmd, cwd=REPO, env=env, log_path=log_path, timeout_s=timeout_s)
    except TimeoutError:
        raise RuntimeError(f"launch timed out after {timeout_s}s (log: {log_path})") from None
    seconds = time.time() - t0
    if rc != 0:
        lines = open(log_path, errors="replace").readlines()
        raise RuntimeError(f"launch exited with {rc} after {seconds:.1f}s: {root_cause(lines)}\n"
                           f"log tail ({log_path}):\n{''.join(lines[-40:])}")
    return seconds

def run_launch(fx: Fixture, work: Path, port: int, timeout_s: int, log_path: Path,
               out_dir: Path = DEFAULT_OUT) -> dict:
    """Train + save ``fx`` into ``work/ckpt``; returns {"reports": [...], "seconds": float}."""
    load_dir = None
    if fx.derived_from:
        base = out_dir / fx.derived_from
        base = base if (base / "latest").is_file() else DEFAULT_OUT / fx.derived_from
        load_dir = universal_of(base, work / "ucp" / fx.tag, work / "ds_to_universal.log")
    spec = {
        "model_type": fx.model_type,
        "model_config": fx.model_config,
        "ds_config": fx.ds_config,
        "steps": fx.steps,
        "seed": fx.seed,
        "seq_len": fx.seq_len,
        "micro_batch": fx.micro_batch,
        "save_dir": str(work / "ckpt"),
        "tag": fx.tag,
        "report_dir": str(work / "report"),
        "patches": fx.patches,
        "load_dir": None if load_dir is None else str(load_dir),
        "frozen": fx.frozen,
    }
    spec_path = work / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    cmd = launcher_cmd() + [
        "--num_gpus", str(fx.world_size),
        "--no_local_rank",
        "--master_port", str(port),
        str(fx.train_script),
        "--spec", str(spec_path),
    ]  # fmt: skip
    seconds = launch(cmd, job_env(), log_path, timeout_s)
    reports = []
    for r in range(fx.world_size):
        p = work / "report" / f"rank_{r}.json"
        if not p.is_file():
            raise RuntimeError(f"rank {r} wrote no report ({p})")
        reports.append(json.loads(p.read_text()))
    return {"reports": reports, "seconds": seconds}


def build_fixture_json(fx: Fixture, ckpt: Path, files: list[str], reports: list[dict]) -> dict:
    tag_dir = ckpt / fx.tag
    file_info = {}
    for name in files:
        p = tag_dir / name
        info = {"bytes": p.stat().st_size, "sha256": sha256(p)}
        if name.endswith(".pt"):
            try:
                info["pickle_globals"] = pickle_globals(p)
            except Exception as exc:  # pragma: no cover
                info["pickle_globals_error"] = repr(exc)
        file_info[name] = info
    r0 = reports[0]
    return {
        "name": fx.name,
        "tag": fx.tag,
        "checkpoint_dir": ".",  # `latest` and the tag folder sit next to this file
        "model_type": fx.model_type,
        "model_config": fx.model_config,
        "model_config_full": full_model_config(fx),
        "patches": fx.patches,
        "model_init": ("scripts/_fixture_pipe.py build(model_config): a deepspeed.pipe.PipelineModule, "
                       "after torch.manual_seed(seed)") if fx.model_type == "pipe" else
                      ("scripts/_fixture_tp_pipe.py build(model_config): a deepspeed.pipe.PipelineModule of "
                       "Megatron-style parallel layers, each parameter drawn whole from a generator seeded by "
                       "the seed and its name") if fx.model_type == "tp_pipe" else
                      "scripts/_fixture_moe.py build(model_config), after torch.manual_seed(seed)"
                      if fx.model_type == "moe" else
                      "AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **model_config), "
                      "attn_implementation='eager', dtype=torch.float32) after torch.manual_seed(seed)",
        "ds_config": fx.ds_config,
        "world_size": fx.world_size,
        "topology": {
            "tp": fx.tp,
            "dp": fx.dp,
            "pp": fx.pp,
            "zero_stage": fx.zero_stage,
            "bf16": bool(fx.ds_config.get("bf16", {}).get("enabled", False)),
            "ranks": [
                {"rank": r["rank"], "tp_rank": r["tp_rank"], "dp_rank": r["dp_rank"],
                 **({"pp_rank": r["pp_rank"]} if "pp_rank" in r else {})}
                for r in reports
            ],
        },
        "steps": fx.steps,
        "seed": fx.seed,
        "data": {
            "kind": "fixed synthetic batch, same at every step",
            "recipe": "torch.randint(0, vocab_size, (micro_batch * dp, seq_len), "
                      "generator=torch.Generator().manual_seed(seed + 1)); dp rank d takes rows "
                      "[d*micro_batch, (d+1)*micro_batch); labels = input_ids",
            "seq_len": fx.seq_len,
            "micro_batch": fx.micro_batch,
        },
        "losses": r0["losses"],
        "losses_per_rank": {str(r["rank"]): r["losses"] for r in reports},
        "global_steps": r0["global_steps"],
        "param_dtype": r0["param_dtype"],
        "optimizer_class": r0["optimizer_class"],
        "basic_optimizer_class": r0["basic_optimizer_class"],
        "versions": versions(),
        "files": file_info,
        "notes": fx.notes,
        **({"derived_from": fx.derived_from} if fx.derived_from else {}),
        **({"frozen": fx.frozen} if fx.frozen else {}),
    }


def swap_into_place(src: Path, out_dir: Path, name: str) -> Path:
    """Move ``src`` to ``out_dir / name``: next to the destination first (a rename when on one
    filesystem, else a copy), then renamed over the old fixture. Returns the destination."""
    out_dir.mkdir(parents=True, exist_ok=True)
    dest = out_dir / name
    staging = out_dir / f".{name}.new"
    old = out_dir / f".{name}.old"
    for p in (staging, old):
        if p.exists():
            shutil.rmtree(p)
    shutil.move(str(src), str(staging))
    if dest.exists():
        dest.rename(old)
    staging.rename(dest)
    if old.exists():
        shutil.rmtree(old)
    return dest


def make_one(fx: Fixture, out_dir: Path, ports: PortAllocator, timeout_s: int, keep_tmp: bool,
             write_json: bool = True) -> dict:
    """Generate one fixture and swap it into ``out_dir / fx.name``.  Returns a summary dict."""
    work = Path(tempfile.mkdtemp(prefix=f"reshard-fx-{fx.name}-"))
    port = ports.take()
    log_path = work / "launch.log"
    t0 = time.time()
    try:
        log(f"{fx.name}: launching {fx.world_size} ranks (tp={fx.tp}, dp={fx.dp}, zero={fx.zero_stage}) "
            f"on port {port}, work dir {work}")
        try:
            res = run_launch(fx, work, port, timeout_s, log_path, out_dir)
        finally:
            removed = cleanup_shm(port)
            if removed:
                log(f"{fx.name}: removed {len(removed)} /dev/shm buffer(s) for port {port}")
        ckpt = work / "ckpt"
        for helper in HELPER_SCRIPTS:
            (ckpt / helper).unlink(missing_ok=True)
        files = check_checkpoint(ckpt, fx)
        if write_json:
            meta = build_fixture_json(fx, ckpt, files, res["reports"])
            (ckpt / "fixture.json").write_text(json.dumps(meta, indent=1, sort_keys=False) + "\n")

        dest = swap_into_place(ckpt, out_dir, fx.name)
        seconds = time.time() - t0
        losses = res["reports"][0]["losses"]
        log(f"{fx.name}: OK in {seconds:.1f}s (launch {res['seconds']:.1f}s); rank-0 losses {losses}")
        return {"name": fx.name, "ok": True, "seconds": seconds, "launch_seconds": res["seconds"],
                "port": port, "dest": str(dest)}
    except Exception as exc:
        seconds = time.time() - t0
        log(f"{fx.name}: FAILED after {seconds:.1f}s: {exc}")
        keep_tmp = True
        return {"name": fx.name, "ok": False, "seconds": seconds, "port": port, "error": str(exc),
                "log": str(log_path)}
    finally:
        cleanup_shm(port)
        if keep_tmp:
            log(f"{fx.name}: kept work dir {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# PyTorch DCP fixtures (torchrun, FSDP2)
# --------------------------------------------------------------------------------------------


def torchrun_cmd(world_size: int, script: Path, args: list[str]) -> list[str]:
    """``torchrun --standalone`` of this interpreter: the rendezvous binds a free port itself, so
    concurrent launches cannot collide (and no DeepSpeed shared memory is involved)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc_per_node", str(world_size), str(script), *args]


def dcp_job_args(mode: str, dcp_dir: Path, report_dir: Path, *, mesh: str | None = None, steps: int = 1,
                 model: str = "tiny", digests: str = "full", save_tensors: bool = False,
                 allow_partial_load: bool = False, batch_dp: int | None = None) -> list[str]:
    """The arguments of one ``_fixture_dcp.py`` job (see its docstring)."""
    args = [mode, "--dcp-dir", str(dcp_dir), "--report-dir", str(report_dir), "--steps", str(steps),
            "--model", model, "--digests", digests]
    if batch_dp is not None:
        args += ["--batch-dp", str(batch_dp)]
    if mesh:
        args += ["--mesh", mesh]
    if save_tensors:
        args.append("--save-tensors")
    if allow_partial_load:
        args.append("--allow-partial-load")
    return args


def check_dcp_checkpoint(ckpt: Path, world_size: int) -> list[str]:
    """Raise unless ``ckpt`` holds ``.metadata`` and one ``.distcp`` file per rank; its files."""
    files = sorted(p.name for p in ckpt.iterdir())
    want = [".metadata"] + [f"__{r}_0.distcp" for r in range(world_size)]
    if sorted(want) != files:
        raise RuntimeError(f"expected {want} in {ckpt}, found {files}")
    return files


def dcp_metadata_summary(metadata_path: Path) -> dict:
    """What a reader of the ``.metadata`` pickle meets: its protocol, globals and key kinds (read
    with pickletools; the pickle is not loaded)."""
    data = metadata_path.read_bytes()
    protocols = sorted({arg for op, arg, _ in pickletools.genops(data) if op.name == "PROTO"})
    md = pickle.loads(data)  # our own freshly written file: its keys and chunk counts
    kinds: dict[str, int] = {}
    for value in md.state_dict_metadata.values():
        kinds[type(value).__name__] = kinds.get(type(value).__name__, 0) + 1
    return {
        "pickle_protocol": protocols,
        "pickle_globals": pickle_bytes_globals(data),
        "version": md.version,
        "keys": len(md.state_dict_metadata),
        "key_kinds": kinds,
        "chunks": sum(len(getattr(v, "chunks", [])) for v in md.state_dict_metadata.values()),
        "storage_items": len(md.storage_data),
        "notes": "storage_meta holds the checkpoint_id (the temporary path it was written to) and a "
                 "random save_id, so .metadata differs between runs; the .distcp files do not",
    }


def build_dcp_fixture_json(fx: DcpFixture, ckpt: Path, files: list[str], report: dict, command: list[str]) -> dict:
    model_config = report["model_config"]
    ds = {}
    if fx.same_recipe_as:
        ds_json = DEFAULT_OUT / fx.same_recipe_as / "fixture.json"
        if ds_json.is_file():
            ds_fx = json.loads(ds_json.read_text())
            ds = {"fixture": f"tests/fixtures/deepspeed/{fx.same_recipe_as}", "losses_rank0": ds_fx["losses"],
                  "losses_rank0_equal": ds_fx["losses"] == report["losses_rank0"]}
    mesh = report["mesh"]
    return {
        "name": fx.name,
        "format": "pytorch-dcp",
        "checkpoint_dir": ".",  # .metadata and the .distcp files sit next to this file
        "dcp_keys": {"model": "model.<fqn>", "optimizer": "optim.state.<fqn>.{exp_avg,exp_avg_sq,step}, "
                     "optim.param_groups.<i>.<key>"},
        "model_type": "llama",
        "model_config": model_config,
        "model_config_full": full_model_config(Fixture(fx.name, "llama", model_config, {}, fx.world_size)),
        "model_init": "AutoModelForCausalLM.from_config(AutoConfig.for_model('llama', **model_config), "
                      "attn_implementation='eager', dtype=torch.float32) after torch.manual_seed(seed), "
                      "on every rank",
        "world_size": fx.world_size,
        "mesh": mesh,
        "parallelism": (("TP: parallelize_module on each decoder layer over mesh dim 'tp' with tp_plan; then "
                         if mesh["tp"] > 1 else "") +
                        "FSDP2: fully_shard(layer, mesh=dp mesh) for each decoder layer, then fully_shard(model)"),
        "tp_plan": report["tp_plan"],
        "saved_with": "msd, osd = torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer); "
                      "torch.distributed.checkpoint.save({'model': msd, 'optim': osd}, checkpoint_id=dir)",
        "steps": report["steps"],
        "adam_step": report["adam_step"],
        "seed": report["seed"],
        "data": {
            "kind": "fixed synthetic batch, same at every step",
            "recipe": "torch.randint(0, vocab_size, (micro_batch * batch_dp, seq_len), "
                      "generator=torch.Generator().manual_seed(seed + 1)); when dp divides the rows, dp rank "
                      "d takes its contiguous share, else every rank takes them all; tp peers take the same "
                      "rows; labels = input_ids",
            "seq_len": report["seq_len"],
            "micro_batch": report["micro_batch"],
            "batch_dp": report["batch_dp"],
            "local_batch_rows": report["local_batch_rows"],
        },
        "optimizer": report["optimizer"],
        "gradient_clipping": report["gradient_clipping"],
        "losses": report["losses"],  # mean over dp ranks: the global batch's loss
        "losses_rank0": report["losses_rank0"],
        "deepspeed_same_recipe": ds or None,
        "digests_of": "tests/e2e/digest.py digest() of the full fp32 tensors after the last step"
                      if fx.digests == "full" else "sha256 of the full fp32 row-major bytes after the last step",
        "digests": report["digests"],
        "params": report["params"],
        "versions": dict(versions(), **report["versions"]),
        "command": " ".join(["torchrun", "--standalone", "--nproc_per_node", str(fx.world_size),
                             "scripts/_fixture_dcp.py"] + [str(a) for a in command]),
        "metadata": dcp_metadata_summary(ckpt / ".metadata"),
        "files": {name: {"bytes": (ckpt / name).stat().st_size, "sha256": sha256(ckpt / name)} for name in files},
        "notes": fx.notes,
    }


def make_dcp_one(fx: DcpFixture, out_dir: Path, timeout_s: int, keep_tmp: bool) -> dict:
    """Generate one DCP fixture and swap it into ``out_dir / fx.name``; a summary dict."""
    work = Path(tempfile.mkdtemp(prefix=f"reshard-dcp-{fx.name}-"))
    log_path = work / "launch.log"
    t0 = time.time()
    try:
        ckpt, report_dir = work / "ckpt", work / "report"
        args = dcp_job_args("save", ckpt, report_dir, mesh=fx.mesh, steps=fx.steps, model=fx.model,
                            digests=fx.digests)
        log(f"{fx.name}: torchrun {fx.world_size} ranks (mesh {fx.mesh or fx.world_size}), work dir {work}")
        launch(torchrun_cmd(fx.world_size, DCP_SCRIPT, args), job_env(REPO), log_path, timeout_s)
        launch_s = time.time() - t0
        report = json.loads((report_dir / "report.json").read_text())
        files = check_dcp_checkpoint(ckpt, fx.world_size)
        # the command as recorded: paths relative to the fixture
        shown = dcp_job_args("save", Path("<dir>"), Path("<report>"), mesh=fx.mesh, steps=fx.steps,
                             model=fx.model, digests=fx.digests)
        meta = build_dcp_fixture_json(fx, ckpt, files, report, shown)
        (ckpt / "fixture.json").write_text(json.dumps(meta, indent=1) + "\n")
        dest = swap_into_place(ckpt, out_dir, fx.name)
        seconds = time.time() - t0
        log(f"{fx.name}: OK in {seconds:.1f}s (launch {launch_s:.1f}s); losses {report['losses']}")
        return {"name": fx.name, "ok": True, "seconds": seconds, "launch_seconds": launch_s,
                "timings": report.get("timings"), "dest": str(dest)}
    except Exception as exc:
        seconds = time.time() - t0
        log(f"{fx.name}: FAILED after {seconds:.1f}s: {exc}")
        keep_tmp = True
        return {"name": fx.name, "ok": False, "seconds": seconds, "error": str(exc), "log": str(log_path)}
    finally:
        if keep_tmp:
            log(f"{fx.name}: kept work dir {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", default=[], metavar="NAME",
                    help="generate only this fixture (repeatable; also accepts a comma-separated list)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"fixture root (default {DEFAULT_OUT})")
    ap.add_argument("--base-port", type=int, default=29710, help="first master port to try (one per launch)")
    ap.add_argument("--timeout", type=int, default=LAUNCH_TIMEOUT_S, help="seconds allowed per launch")
    ap.add_argument("--keep-tmp", action="store_true", help="keep the temporary work folders")
    ap.add_argument("--list", action="store_true", help="list the fixtures and exit")
    ap.add_argument("--no-patches", action="store_true",
                    help="run without the training-side model patches (to reproduce the failures they "
                         "work around); a fixture whose patch is needed then fails and is left alone")
    ap.add_argument("--bench-200m", type=Path, metavar="OUT_DIR",
                    help="instead of the fixtures, write a ~200M-parameter Llama ZeRO-1 DP=2 fp32 "
                         "checkpoint (1 step) to OUT_DIR/llama_200m_zero1_dp2")
    ap.add_argument("--bench-400m", type=Path, metavar="OUT_DIR",
                    help="instead of the fixtures, write a ~400M-parameter Llama ZeRO-1 DP=2 fp32 "
                         "checkpoint (1 step) to OUT_DIR/llama_400m_zero1_dp2")
    ap.add_argument("--bench-zero3-200m", type=Path, metavar="OUT_DIR",
                    help="instead of the fixtures, write the ~200M-parameter Llama as a ZeRO-3 DP=2 fp32 "
                         "checkpoint (1 step) to OUT_DIR/llama_200m_zero3_dp2")
    ap.add_argument("--dcp", action="store_true",
                    help="only the PyTorch DCP fixtures (FSDP2 / FSDP x TP under torchrun)")
    ap.add_argument("--dcp-out", type=Path, default=DEFAULT_DCP_OUT,
                    help=f"root of the DCP fixtures (default {DEFAULT_DCP_OUT})")
    ap.add_argument("--bench-dcp-200m", type=Path, metavar="OUT_DIR",
                    help="instead of the fixtures, write a ~200M-parameter Llama FSDP2 (2 ranks) fp32 DCP "
                         "checkpoint with Adam state (1 step) to OUT_DIR/llama_200m_dcp_ws2")
    args = ap.parse_args(argv)

    if args.list:
        for fx in FIXTURES:
            print(f"{fx.name:24s} {fx.model_type:12s} world={fx.world_size} tp={fx.tp} dp={fx.dp} "
                  f"zero={fx.zero_stage} bf16={'bf16' in fx.ds_config}")
        for dfx in DCP_FIXTURES:
            print(f"{dfx.name:24s} {'llama':12s} world={dfx.world_size} mesh={dfx.mesh or dfx.world_size} "
                  f"(PyTorch DCP, FSDP2{' x TP' if dfx.mesh else ''})")
        return 0

    ports = PortAllocator(args.base_port)

    bench = [(out, make_fx) for out, make_fx in ((args.bench_200m, bench_200m_fixture),
                                                 (args.bench_400m, bench_400m_fixture),
                                                 (args.bench_zero3_200m, bench_zero3_200m_fixture)) if out is not None]
    if bench or args.bench_dcp_200m is not None:
        ok = True
        for bench_out, make_fx in bench:
            res = make_one(make_fx(), bench_out, ports, max(args.timeout, 3600), args.keep_tmp)
            print(json.dumps(res, indent=1))
            ok = ok and res["ok"]
        if args.bench_dcp_200m is not None:
            res = make_dcp_one(bench_dcp_200m_fixture(), args.bench_dcp_200m, max(args.timeout, 3600),
                               args.keep_tmp)
            print(json.dumps(res, indent=1))
            ok = ok and res["ok"]
        return 0 if ok else 1

    names = [n for item in args.only for n in item.split(",") if n]
    unknown = [n for n in names if n not in BY_NAME and n not in DCP_BY_NAME]
    if unknown:
        ap.error(f"unknown fixture(s) {unknown}; known: {sorted(BY_NAME) + sorted(DCP_BY_NAME)}")
    if names:
        todo = [BY_NAME[n] for n in names if n in BY_NAME]
        dcp_todo = [DCP_BY_NAME[n] for n in names if n in DCP_BY_NAME]
    else:
        todo = [] if args.dcp else list(FIXTURES)
        dcp_todo = list(DCP_FIXTURES)
    if args.dcp:
        todo = []

    results = []
    for fx in todo:
        fx = copy.deepcopy(fx)
        if args.no_patches:
            fx.patches = []
        results.append(make_one(fx, args.out, ports, args.timeout, args.keep_tmp))
    for dfx in dcp_todo:
        results.append(make_dcp_one(dfx, args.dcp_out, args.timeout, args.keep_tmp))

    print()
    log("summary:")
    for r in results:
        status = "ok    " if r["ok"] else "FAILED"
        extra = "" if r["ok"] else f"  ({r['error'].splitlines()[0]})"
        log(f"  {status} {r['name']:24s} {r['seconds']:6.1f}s{extra}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
