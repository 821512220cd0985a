"""The parameter order of the model a transformers ``config.json`` describes: what a DeepSpeed
ZeRO-1/2 engine flattens its optimizer's fp32 partitions in (``model.parameters()``), and what
torch's ``dcp.save`` of ``get_state_dict`` lists entries in. A source in Hugging Face names that
does not keep that order itself (a Megatron checkpoint read in HF names follows its mapping
document) tells it from here, so a target that follows it loads each state into its own parameter."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

__all__ = ["HfKeys", "hf_model_keys", "hf_model_order", "in_model_order"]


@dataclass(frozen=True, slots=True)
class HfKeys:
    """What ``from_pretrained`` of the model a config describes loads: its parameters in
    ``named_parameters()`` order, every ``state_dict`` key (persistent buffers too), the keys that
    are a tied parameter's second name (``lm_head.weight`` where the embeddings are tied: loaded
    from the first), and the patterns of keys it lets a folder lack or hold beyond them (the class's
    ``_keys_to_ignore_on_load_missing`` / ``_unexpected``)."""

    order: tuple[str, ...]
    keys: frozenset[str]
    aliases: frozenset[str] = frozenset()
    may_lack: tuple[str, ...] = ()
    may_hold: tuple[str, ...] = ()
    buffers: tuple[str, ...] = ()  # persistent buffers (state_dict keys no parameter is), in state_dict order

    def missing(self, names: Sequence[str]) -> list[str]:
        """The keys ``from_pretrained`` would leave at their initial value given ``names``."""
        have = set(names)
        return [k for k in sorted(self.keys) if k not in have and k not in self.aliases
                and not any(re.search(p, k) for p in self.may_lack)]

    def unexpected(self, names: Sequence[str]) -> list[str]:
        """The ``names`` ``from_pretrained`` would ignore (no key of the model)."""
        return [n for n in names if n not in self.keys and not any(re.search(p, n) for p in self.may_hold)]


def hf_model_keys(cfg: dict[str, Any] | None) -> HfKeys | None:
    """:class:`HfKeys` of the model ``cfg`` describes, built by transformers on the meta device (no
    weights, no remote code); ``None`` when it cannot be built."""
    if not cfg or "model_type" not in cfg:
        return None
    try:
        text = json.dumps(cfg, sort_keys=True)
    except (TypeError, ValueError):
        return None
    return _keys(text)


@lru_cache(maxsize=8)
def _keys(text: str) -> HfKeys | None:
    cfg = json.loads(text)
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
    except Exception:  # noqa: BLE001 -- an architecture transformers cannot build: keys unknown
        return None
    order = tuple(n for n, _ in model.named_parameters())
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    aliases = frozenset(params) - set(order)
    keys = list(model.state_dict())
    return HfKeys(order, frozenset(keys), aliases,
                  tuple(getattr(model, "_keys_to_ignore_on_load_missing", None) or ()),
                  tuple(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()),
                  tuple(k for k in keys if k not in params))


def hf_model_order(cfg: dict[str, Any] | None) -> list[str] | None:
    """``named_parameters()`` of the model ``cfg`` describes (:func:`hf_model_keys`); ``None`` when
    it cannot be built."""
    keys = hf_model_keys(cfg)
    return None if keys is None else list(keys.order)


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
