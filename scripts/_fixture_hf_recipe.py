"""The recipe shared by the Hugging Face fixtures (``scripts/make_hf_fixtures.py``), their job
scripts (``_fixture_hf_trainer.py``, ``_fixture_hf_fsdp.py``, ``_fixture_hf_pretrained.py``) and
the end-to-end resume harness (``tests/e2e/hf_resume.py``).

Everything here is built locally and deterministically: the model from a ``transformers`` config
(random init after ``transformers.set_seed(seed)``), a tiny word-level tokenizer trained with
``tokenizers`` on :data:`CORPUS`, a map-style dataset of fixed random token ids, the probe batch
the reference logits are computed on, and the Trainer's ``TrainingArguments`` / DeepSpeed config.
Nothing is downloaded (``HF_HUB_OFFLINE=1``).

A fixture's ``fixture.json`` stores the recipe as a plain dict (``recipe``) that
:func:`training_arguments`, :func:`build_model`, :func:`build_dataset` and :func:`probe_ids` take
back, so a later job can rebuild the same Trainer setup.
"""

from __future__ import annotations

import copy
import os

import torch

SEED = 1234
SEQ_LEN = 16
DATASET_ROWS = 32  # 8 steps of a global batch of 4: the resumed runs stay inside epoch 0
PROBE_ROWS = 2  # the reference logits' batch: PROBE_ROWS x SEQ_LEN ids
FIRST_ID = 4  # ids 0..3 are the special tokens; the random data avoids them

# Tiny, with pairwise distinct sizes so a transposed axis cannot go unnoticed: hidden 32, q 24
# (4 heads of head_dim 6), kv 12 (GQA: 2 kv heads), intermediate 72, vocab 128.
LLAMA = {
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 6,
    "num_hidden_layers": 2,
    "intermediate_size": 72,
    "vocab_size": 128,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# Qwen2 (q/k/v carry a bias) with tied input/output embeddings; head_dim is Qwen2's default
# hidden / heads = 8 (q 32, kv 16).
QWEN2_TIED = {
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "intermediate_size": 72,
    "vocab_size": 128,
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# DeepSeek-V3 attention (MLA), dense (first_k_dense_replace = layers): q 32 -> 16 -> 4 x (6 + 4),
# kv 32 -> 12 + 4 (the key's rope part) -> 4 x (6 + 8), out 4 x 8 -> 32; rope part interleaved
# (rope_interleave, Megatron's MLA layout); eps 1e-6, the latent norms' fixed one.
DEEPSEEK_V3 = {
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
    "first_k_dense_replace": 2,
    "n_routed_experts": 1,
    "n_shared_experts": 0,
    "num_experts_per_tok": 1,
    "n_group": 1,
    "topk_group": 1,
    "moe_intermediate_size": 16,
    "rope_interleave": True,
    "rms_norm_eps": 1e-6,
    "vocab_size": 128,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# Mixtral, the DeepSpeed AutoEP fixture's shape (../deepspeed/mixtral_autoep_ep2): 4 experts top-2,
# untied; what save_pretrained writes of it is the Hub's per-expert layout (block_sparse_moe.experts.<e>)
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
    "max_position_embeddings": 64,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# Qwen3-MoE, the DeepSpeed AutoEP fixture's shape (../deepspeed/qwen3_moe_autoep_ep2): 4 experts top-2, expert ffn
# 24, q/k norms, untied; save_pretrained writes the Hub's per-expert layout (mlp.experts.<e>.gate_proj/up_proj/down_proj)
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
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# DeepSeek-V3 with MoE, the DeepSpeed AutoEP fixture's shape (../deepspeed/deepseek_v3_autoep_ep2): layer 0 dense,
# layer 1 4 routed experts top-2 (ffn 16) + one shared expert, the router's e_score_correction_bias
DEEPSEEK_V3_MOE = dict(DEEPSEEK_V3, first_k_dense_replace=1, n_routed_experts=4, n_shared_experts=1,
                       num_experts_per_tok=2, vocab_size=96)

# Qwen2-MoE, the DeepSpeed AutoEP fixture's shape (../deepspeed/qwen2_moe_autoep_ep2): QWEN3_MOE's sizes without
# head_dim, a shared expert of ffn 40 and its gate
QWEN2_MOE = dict({k: v for k, v in QWEN3_MOE.items() if k != "head_dim"}, shared_expert_intermediate_size=40)

# DeepSeek-V2, the DeepSpeed AutoEP fixture's shape (../deepspeed/deepseek_v2_autoep_ep2): DEEPSEEK_V3_MOE's sizes,
# softmax router without a bias, head_dim the rope head
DEEPSEEK_V2 = dict({k: v for k, v in DEEPSEEK_V3_MOE.items() if k not in ("n_group", "topk_group", "rope_interleave")},
                   head_dim=4)

# Qwen3.5-MoE's text backbone (model_type qwen3_5_moe_text), the DeepSpeed AutoEP fixture's shape
# (../deepspeed/qwen3_5_moe_autoep_ep2): a linear-attention layer, then a full-attention one, both MoE with a shared
# expert and its gate
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
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# MiniMax-M3's text backbone (model_type minimax_m3_vl_text), the DeepSpeed AutoEP fixture's shape
# (../deepspeed/minimax_m3_autoep_ep2): a dense layer, then 4 experts top-2, a shared expert, the router's bias
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
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

MODELS = {"llama": LLAMA, "qwen2_tied": QWEN2_TIED, "deepseek_v3": DEEPSEEK_V3, "mixtral": MIXTRAL,
          "qwen3_moe": QWEN3_MOE, "deepseek_v3_moe": DEEPSEEK_V3_MOE,
          "qwen2_moe": QWEN2_MOE, "deepseek_v2": DEEPSEEK_V2, "qwen3_5_moe": QWEN3_5_MOE, "minimax_m3": MINIMAX_M3}
MODEL_TYPES = {"llama": "llama", "qwen2_tied": "qwen2", "deepseek_v3": "deepseek_v3", "mixtral": "mixtral",
               "qwen3_moe": "qwen3_moe", "deepseek_v3_moe": "deepseek_v3",
               "qwen2_moe": "qwen2_moe", "deepseek_v2": "deepseek_v2", "qwen3_5_moe": "qwen3_5_moe_text",
               "minimax_m3": "minimax_m3_vl_text"}

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a checkpoint is a snapshot of the training state",
    "reshard moves tensor shards between parallel layouts exactly",
    "zero three partitions every parameter over the data parallel ranks",
    "hello world",
]


def deterministic_torch() -> None:
    """One intra-op thread and deterministic kernels where torch has them: reductions inside
    matmuls then do not depend on the thread split, so reruns give the same bytes."""
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True, warn_only=True)


def offline_env() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def build_tokenizer():
    """A ``PreTrainedTokenizerFast`` around a word-level ``tokenizers`` model trained on CORPUS
    (special tokens first: <pad>=0, <s>=1, </s>=2, <unk>=3)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(CORPUS, trainers.WordLevelTrainer(special_tokens=SPECIAL_TOKENS, show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", model_max_length=64)


def model_config(recipe: dict):
    from transformers import AutoConfig

    return AutoConfig.for_model(recipe["model_type"], **recipe["model_config"])


def build_model(recipe: dict, dtype: torch.dtype = torch.float32):
    """The recipe's model, random init after ``transformers.set_seed(seed)``, eager attention."""
    from transformers import AutoModelForCausalLM, set_seed

    set_seed(int(recipe["seed"]))
    model = AutoModelForCausalLM.from_config(model_config(recipe), attn_implementation="eager", dtype=dtype)
    return model


def dataset_ids(recipe: dict) -> torch.Tensor:
    """``[DATASET_ROWS, seq_len]`` int64 ids in ``[FIRST_ID, vocab)`` from
    ``Generator().manual_seed(seed + 1)``."""
    data = recipe["data"]
    gen = torch.Generator().manual_seed(int(recipe["seed"]) + 1)
    vocab = int(recipe["model_config"]["vocab_size"])
    return torch.randint(FIRST_ID, vocab, (int(data["rows"]), int(data["seq_len"])), generator=gen)


class FixedDataset(torch.utils.data.Dataset):
    """Row ``i`` of :func:`dataset_ids` as ``{"input_ids", "labels"}`` (labels = ids: the HF model
    shifts them for the causal-LM loss); no padding, so every row has ``seq_len - 1`` targets."""

    def __init__(self, ids: torch.Tensor):
        self.ids = ids

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def __getitem__(self, i: int) -> dict:
        row = self.ids[i]
        return {"input_ids": row, "labels": row.clone()}


def build_dataset(recipe: dict) -> FixedDataset:
    return FixedDataset(dataset_ids(recipe))


def probe_ids(recipe: dict) -> torch.Tensor:
    """The fixed batch the reference logits are computed on: ``[PROBE_ROWS, seq_len]`` ids in
    ``[0, vocab)`` from ``Generator().manual_seed(seed + 2)``."""
    gen = torch.Generator().manual_seed(int(recipe["seed"]) + 2)
    vocab = int(recipe["model_config"]["vocab_size"])
    return torch.randint(0, vocab, (PROBE_ROWS, int(recipe["data"]["seq_len"])), generator=gen)


def ds_config(stage: int, *, bf16: bool = False) -> dict:
    """The DeepSpeed config handed to ``TrainingArguments(deepspeed=...)``: Trainer fills every
    ``"auto"`` from the arguments (batch sizes, lr, betas, eps, weight decay, clipping, bf16).
    ``torch_adam`` makes DeepSpeed use plain ``torch.optim.AdamW`` (no extension to build)."""
    cfg = {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto", "torch_adam": True},
        },
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1000,
        "wall_clock_breakdown": False,
    }
    if bf16:
        cfg["bf16"] = {"enabled": "auto"}
    return cfg


def trainer_recipe(model: str, stage: int, *, bf16: bool = False, world_size: int = 2, stop_at: int = 3,
                   max_steps: int = 6, save_steps: int = 3, save_total_limit: int | None = None,
                   micro_batch: int = 2) -> dict:
    """The whole recipe of one Trainer fixture, JSON-able."""
    return {
        "kind": "trainer-deepspeed",
        "model_type": "qwen2" if model.startswith("qwen2") else "llama",
        "model_config": MODELS[model],
        "seed": SEED,
        "data": {"rows": DATASET_ROWS, "seq_len": SEQ_LEN, "first_id": FIRST_ID},
        "world_size": world_size,
        # The run is planned for max_steps and stopped (TrainerControl.should_training_stop, set in
        # on_save) right after the checkpoint of step stop_at is written: an interrupted run.
        "stop_at": stop_at,
        "training_args": {
            "per_device_train_batch_size": micro_batch,
            "gradient_accumulation_steps": 1,
            "max_steps": max_steps,
            "learning_rate": 1e-3,
            "weight_decay": 0.01,
            "adam_beta1": 0.9,
            "adam_beta2": 0.999,
            "adam_epsilon": 1e-8,
            "max_grad_norm": 1.0,
            "lr_scheduler_type": "linear",
            "warmup_steps": 0,
            "logging_steps": 1,
            "save_strategy": "steps",
            "save_steps": save_steps,
            "save_total_limit": save_total_limit,
            "seed": SEED,
            "bf16": bf16,
        },
        "ds_config": ds_config(stage, bf16=bf16),
    }


def training_arguments(recipe: dict, output_dir: str, *, ds_config_override: dict | None = None,
                       **overrides):
    """``TrainingArguments`` of the recipe on CPU/gloo under DeepSpeed (``ds_config_override``
    replaces the recipe's DeepSpeed config; ``overrides`` replace training arguments)."""
    from transformers import TrainingArguments

    kwargs = dict(recipe["training_args"])
    kwargs.update(overrides)
    ds = copy.deepcopy(ds_config_override if ds_config_override is not None else recipe["ds_config"])
    return TrainingArguments(
        output_dir=output_dir,
        use_cpu=True,
        ddp_backend="gloo",
        deepspeed=ds,
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        **kwargs,
    )


def fsdp_recipe(model: str = "llama", world_size: int = 2, stop_at: int = 3, max_steps: int = 6) -> dict:
    """The recipe of the Accelerate FSDP fixture: the Trainer fixtures' model, data and
    optimizer settings (``training_args``), without DeepSpeed."""
    recipe = trainer_recipe(model, 0, world_size=world_size, stop_at=stop_at, max_steps=max_steps)
    recipe["kind"] = "accelerate-fsdp2"
    del recipe["ds_config"]
    return recipe


def pretrained_recipe(model: str, *, dtype: str = "float32", max_shard_size: str | None = None) -> dict:
    """The recipe of a ``save_pretrained`` folder: the model at initialisation (no training)."""
    return {
        "kind": "save_pretrained",
        "model_type": MODEL_TYPES[model],
        "model_config": MODELS[model],
        "seed": SEED,
        "data": {"rows": DATASET_ROWS, "seq_len": SEQ_LEN, "first_id": FIRST_ID},
        "dtype": dtype,
        "max_shard_size": max_shard_size,
    }
