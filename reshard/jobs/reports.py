"""What a job returns: the one report every route builds (``jobs.engine.run``), printed as the
command's last line(s)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Drift", "Report"]


@dataclass
class Drift:
    """One parameter state whose replicated copies differ between (TP) ranks."""

    param: str
    state: str
    ranks: tuple[int, ...]
    max_abs_diff: float

    def __str__(self) -> str:
        return f"{self.param} ({self.state}): ranks {list(self.ranks)} differ by up to {self.max_abs_diff:g}"


def _topology(x: dict[str, Any]) -> str:
    # a target without data parallelism (an inference engine's shards) records no DP: it is one replica
    text = f"TP={x['tp']} x DP={x.get('dp', 1)}" + (f" x PP={x['pp']}" if x.get("pp", 1) > 1 else "")
    if "zero_stage" in x:
        text += f" ZeRO-{x['zero_stage']}"
    return text


@dataclass
class Report:
    """``source`` and ``target`` are the two topologies (``{"tp", "dp", "pp", "zero_stage", ...}``;
    ``{}`` for a format without one), ``source_description`` the source in words; ``not_carried``
    and ``dropped`` the keys of the source entries not written (``jobs.accounted``; the notes say
    why, the manifest records each)."""

    out_dir: Path
    source: dict[str, Any]
    target: dict[str, Any]
    params: int
    files: int
    bytes_written: int
    segments: int = 0
    elements_read: int = 0
    policy: str = "error"
    drift: list[Drift] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    source_description: str = ""
    target_format: str = ""
    not_carried: list[str] = field(default_factory=list)  # source entries the target has no place for
    dropped: list[str] = field(default_factory=list)  # source entries left out by --drop

    def __str__(self) -> str:
        size = f"{self.params} parameters, {self.files} files, {self.bytes_written / 2**20:.1f} MiB"
        if "tp" in self.source and "tp" in self.target:
            head = (f"wrote {self.out_dir}: {_topology(self.source)} -> {_topology(self.target)} ({size}, "
                    f"{self.segments} plan segments)")
        else:
            head = f"wrote {self.out_dir} ({size})"
        lines = [head]
        if self.drift:
            lines.append(f"replica drift resolved by '{self.policy}' (recorded in the manifest):")
            lines += [f"  {d}" for d in self.drift]
        if self.not_carried or self.dropped:
            lines.append(f"not written: {len(self.not_carried)} source entries not carried, {len(self.dropped)} "
                         "dropped (each with its reason in the notes and the manifest)")
        return "\n".join(lines)


def written(folder: Path, *, manifest: bool = True) -> tuple[int, int]:
    """How many files a committed output folder holds, and their bytes (with or without the
    manifest)."""
    files = [p for p in folder.rglob("*") if p.is_file() and (manifest or p.name != "reshard-manifest.json")]
    return len(files), sum(p.stat().st_size for p in files)
