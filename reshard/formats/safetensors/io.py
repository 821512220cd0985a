"""A streaming safetensors writer: the header is computed from shapes alone, then each tensor is
written as it is produced, so a file never has to be held in memory whole."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO

import torch

DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
QUANTIZED = {torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.float8_e8m0fnu: "F8_E8M0"}
HEADER_DTYPES = DTYPES | QUANTIZED  # what a file may hold: --dtype takes DTYPES; payloads and scales these
CHUNK = 16 << 20  # bytes of a whole tensor written at a time


class SafetensorsFile:
    """Writes to ``path`` (a file it creates) or to an open binary file (which the caller closes)."""

    def __init__(self, path: Path | BinaryIO, specs: list[tuple[str, tuple[int, ...], torch.dtype]],
                 metadata: dict[str, str] | None = None) -> None:
        header: dict = {"__metadata__": metadata or {"format": "pt"}}
        offset = 0
        for name, shape, dtype in specs:
            n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": HEADER_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # keep tensor data 8-byte aligned
        self.expected = [(name, tuple(shape), dtype) for name, shape, dtype in specs]
        self.index = 0
        self.owned = isinstance(path, (str, Path))
        self.f = open(path, "wb") if self.owned else path
        self.f.write(struct.pack("<Q", len(raw)) + raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want = self.expected[self.index]
        if (name, tuple(tensor.shape), tensor.dtype) != want:
            raise ValueError(f"safetensors writer expected {want}, got {name} {tuple(tensor.shape)} {tensor.dtype}")
        self.index += 1
        t = tensor.detach().contiguous().cpu()
        if not t.numel():
            return
        from ...execute.memory import release

        raw = t.reshape(-1).view(torch.uint8)
        for at in range(0, raw.numel(), CHUNK):  # the tensor's own bytes, no copy, a chunk at a time:
            part = raw[at:at + CHUNK]
            self.f.write(memoryview(part.numpy()).cast("B"))
            release(part)  # a mapped source's pages (a payload copied as stored) dropped once written

    def write_runs(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, runs: Iterable[torch.Tensor]) -> None:
        """Write tensor ``name`` as consecutive runs of its elements (a quantized payload, block row
        run by block row run); refuses runs that do not add up to its size."""
        want = self.expected[self.index]
        if (name, tuple(shape), dtype) != want:
            raise ValueError(f"safetensors writer expected {want}, got {name} {tuple(shape)} {dtype}")
        self.index += 1
        left = torch.Size(shape).numel()
        for t in runs:
            if t.dtype != dtype or t.numel() > left:
                raise ValueError(f"safetensors writer: a run of {t.numel()} {t.dtype} past tensor {name}")
            left -= t.numel()
            if t.numel():
                self.f.write(memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()).cast("B"))
        if left:
            raise ValueError(f"safetensors writer: tensor {name} ended {left} elements short")

    def write_fill(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                   fill: Callable[[torch.Tensor, int], None], chunk_bytes: int = 16 << 20) -> None:
        """Write tensor ``name`` window by window: ``fill(out, start)`` puts elements ``start`` on
        into the 1-D ``out`` (as ``torch_zip`` sources do; windows a ``WindowFill`` can hand over as
        its sources' own slices are written from them, a mapped file's by the kernel); memory is
        one window."""
        from ...execute.memory import release
        from ...storage.torch_zip import Storage, filled

        want = self.expected[self.index]
        if (name, tuple(shape), dtype) != want:
            raise ValueError(f"safetensors writer expected {want}, got {name} {tuple(shape)} {dtype}")
        self.index += 1
        storage = Storage(dtype, torch.Size(shape).numel(), fill, label=name)
        buffers: list[torch.Tensor] = []

        def buffer(i: int, nbytes: int) -> torch.Tensor:
            while len(buffers) <= i % 2:
                buffers.append(torch.empty(0, dtype=torch.uint8))
            if buffers[i % 2].numel() < nbytes:
                buffers[i % 2] = torch.empty(nbytes, dtype=torch.uint8)
            return buffers[i % 2][:nbytes]

        for chunk, mapped in filled(storage, fill, 0, storage.numel, chunk_bytes, buffer):
            if isinstance(chunk, torch.Tensor):
                chunk = memoryview(chunk.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")
            self.f.write(chunk)
            if mapped is not None:
                release(mapped)

    def close(self) -> None:
        if self.index != len(self.expected):
            raise ValueError("safetensors file closed before every tensor was written")
        if self.owned:
            self.f.close()


def plan_files(specs: Iterable[tuple[str, tuple[int, ...], torch.dtype]], max_bytes: int) -> list[list]:
    """Split tensors, in order, into files of at most ``max_bytes`` (a larger tensor gets a file
    of its own)."""
    files: list[list] = [[]]
    size = 0
    for spec in specs:
        n = torch.Size(spec[1]).numel() * torch.empty((), dtype=spec[2]).element_size()
        if files[-1] and size + n > max_bytes:
            files.append([])
            size = 0
        files[-1].append(spec)
        size += n
    return files
