"""Shared helpers of the Megatron tests: the fixtures, Megatron's own TP=1 reload (``oracle/``)
and a comparison of everything a reader reads with it, bit for bit."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import torch

from reshard.formats.megatron.reader import MegatronReader

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "megatron"
HF_FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "hf"
ALL = sorted(p.name for p in FIXTURES.iterdir() if (p / "fixture.json").is_file())
STATES = (("weight", None), ("exp_avg", "exp_avg."), ("exp_avg_sq", "exp_avg_sq."), ("fp32", "param."))


@cache
def oracle(name: str) -> tuple[dict, dict, dict, dict]:
    """(model, optimizer, forward, oracle.json) of fixture ``name``."""
    from safetensors.torch import load_file

    o = FIXTURES / name / "oracle"
    optim = load_file(str(o / "optimizer.safetensors")) if (o / "optimizer.safetensors").is_file() else {}
    return (load_file(str(o / "model.safetensors")), optim, load_file(str(o / "forward.safetensors")),
            json.loads((o / "oracle.json").read_text()))


def full(reader: MegatronReader, name: str, state: str) -> torch.Tensor:
    """F of ``name``'s ``state``, rebuilt from every shard the reader gives (replicas compared)."""
    m = reader.map(name, state)
    return m.rebuild({r: reader.fragment(name, state, r) for r in m.ranks}, valid_only=True)


def compare_megatron(reader: MegatronReader, fixture: str) -> int:
    """Every (weight, moment, fp32 master) of the oracle equals the reader's, bit for bit (a
    padded vocabulary compared on the rows both hold); returns how many tensors were compared."""
    model, optim, _, info = oracle(fixture)
    n = 0
    for name, (key, idx) in info["names"].items():
        for state, prefix in STATES:
            want = model[name] if prefix is None else optim.get(prefix + name)
            if want is None or state not in reader.states(key):
                continue
            got = full(reader, key, state)[tuple(idx)]
            rows = min(got.shape[0], want.shape[0]) if got.dim() else None
            if rows is not None and got.shape[1:] == want.shape[1:] and got.shape != want.shape:
                got, want = got[:rows], want[:rows]
            assert got.dtype == want.dtype and torch.equal(got, want), f"{fixture}: {name} ({state}) differs"
            n += 1
    return n
