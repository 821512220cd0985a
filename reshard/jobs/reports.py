"""What a job returns: ``reshard convert``'s and ``reshard reshard``'s reports, which print as the
command's last line(s). Their own module so every job (``convert``, ``offline``, ``offline_zero3``)
builds the same report without importing another job."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["ConvertReport", "Drift", "ReshardReport"]


@dataclass
class Drift:
    param: str
    state: str
    ranks: tuple[int, ...]
    max_abs_diff: float

    def __str__(self) -> str:
        return f"{self.param} ({self.state}): ranks {list(self.ranks)} differ by up to {self.max_abs_diff:g}"


@dataclass
class ConvertReport:
    out_dir: Path
    params: int
    files: int
    bytes_written: int
    policy: str
    drift: list[Drift] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"wrote {self.out_dir} ({self.params} parameters, {self.files} files, "
                 f"{self.bytes_written / 2**20:.1f} MiB)"]
        if self.drift:
            lines.append(f"replica drift resolved by '{self.policy}' (recorded in the manifest):")
            lines += [f"  {d}" for d in self.drift]
        return "\n".join(lines)


def written(folder: Path, *, manifest: bool = True) -> tuple[int, int]:
    """How many files a committed output folder holds, and their bytes (with or without the
    manifest)."""
    files = [p for p in folder.rglob("*") if p.is_file() and (manifest or p.name != "reshard-manifest.json")]
    return len(files), sum(p.stat().st_size for p in files)


@dataclass
class ReshardReport:
    out_dir: Path
    source: dict
    target: dict
    params: int
    files: int
    bytes_written: int
    segments: int
    elements_read: int = 0
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        def topo(x: dict) -> str:
            return f"TP={x['tp']} x DP={x['dp']}" + (f" x PP={x['pp']}" if x.get("pp", 1) > 1 else "")

        s, t = self.source, self.target
        return (f"wrote {self.out_dir}: {topo(s)} ZeRO-{s['zero_stage']} -> {topo(t)} "
                f"ZeRO-{t['zero_stage']} ({self.params} parameters, {self.files} files, "
                f"{self.bytes_written / 2**20:.1f} MiB, {self.segments} plan segments)")
