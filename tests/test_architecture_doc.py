"""docs/architecture.md draws every folder of the package and names every module in it: a module
added without a place in the drawing fails here, not in a reader's head."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _drawing() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text()
    start = text.index("```")
    return text[start:text.index("```", start + 3)]


def test_every_folder_and_module_is_in_the_drawing() -> None:
    drawing = _drawing()
    words = set(re.findall(r"[A-Za-z_0-9]+", drawing))
    package = ROOT / "reshard"
    missing = []
    for path in sorted(package.rglob("*.py")):
        if "__pycache__" in path.parts or path.name.startswith("__"):
            continue
        if path.stem not in words:
            missing.append(str(path.relative_to(ROOT)))
    for folder in sorted(p for p in package.rglob("*") if p.is_dir() and p.name != "__pycache__"):
        if f"{folder.name}/" not in drawing:
            missing.append(f"{folder.relative_to(ROOT)}/")
    assert not missing, f"docs/architecture.md's drawing does not name {missing}"
