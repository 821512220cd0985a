"""The wire floor of a live transfer: what the same bytes between the same peers cost when every
rank already holds one pre-packed contiguous buffer per peer and only posts ``isend`` / ``irecv``.

For a plan, each ordered pair of ranks (a link) carries exactly the bytes of the plan's remote
segments on that link (``link_bytes``). :class:`Floor` allocates, on one rank, one send buffer per
destination and one receive buffer per source of exactly those sizes, and touches them all before
anything is timed. Calling it posts every receive (peers in rank order), then every send, then
waits for all of them: no packing, no unpacking, no allocation, no check, one message per peer.
A timed step around it (barrier, call, barrier) has the same boundaries as a timed ``transfer``.

:class:`FloorWithCopies` adds the copies no executor can avoid when it fills real target shards:
the plan's local segments, and every remote segment whose target side is made of runs shorter
than ``reshard.execute.schedule.MIN_DIRECT_BYTES`` (a column block of a row-major shard: one message
per run would cost more than the copy), copied out of the received buffer; both into target
shards allocated before timing. It is the floor for ``transfer(..., out=targets)``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

import torch
import torch.distributed as dist

from reshard.execute.schedule import MIN_DIRECT_BYTES
from reshard.ir import View, prod, row_major_strides
from reshard.ir.apply import flatten, strided_copy
from reshard.plan.values import ModelPlan, Segment

Link = tuple[int, int]  # (source rank, destination rank)


def link_bytes(plan: ModelPlan, esizes: Mapping[str, int]) -> dict[Link, int]:
    """Bytes the plan moves over each link (remote segments only), ``esizes`` by parameter."""
    out: dict[Link, int] = defaultdict(int)
    for name, p in plan.params.items():
        for s in p.segments:
            if not s.is_local:
                out[(s.src_rank, s.dst_rank)] += s.numel * esizes[name]
    return dict(out)


class Floor:
    """One rank's side of the floor: pre-packed buffers, allocated and touched at construction."""

    def __init__(self, links: Mapping[Link, int], rank: int, group=None) -> None:
        def touched(n: int) -> torch.Tensor:
            t = torch.empty(n, dtype=torch.uint8)
            t.fill_(rank + 1)  # first touch outside the timing
            return t

        self.recvs = [(src, touched(n)) for (src, dst), n in sorted(links.items()) if dst == rank]
        self.sends = [(dst, touched(n)) for (src, dst), n in sorted(links.items()) if src == rank]
        self.group = group

    def __call__(self) -> None:
        works = [dist.irecv(buf, peer, group=self.group) for peer, buf in self.recvs]
        works += [dist.isend(buf, peer, group=self.group) for peer, buf in self.sends]
        for w in works:
            w.wait()

    @property
    def nbytes(self) -> tuple[int, int]:
        """(bytes sent, bytes received) per call."""
        return sum(b.numel() for _, b in self.sends), sum(b.numel() for _, b in self.recvs)


def _in_place(seg: Segment, esize: int) -> bool:
    """Whether the segment's target side is made of contiguous runs long enough to receive each
    in place (a message per run)."""
    run = 1
    for n, st in zip(reversed(seg.shape), reversed(seg.dst.strides)):
        if n != 1 and st != run:
            break
        run *= n
    return run * esize >= MIN_DIRECT_BYTES


class FloorWithCopies(Floor):
    """The floor plus the copies the target layout forces (module docstring). ``local`` and
    ``targets`` are this rank's source and (preallocated) target shards by parameter name."""

    def __init__(self, plan: ModelPlan, esizes: Mapping[str, int], rank: int, local: Mapping, targets: Mapping,
                 group=None) -> None:
        super().__init__(link_bytes(plan, esizes), rank, group)
        src = {n: flatten(t) for n, t in local.items()}
        dst = {n: flatten(t) for n, t in targets.items()}
        self.local = [(dst[n], src[n], s) for n, p in sorted(plan.params.items()) for s in p.segments
                      if s.src_rank == s.dst_rank == rank]
        at: dict[int, int] = defaultdict(int)  # where each peer's next segment sits in its buffer
        bufs = dict(self.recvs)
        self.strided = []
        for n, p in sorted(plan.params.items()):
            for s in p.segments:
                if s.dst_rank == rank != s.src_rank:
                    nb = s.numel * esizes[n]
                    if not _in_place(s, esizes[n]):
                        part = bufs[s.src_rank][at[s.src_rank]:at[s.src_rank] + nb].view(dst[n].dtype)
                        self.strided.append((dst[n], part, s))
                    at[s.src_rank] += nb

    def __call__(self) -> None:
        works = [dist.irecv(buf, peer, group=self.group) for peer, buf in self.recvs]
        works += [dist.isend(buf, peer, group=self.group) for peer, buf in self.sends]
        for out, flat, s in self.local:  # while the wire is busy, as transfer does
            strided_copy(out, s.dst, flat, s.src, s.shape, s.factor)
        for w in works:
            w.wait()
        for out, part, s in self.strided:
            strided_copy(out, s.dst, part, View(0, row_major_strides(s.shape)), s.shape, s.factor)

    @property
    def copied_bytes(self) -> tuple[int, int]:
        """(bytes copied locally, bytes copied out of received buffers) per call."""
        return (sum(s.numel * out.element_size() for out, _, s in self.local),
                sum(prod(s.shape) * out.element_size() for out, _, s in self.strided))
