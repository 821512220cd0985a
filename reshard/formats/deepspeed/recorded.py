"""What the layout and ZeRO-stage checks read of a DeepSpeed checkpoint (``layout``, ``zero12``,
``zero3``): its files as ``checkpoint.DeepSpeedCheckpoint`` loads them, and what it derives from
them. A protocol, so that the modules the checkpoint builds its layout on need not import it; and
``first_difference``, how every check compares two of its records (here, so that ``checks`` and
``folding`` share it without importing each other)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # annotations only: neither module imports a check
    import torch

    from ...ir.param_map import ParamMap
    from .experts import AutoEP
    from .frozen import Frozen
    from .moe import ClassicMoE

__all__ = ["Recorded", "first_difference"]


class Recorded(Protocol):
    """A DeepSpeed checkpoint's files: the tag folder, its topology and each rank's files
    (``model_files[m]``, ``optim_files[(m, d)]``, ZeRO-3's ``z3_model_files[(m, d)]``), each read once."""

    tag_dir: Path
    zero_stage: int
    tp: int
    dp: int
    pp: int
    model_files: dict[int, Path]
    optim_files: dict[tuple[int, int], Path]
    z3_model_files: dict[tuple[int, int], Path]

    @property
    def mp(self) -> int: ...

    @property
    def pipe(self) -> bool: ...

    @property
    def experts(self) -> AutoEP | None: ...

    @property
    def moe(self) -> ClassicMoE | None: ...

    @property
    def frozen(self) -> Frozen: ...

    def model_state(self, tp: int) -> dict: ...

    def optim_state(self, tp: int, dp: int) -> dict: ...

    def osd(self, tp: int, dp: int) -> dict: ...

    def groups(self, t: int) -> list[dict[str, tuple[int, ...]]]: ...

    def module_tensor(self, name: str, t: int) -> torch.Tensor | None: ...

    def stage_map(self, name: str) -> ParamMap: ...

    def check_steps(self) -> None: ...

    def check_layer_files(self) -> None: ...


def first_difference(a: Any, b: Any, at: str) -> str | None:
    """The JSON path of the first place ``a`` and ``b`` differ (``None`` when equal)."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        for k in [*a, *(k for k in b if k not in a)]:
            if k not in a or k not in b:
                return f"{at}.{k}"
            got = first_difference(a[k], b[k], f"{at}.{k}")
            if got is not None:
                return got
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):  # docs/spec.md §5: ``pieces.0``, ``source[0]``
            got = first_difference(x, y, f"{at}.{i}" if at.endswith(".pieces") else f"{at}[{i}]")
            if got is not None:
                return got
        return None
    return None if type(a) is type(b) and a == b else at

