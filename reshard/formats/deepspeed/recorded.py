"""What the layout and ZeRO-stage checks read of a DeepSpeed checkpoint (``layout``, ``zero12``,
``zero3``): its files as ``checkpoint.DeepSpeedCheckpoint`` loads them, and what it derives from
them. A protocol, so that the modules the checkpoint builds its layout on need not import it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # annotations only: neither module imports a check
    import torch

    from ...ir.param_map import ParamMap
    from .experts import AutoEP
    from .moe import ClassicMoE

__all__ = ["Recorded"]


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

    def model_state(self, tp: int) -> dict: ...

    def optim_state(self, tp: int, dp: int) -> dict: ...

    def osd(self, tp: int, dp: int) -> dict: ...

    def groups(self, t: int) -> list[dict[str, tuple[int, ...]]]: ...

    def module_tensor(self, name: str, t: int) -> torch.Tensor | None: ...

    def stage_map(self, name: str) -> ParamMap: ...

    def check_steps(self) -> None: ...

    def check_layer_files(self) -> None: ...
