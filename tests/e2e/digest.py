"""Sharding-independent digests of one logical (full, unsharded) tensor.

Imported both by the resume script (inside the DeepSpeed job, after the TP shards of a parameter
have been put back together) and by the tests (on tensors read straight from a universal
checkpoint), so the two sides compute the very same numbers. Depends on torch only.

A digest of a tensor ``x`` named ``name`` is::

    {"shape": [...],             # logical shape
     "sha256": "...",            # of the float32, row-major bytes of x (any bit change shows)
     "wsum": float}              # sum_i x_i * w_i, exactly rounded (math.fsum), float64

with ``w`` fixed pseudo-random weights in [1, 2) drawn from a generator seeded by
``crc32(name)``, one per logical element. ``wsum`` does not depend on the order in which elements
are added (fsum is exactly rounded), on thread counts or on how the tensor was sharded; a change
of one element by one float32 ulp moves it (weights are >= 1 and the sum is exact before the final
rounding). ``sha256`` is the exact check; ``wsum`` says by how much two states differ.
"""

from __future__ import annotations

import hashlib
import math
import zlib

import torch

DIGEST_SEED = 0x5EED


def weights(name: str, shape) -> torch.Tensor:
    """The fixed float64 weights of parameter ``name`` (one per logical element), in [1, 2)."""
    gen = torch.Generator().manual_seed((zlib.crc32(name.encode()) + DIGEST_SEED) % (2**63))
    return 1.0 + torch.rand(tuple(shape), generator=gen, dtype=torch.float64)


def digest(name: str, tensor: torch.Tensor) -> dict:
    """Digest of the logical tensor ``tensor`` of parameter ``name`` (see the module docstring)."""
    x = tensor.detach().cpu()
    if x.is_floating_point() and x.dtype != torch.float64:
        x = x.to(torch.float32)  # exact for fp32 / bf16 / fp16
    x = x.contiguous()
    sha = hashlib.sha256(x.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
    products = (x.to(torch.float64) * weights(name, x.shape)).reshape(-1).tolist()
    return {"shape": list(x.shape), "sha256": sha, "wsum": math.fsum(products)}


def summary(digests: dict) -> str:
    """One sha256 over a ``{param: {kind: digest}}`` mapping (sorted), for quick comparisons."""
    h = hashlib.sha256()
    for name in sorted(digests):
        for kind in sorted(digests[name]):
            h.update(f"{name}/{kind}/{digests[name][kind]['sha256']}\n".encode())
    return h.hexdigest()


def differences(a: dict, b: dict) -> list[tuple[str, str, float]]:
    """``(param, kind, wsum_b - wsum_a)`` for every entry whose sha256 differs between two
    ``{param: {kind: digest}}`` mappings (an entry missing on one side counts, with nan)."""
    out = []
    for name in sorted(set(a) | set(b)):
        kinds = set(a.get(name, {})) | set(b.get(name, {}))
        for kind in sorted(kinds):
            da, db = a.get(name, {}).get(kind), b.get(name, {}).get(kind)
            if da is None or db is None:
                out.append((name, kind, math.nan))
            elif da["sha256"] != db["sha256"]:
                out.append((name, kind, db["wsum"] - da["wsum"]))
    return out
