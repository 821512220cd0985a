"""Grouped-GEMM experts (``--moe-grouped-gemm``), as Megatron-Core 0.19.2 saves them.

* Under ``--transformer-impl local`` the flag changes nothing: ``LocalSpecProvider.
  grouped_mlp_modules`` returns ``SequentialMLP`` whatever it says (``models/backends.py``), so
  the checkpoint is a SequentialMLP one with ``args.moe_grouped_gemm = True``
  (``torch_dist_moe_ep2_grouped_gemm_local``): read and written as such.
* Under Transformer Engine (``TEGroupedMLP``) the ``torch_dist`` keys are SequentialMLP's:
  ``TEGroupedMLP.sharded_state_dict`` renames ``linear_fc1.`` to ``experts.linear_fc1.`` and
  ``TEGroupedLinear._sharded_state_dict_grouped`` gives each ``weight<i>`` the key
  ``linear_fc1.weight`` at the global expert's offset (the SwiGLU factory per expert, as
  ``MLP``), and each ``_extra_state`` the per-expert object key. So model keys, plain Adam's and
  ``fully_reshardable``'s states (model space) are read and written alike. What differs is
  refused by name: the DDP bucket order of ``dp_reshardable`` (a grouped linear registers
  ``weight0..N-1`` of fc1, then of fc2: not expert by expert), legacy files (state-dict names
  ``linear_fc1.weight<i>``), and one grouped parameter (``moe_single_grouped_weight`` / ``_bias``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["TE_GROUPED", "te_grouped"]

TE_GROUPED = "grouped-GEMM experts under Transformer Engine (TEGroupedMLP)"


def te_grouped(args: Any) -> bool:
    """Whether the experts are TEGroupedMLP's (not SequentialMLP's)."""
    return bool(getattr(args, "moe_grouped_gemm", False) and getattr(args, "num_experts", None)
                and getattr(args, "transformer_impl", "transformer_engine") != "local")
