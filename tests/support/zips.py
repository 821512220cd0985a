"""A random object to save, built twice (real tensors, and ``torch_zip`` placeholders), and
torch's own bytes of it: what the writers of torch archives are tested against."""

from __future__ import annotations

import io
from collections import OrderedDict

import torch
from hypothesis import strategies as st

from reshard.storage.pickling import save as reshard_save
from reshard.storage.torch_zip import Storage

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.uint8, torch.int32,
          torch.float64, torch.uint16, torch.float8_e4m3fn]


def torch_bytes(obj, *, reshard_pickler: bool = True) -> bytes:
    buf = io.BytesIO()
    (reshard_save if reshard_pickler else torch.save)(obj, buf)
    return buf.getvalue()


def split_bytes(data: bytes, cuts: list[int]):
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in zip(points, points[1:])]


@st.composite
def objects(draw):
    """(real object, placeholder object, chunk_bytes): nested containers of tensors that view shared
    storages at offsets and strides, 0-d and empty tensors, plain values and a real tensor or two."""
    n_storages = draw(st.integers(1, 14))
    flats, refs = [], []
    for i in range(n_storages):
        dtype = draw(st.sampled_from(DTYPES))
        numel = draw(st.integers(0, 40))
        raw = draw(st.binary(min_size=numel * dtype.itemsize, max_size=numel * dtype.itemsize))
        if dtype == torch.bool:
            raw = bytes(b & 1 for b in raw)
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype) if raw else torch.empty(0, dtype=dtype)
        kind = draw(st.sampled_from(["fill", "tensor", "bytes", "chunks"]))
        if kind == "fill":
            source = (lambda out, start, flat=flat: out.copy_(flat[start:start + out.numel()]))
        elif kind == "tensor":
            source = flat.clone()
        elif kind == "bytes":
            source = raw
        else:
            source = iter(split_bytes(raw, draw(st.lists(st.integers(0, 400), max_size=6))))
        flats.append(flat)
        refs.append(Storage(dtype, numel, source, label=f"s{i}"))

    def view(i: int):
        flat, ref = flats[i], refs[i]
        shape = draw(st.sampled_from([(), (0,), (1,), (2, 3), (3, 2), (4,), (0, 3)]))
        size = 1
        for d in shape:
            size *= d
        if size > ref.numel:
            return None
        transposed = len(shape) == 2 and draw(st.booleans())
        offset = draw(st.integers(0, ref.numel - size)) if size else draw(st.integers(0, ref.numel))
        stride = (1, shape[0]) if transposed else None
        grad = draw(st.booleans()) and ref.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64)
        t = ref.view(shape, offset=offset, stride=stride, requires_grad=grad)
        real = flat.as_strided(shape, t.stride, offset)
        return (real.detach().requires_grad_(True) if grad else real), t

    leaves = []
    for _ in range(draw(st.integers(1, 20))):
        i = draw(st.integers(0, n_storages - 1))
        v = view(i)
        if v is not None:
            leaves.append(v)
    plain = [("0", "0"), ("1", "1"), ("10", "10"), (3, 3), (None, None), (1.5, 1.5), ((1, "a"), (1, "a"))]
    step = torch.tensor(7)  # a real tensor inside the placeholder object too
    leaves += [(p, p) for p in draw(st.lists(st.sampled_from(plain), max_size=4))] + [(step, step)]
    if draw(st.booleans()) and len(leaves) > 1:
        leaves.append(leaves[0])  # the same tensor twice: one object, memoised
    order = draw(st.permutations(range(len(leaves))))

    def nest(items, depth):
        if depth == 0 or len(items) <= 1:
            return items[0] if len(items) == 1 else ([a for a, _ in items], [b for _, b in items])
        kind = draw(st.sampled_from(["dict", "list", "odict", "tuple"]))
        half = len(items) // 2
        left, right = nest(items[:half], depth - 1), nest(items[half:], depth - 1)
        pair = {"dict": lambda a, b: {"x": a, "y": b}, "list": lambda a, b: [a, b],
                "odict": lambda a, b: OrderedDict([("k", a), ("j", b)]), "tuple": lambda a, b: (a, b)}[kind]
        return pair(left[0], right[0]), pair(left[1], right[1])

    real_obj, ref_obj = nest([leaves[k] for k in order], draw(st.integers(1, 4)))
    return real_obj, ref_obj, draw(st.sampled_from([1, 3, 8, 64, 1 << 20]))
