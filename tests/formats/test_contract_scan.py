"""The reader contract is the whole interface (issue 32): outside a format's own ``reader.py``,
code asks a reader only what ``formats.contract.Reader`` declares, and every parameter named
``reader`` is typed ``Reader`` (so mypy, in ``make test``, checks each attribute read of it)."""

from __future__ import annotations

import ast
from pathlib import Path

from reshard.formats.contract import Reader, Writer

ROOT = Path(__file__).resolve().parents[2] / "reshard"
DECLARED = {n for n in dir(Reader) if not n.startswith("__")} | set(Reader.__annotations__)
WRITER = {n for n in dir(Writer) if not n.startswith("__")} | set(Writer.__annotations__)


def _is(node: ast.AST, var: str) -> bool:
    return (isinstance(node, ast.Name) and node.id == var) or (isinstance(node, ast.Attribute) and node.attr == var)


def undeclared_reads(source: str, var: str = "reader", declared: set[str] = DECLARED) -> list[str]:
    """``reader.X`` / ``self.reader.X`` reads and ``getattr``/``hasattr(reader, "X")`` probes of an X
    the contract does not declare (``var="writer"``: the same of a writer)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        attr = None
        if isinstance(node, ast.Attribute) and _is(node.value, var) and not node.attr.startswith("__"):
            attr = node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) >= 2 and _is(node.args[0], var) and isinstance(node.args[1], ast.Constant)):
            attr = str(node.args[1].value)
        if attr is not None and attr not in declared:
            found.append(f"{attr} (line {node.lineno})")
    return found


def untyped_readers(source: str) -> list[str]:
    """Parameters named ``reader`` not annotated ``Reader``: ``Any`` (or nothing) would let any
    attribute read pass the type check."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs):
                if a.arg == "reader" and not (isinstance(a.annotation, ast.Name) and a.annotation.id == "Reader"):
                    found.append(f"{node.name} (line {node.lineno})")
    return found


def _modules() -> list[Path]:
    return [p for p in sorted(ROOT.rglob("*.py")) if p.name != "reader.py" and p.name != "contract.py"]


def test_no_code_outside_a_reader_reads_what_the_contract_does_not_declare():
    bad = {str(p.relative_to(ROOT)): f for p in _modules() if (f := undeclared_reads(p.read_text()))}
    assert bad == {}, f"declare these in formats/contract.py's Reader (or ask the contract): {bad}"


def test_the_jobs_ask_a_writer_only_what_the_contract_declares():
    jobs = sorted((ROOT / "jobs").glob("*.py"))
    bad = {p.name: f for p in jobs if (f := undeclared_reads(p.read_text(), "writer", WRITER))}
    assert bad == {}, f"declare these in formats/contract.py's Writer: {bad}"


def test_every_reader_parameter_is_typed_with_the_contract():
    typed = [p for p in _modules() if p.relative_to(ROOT).parts[0] in ("formats", "jobs", "present")]
    bad = {str(p.relative_to(ROOT)): f for p in typed if (f := untyped_readers(p.read_text()))}
    assert bad == {}, f"type these parameters formats.contract.Reader: {bad}"


def test_the_scan_catches_a_probe_an_internal_read_and_an_any_typed_reader():
    planted = ("from typing import Any\n"
               "def build(reader: Any, other: int) -> None:\n"
               "    reader.ck.tag_dir\n"
               "    getattr(reader, 'zero12', None)\n"
               "    reader.names\n"
               "class W:\n"
               "    def make(self, reader) -> None:\n"
               "        self.reader.model_order()\n"
               "        self.reader.clip_vocabulary(8)\n")
    assert sorted(undeclared_reads(planted)) == ["ck (line 3)", "clip_vocabulary (line 9)", "zero12 (line 4)"]
    assert untyped_readers(planted) == ["build (line 2)", "make (line 7)"]
    assert undeclared_reads("getattr(writer, 'finish', None)\nwriter.tp_index(0)\n", "writer", WRITER) == []
    assert undeclared_reads("getattr(writer, 'buckets', None)\n", "writer", WRITER) == ["buckets (line 1)"]
