"""MoE layers as a source's names and shapes show them (``contract.Reader.expert_layers`` of a
source in Hugging Face names: an HF folder, DCP, a Megatron checkpoint read in HF names).
transformers 5 holds an MoE block's experts fused, as tensors of one module named ``experts``, each
``[num_experts, ...]`` (``<module>.experts.gate_up_proj``, ``<module>.experts.down_proj``); the Hub
(what ``save_pretrained`` writes) holds each expert apart, ``<module>.experts.<e>.<tensor>``.
Which target names they take is the target's (DeepSpeed AutoEP: ``deepspeed/autoep.json``)."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from ..errors import CheckpointError
from .contract import ExpertLayer

__all__ = ["fused_expert_layers"]

_APART = re.compile(r"(?P<module>.+)\.experts\.(?P<expert>\d+)\.(?P<rest>.+)")


def fused_expert_layers(names: Sequence[str], shape: Callable[[str], tuple[int, ...]],
                        where: str) -> tuple[ExpertLayer, ...]:
    """Each module holding experts, in the order the names first reach it: fused
    (``<module>.experts.<tensor>``, at least 3 dims, agreeing on dim 0) or apart
    (``<module>.experts.<e>.<tensor>``, every tensor for every expert ``0 .. E-1``: ``apart``), as an
    :class:`ExpertLayer` without a framework record. Refused, naming the tensors, where a module's
    fused tensors disagree on the expert count or an expert lacks a tensor the others hold."""
    fused: dict[str, list[str]] = {}
    apart: dict[str, dict[str, set[int]]] = {}
    order: list[str] = []
    for n in names:
        module, sep, leaf = n.rpartition(".experts.")
        m = _APART.fullmatch(n)
        if sep and "." not in leaf and len(shape(n)) >= 3:
            fused.setdefault(module, []).append(n)
        elif m is not None:
            module = m["module"]
            apart.setdefault(module, {}).setdefault(m["rest"], set()).add(int(m["expert"]))
        else:
            continue
        if module not in order:
            order.append(module)
    out = []
    for i, module in enumerate(order):
        if module in fused:
            params = fused[module]
            counts = {n: shape(n)[0] for n in params}
            if len(set(counts.values())) != 1:
                raise CheckpointError(f"{where}: {module}.experts: its fused expert tensors disagree on the expert "
                                      f"count (dim 0): {counts}")
            out.append(ExpertLayer(i, module, counts[params[0]], tuple(params), {}))
            continue
        tensors = apart[module]
        num = 1 + max(max(e) for e in tensors.values())
        for rest, have in tensors.items():
            missing = sorted(set(range(num)) - have)
            if missing:
                raise CheckpointError(f"{where}: {module}.experts.{missing[0]}.{rest}: missing, which experts "
                                      f"{sorted(have)[:4]} hold ({num} experts)")
        out.append(ExpertLayer(i, module, num, tuple(f"{module}.experts.{{expert}}.{rest}" for rest in tensors), {},
                               apart=True))
    return tuple(out)
