"""A gloo process group of its own, for moves between processes of different jobs.

A trainer's ranks and an inference engine's workers each already sit in a default process group
(the trainer's, vLLM's) that the other side is no member of, and ``torch.distributed.new_group``
can only cut sub-groups of the default group. :class:`TransferGroup` is a ``ProcessGroupGloo``
over a TCP store of its own (rank 0 hosts it, the others connect to ``host:port``), registered
nowhere: it is driven through its own methods (point-to-point sends and receives, a ``MAX``
reduction, byte messages), never through ``torch.distributed``'s functions, so it does not
disturb either job's default group.

Failures. Every operation is bounded by the group's timeout (``timeout_s``): a peer that dies
closes its connections (gloo reports it at once), a peer that hangs runs the operation past the
timeout; either way the survivors raise :class:`~reshard.errors.TransferError` naming the
operation and this rank, and the group is marked broken (every later call raises at once: the
streams between the ranks may be out of step, so a new group is needed).
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import TopologyError, TransferError

__all__ = ["TransferGroup", "free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (for rank 0's store)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class TransferGroup:
    """Rank ``rank`` of a ``world``-rank gloo group over the store at ``host:port`` (rank 0 hosts
    it); joining waits up to ``timeout_s`` for every rank. ``name`` keeps the keys of groups that
    share a store apart."""

    def __init__(self, host: str, port: int, rank: int, world: int, *, timeout_s: float = 60.0,
                 name: str = "reshard") -> None:
        if world < 1 or not 0 <= rank < world:
            raise TopologyError(f"TransferGroup: rank {rank} is not in a world of {world}")
        self.rank, self.world, self.timeout_s = rank, world, float(timeout_s)
        self._broken: str | None = None
        timeout = timedelta(seconds=timeout_s)
        try:
            self._store = dist.TCPStore(host, port, world, rank == 0, timeout, wait_for_workers=False)
            self._pg = dist.ProcessGroupGloo(dist.PrefixStore(name, self._store), rank, world, timeout)
        except (RuntimeError, OSError) as e:
            raise TransferError(f"TransferGroup: rank {rank} of {world} could not join the group at "
                                f"{host}:{port} within {timeout_s:g} s: {e}") from e
        self._flags = torch.zeros(world, dtype=torch.int64)

    # -- failures -------------------------------------------------------------------------------

    @property
    def broken(self) -> str | None:
        """Why the group cannot be used any more, or ``None``."""
        return self._broken

    def _check(self, what: str) -> None:
        if self._broken is not None:
            raise TransferError(f"TransferGroup: rank {self.rank}: {what}: an earlier operation failed "
                                f"({self._broken}); make a new group")

    def _failed(self, what: str, e: BaseException) -> TransferError:
        self._broken = f"{what}: {e}"
        return TransferError(f"TransferGroup: rank {self.rank} of {self.world}: {what} failed (a peer died or "
                             f"the {self.timeout_s:g} s timeout passed): {e}")

    def wait(self, works: Sequence, what: str) -> None:
        """Wait for operations started by :meth:`send` / :meth:`recv`, each exactly once."""
        try:
            for w in works:
                w.wait()
        except RuntimeError as e:
            raise self._failed(what, e) from e

    # -- point to point -------------------------------------------------------------------------

    def send(self, t: torch.Tensor, dst: int, what: str = "send"):
        """Start sending contiguous ``t`` to rank ``dst``; returns the operation (:meth:`wait`)."""
        self._check(what)
        try:
            return self._pg.send([t], dst, 0)
        except RuntimeError as e:
            raise self._failed(what, e) from e

    def recv(self, t: torch.Tensor, src: int, what: str = "recv"):
        """Start receiving into contiguous ``t`` from rank ``src``; returns the operation."""
        self._check(what)
        try:
            return self._pg.recv([t], src, 0)
        except RuntimeError as e:
            raise self._failed(what, e) from e

    def send_bytes(self, data: bytes, dst: int, what: str = "send a message") -> None:
        """A byte message to ``dst`` (its length, then its bytes), waited for."""
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        size = torch.tensor([len(data)], dtype=torch.int64)
        self.wait([self.send(size, dst, what)], what)
        if data:
            self.wait([self.send(buf, dst, what)], what)

    def recv_bytes(self, src: int, what: str = "receive a message") -> bytes:
        size = torch.zeros(1, dtype=torch.int64)
        self.wait([self.recv(size, src, what)], what)
        buf = torch.empty(int(size.item()), dtype=torch.uint8)
        if buf.numel():
            self.wait([self.recv(buf, src, what)], what)
        return buf.numpy().tobytes()

    # -- collectives ------------------------------------------------------------------------------

    def max(self, t: torch.Tensor, what: str = "all_reduce") -> torch.Tensor:
        """``t`` (int64) replaced by its element-wise maximum over every rank; collective."""
        self._check(what)
        try:
            self._pg.allreduce([t], _max_opts()).wait()
        except RuntimeError as e:
            raise self._failed(what, e) from e
        return t

    def failures(self, failed: bool, what: str = "agree") -> list[int]:
        """Collective: the ranks that report ``failed`` (every rank gets the same list)."""
        self._flags.zero_()
        self._flags[self.rank] = 1 if failed else 0
        return [r for r, v in enumerate(self.max(self._flags, what).tolist()) if v]

    def broadcast_bytes(self, data: bytes | None, root: int = 0, what: str = "broadcast") -> bytes:
        """``root``'s ``data`` on every rank; collective (other ranks pass ``None``)."""
        self._check(what)
        try:
            size = torch.tensor([len(data) if self.rank == root and data is not None else 0], dtype=torch.int64)
            self._pg.broadcast([size], _root_opts(root)).wait()
            if self.rank == root:
                buf = torch.frombuffer(bytearray(data or b"\0"), dtype=torch.uint8)[:int(size.item())]
            else:
                buf = torch.empty(int(size.item()), dtype=torch.uint8)
            if buf.numel():
                self._pg.broadcast([buf], _root_opts(root)).wait()
        except RuntimeError as e:
            raise self._failed(what, e) from e
        return buf.numpy().tobytes()

    def barrier(self, what: str = "barrier") -> None:
        self.failures(False, what)

    def close(self) -> None:
        """Drop the group (its connections close with it); the object is unusable afterwards."""
        self._broken = self._broken or "closed"
        self._pg = None  # type: ignore[assignment]
        self._store = None  # type: ignore[assignment]


def _max_opts():
    o = dist.AllreduceOptions()
    o.reduceOp = dist.ReduceOp.MAX
    return o


def _root_opts(root: int):
    o = dist.BroadcastOptions()
    o.rootRank = root
    o.rootTensor = 0
    return o
