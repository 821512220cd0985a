"""The check every DeepSpeed kind's reader runs on its model-state files' ``module`` (dense ZeRO-1/2
and ZeRO-3, classic MoE, AutoEP): a leaf module, so that ``zero12``, ``zero3`` and ``moe`` share it
without importing one another or the checkpoint."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ...errors import UnplacedError

__all__ = ["check_module_entries"]


def check_module_entries(path: Path, state: Mapping[str, Any], params: Any, rank0: Mapping[str, Any] | None = None
                         ) -> None:
    """Every entry of a model-state file's ``module`` is an optimized parameter (``params``), a
    module buffer (``buffer_names``), a tied alias (``shared_params``) or a frozen parameter
    (``frozen_param_shapes``) -- as the file records them, or as model-parallel rank 0's does
    (``rank0``: DeepSpeed records a TP-replicated tied alias there alone) -- any other would be
    carried into every output as if it were a weight, so it is refused, naming the file and entries."""
    known = set(params)
    for s in (state, rank0 or {}):
        known |= set(s.get("buffer_names") or ()) | set(s.get("shared_params") or {})
        known |= set(s.get("frozen_param_shapes") or {})
    unknown = [k for k in (state.get("module") or {}) if k not in known]
    if unknown:
        raise UnplacedError(f"{path}: module entries {unknown[:3]} are neither optimized parameters, buffers, "
                            "tied aliases nor frozen parameters: model weights no DeepSpeed target has a place "
                            "for (not supported)", entries=tuple(unknown))
