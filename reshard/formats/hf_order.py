"""The parameter order of the model a transformers ``config.json`` describes: what a DeepSpeed
ZeRO-1/2 engine flattens its optimizer's fp32 partitions in (``model.parameters()``), and what
torch's ``dcp.save`` of ``get_state_dict`` lists entries in. A source in Hugging Face names that
does not keep that order itself (a Megatron checkpoint read in HF names follows its mapping
document) tells it from here, so a target that follows it loads each state into its own parameter."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["hf_model_order", "in_model_order"]


def hf_model_order(cfg: dict[str, Any] | None) -> list[str] | None:
    """``named_parameters()`` of the model ``cfg`` describes, built by transformers on the meta
    device (no weights, no remote code); ``None`` when it cannot be built."""
    if not cfg or "model_type" not in cfg:
        return None
    try:
        import transformers
    except ImportError:
        return None
    try:
        config = transformers.AutoConfig.for_model(cfg["model_type"],
                                                   **{k: v for k, v in cfg.items() if k != "model_type"})
        arch = (cfg.get("architectures") or [None])[0]
        cls = getattr(transformers, arch) if arch else transformers.AutoModelForCausalLM
        with torch.device("meta"):
            model = cls(config) if arch else cls.from_config(config)
    except Exception:  # noqa: BLE001 -- an architecture transformers cannot build: order unknown
        return None
    return [n for n, _ in model.named_parameters()]


def in_model_order(names: Sequence[str], order: Sequence[str] | None) -> list[str] | None:
    """``names`` in ``order`` (the model's), those the model does not hold after, in their own order;
    ``None`` where there is no order or the model holds none of them (not this model's names)."""
    if order is None:
        return None
    held = set(names)
    first = [n for n in order if n in held]
    if not first:
        return None
    placed = set(first)
    return first + [n for n in names if n not in placed]
