"""The product in words, built from the format table (``formats.table``): the synopsis that
``reshard --help`` prints and README.md carries (a test keeps them equal), and each command's
description of its sources and targets. Plain text, no torch: the parser is built before torch loads."""

from __future__ import annotations

import textwrap

from ..formats.table import (
    DEFAULT_TARGET,
    OPTIONS,
    convert_targets,
    reshard_targets,
    sources,
    targets,
)

__all__ = ["COMMANDS", "convert_description", "reshard_description", "synopsis"]

WIDTH = 100
COMMANDS = (
    ("reshard convert SRC OUT [--format F]", "SRC in a format without a topology (default universal)"),
    ("reshard reshard SRC OUT [--to F] [--tp T] ...", "SRC at another topology, by default in its own format"),
    ("reshard inspect PATH", "how every parameter is sharded (table, --json, --png)"),
    ("reshard plan SOURCE --tp T [--dp D]", "plan a move to another topology, moving no data"),
    ("reshard plan SOURCE --to TARGET.json", "plan the move between two map documents"),
    ("reshard check MAPS.json", "validate a map document"),
    ("reshard verify OUT", "re-check an output folder against its manifest"),
    ("reshard verify SRC", "check a source: reader checks, CRC-32s, deep check"),
    ("reshard demo", "a tour of committed fixtures"),
)


def _entry(name: str, words: str, example: str) -> list[str]:
    """``  name   words`` wrapped under itself, then ``e.g. example``."""
    indent = " " * 22
    head = f"  {name:<19} "
    lines = textwrap.wrap(words, WIDTH, initial_indent=head if len(head) <= 22 else indent,
                          subsequent_indent=indent)
    if len(head) > 22:
        lines.insert(0, head.rstrip())
    return [*lines, f"{indent}e.g. {example}"]


def _default_rule() -> str:
    own = [f.name + (f" with {OPTIONS[f.needs].flag}" if f.needs else "") for f in reshard_targets() if f.reader]
    needs = [f"{f.noun} without {OPTIONS[f.needs].flag} is refused, naming it and --to's choices"
             for f in reshard_targets() if f.reader and f.needs]
    rest = [f.name for f in sources() if f.reshard is None]
    return (f"reshard keeps the source's format where it is written at a topology ({', '.join(own)}); "
            f"a source without one ({', '.join(rest)}) is written as {DEFAULT_TARGET}; " + "; ".join(needs))


def synopsis() -> str:
    """The commands, every source and every target format with one example each."""
    lines = [f"{cmd:<45} {words}" for cmd, words in COMMANDS]
    lines += ["", "sources (SRC, recognised from its files):"]
    for f in sources():
        lines += _entry(f.name, f.reads, f.source_example)
    lines += ["", "targets:"]
    for f in targets():
        lines += _entry(f.spelled, f.writes, f.target_example)
    lines += [""] + textwrap.wrap(_default_rule() + ".", WIDTH)
    return "\n".join(lines)


def _sources_line() -> str:
    return "SRC is any checkpoint reshard reads: " + ", ".join(f.noun for f in sources()) + "."


def convert_description() -> str:
    lines = ["Convert SRC into a format without a topology, the same tensors in other files.", "",
             *textwrap.wrap(_sources_line(), WIDTH), "", "targets (--format):"]
    for f in convert_targets():
        lines += _entry(f.spelled, f.writes, f.target_example if f.reshard is None else
                        f"reshard convert CKPT OUT --format {f.name}")
    return "\n".join(lines)


def reshard_description() -> str:
    lines = ["Write SRC at another parallel topology.", "", *textwrap.wrap(_sources_line(), WIDTH), "",
             "targets (--to):"]
    for f in reshard_targets():
        takes = " ".join(OPTIONS[k].flag for k in f.reshard or () if OPTIONS[k].flag)
        example = f"reshard reshard SRC OUT {OPTIONS[f.needs].flag} 8" if f.convert and f.needs else f.target_example
        lines += _entry(f.name, f"{f.writes} [{takes}]", example)
    lines += [""] + textwrap.wrap(_default_rule() + "; a target that cannot be written from SRC is refused "
                                  "naming --to's choices.", WIDTH)
    return "\n".join(lines)

