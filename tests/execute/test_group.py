"""``reshard.execute.group.TransferGroup`` in a real gloo job: 3 spawned processes, each also in a
default group of its own (as a trainer's and vLLM's processes are), no mocks.

Phase 1 (group A): byte broadcast, byte messages, tensor sends and receives, the failure
agreement; then rank 2 stops taking part (alive, asleep): ranks 0 and 1 raise ``TransferError``
once the group's timeout passes, and the broken group refuses at once afterwards.
Phase 2 (group B, a fresh store): rank 2 exits mid-exchange: ranks 0 and 1 raise ``TransferError``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tests.support.spawn import run_ranks

WORLD = 3
TIMEOUT_S = 3  # the group's timeout
JOB_TIMEOUT_S = 90


def _record(workdir: str, rank: int, **rec) -> None:
    with open(Path(workdir) / f"rank{rank}.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")


def _all_ready(workdir: str, rank: int, limit_s: float = 60.0) -> None:
    """Wait until every rank has started (a file each), at most ``limit_s``."""
    (Path(workdir) / f"ready{rank}").touch()
    t0 = time.monotonic()
    while not all((Path(workdir) / f"ready{q}").exists() for q in range(WORLD)) and time.monotonic() - t0 < limit_s:
        time.sleep(0.05)


def _worker(rank: int, workdir: str) -> None:
    import tempfile

    import torch
    import torch.distributed as dist

    from reshard.errors import TransferError
    from reshard.execute.group import TransferGroup

    ports = json.loads((Path(workdir) / "ports.json").read_text())
    # a default group of one, this process's own: the transfer group must not need or disturb it
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/pg", rank=0, world_size=1)
    _all_ready(workdir, rank)  # the group's 3 s join must not also cover a loaded machine's process start-up
    g = TransferGroup("127.0.0.1", ports[0], rank, WORLD, timeout_s=TIMEOUT_S, name="a")
    got = g.broadcast_bytes(b"init info" if rank == 0 else None, 0)
    _record(workdir, rank, case="broadcast", ok=got == b"init info")
    if rank == 1:
        g.send_bytes(json.dumps({"n": 7}).encode(), 0)
    if rank == 0:
        _record(workdir, rank, case="message", ok=json.loads(g.recv_bytes(1)) == {"n": 7})
    # every rank sends rank-tagged data to each other rank and receives theirs
    sends = {q: torch.arange(5, dtype=torch.float32) + 10 * rank + q for q in range(WORLD) if q != rank}
    inbox = {q: torch.empty(5, dtype=torch.float32) for q in range(WORLD) if q != rank}
    works = [g.recv(t, q) for q, t in inbox.items()] + [g.send(t, q) for q, t in sends.items()]
    g.wait(works, "exchange")
    _record(workdir, rank, case="p2p", ok=all(torch.equal(t, torch.arange(5.0) + 10 * q + rank)
                                              for q, t in inbox.items()))
    _record(workdir, rank, case="failures", got=g.failures(rank == 1))
    dist.all_reduce(torch.ones(1))  # the default group still works alongside
    if rank == 2:
        time.sleep(TIMEOUT_S + 2)  # alive, taking no part
    else:
        t0 = time.monotonic()
        try:
            g.barrier()
            _record(workdir, rank, case="hung peer", raised=None)
        except TransferError as e:
            _record(workdir, rank, case="hung peer", raised="TransferError", s=time.monotonic() - t0, msg=str(e))
        try:
            g.barrier()
            _record(workdir, rank, case="after failure", raised=None)
        except TransferError as e:
            _record(workdir, rank, case="after failure", raised="TransferError", msg=str(e))
    h = TransferGroup("127.0.0.1", ports[1], rank, WORLD, timeout_s=3 * TIMEOUT_S, name="b")  # waits for rank 2
    h.barrier()
    if rank == 2:
        os._exit(3)
    buf = torch.empty(1000)
    try:
        h.wait([h.recv(buf, 2)], "receive from a killed rank")
        _record(workdir, rank, case="killed peer", raised=None)
    except TransferError as e:
        _record(workdir, rank, case="killed peer", raised="TransferError", msg=str(e))


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from reshard.execute.group import free_port

    workdir = tmp_path_factory.mktemp("group")
    (workdir / "ports.json").write_text(json.dumps([free_port(), free_port()]))
    return run_ranks(_worker, WORLD, workdir, JOB_TIMEOUT_S, "case")


def test_group_moves_data(job):
    rec = job["records"]
    assert job["hung"] == []
    for case in ("broadcast", "p2p"):
        assert {r: v["ok"] for r, v in rec[case].items()} == dict.fromkeys(range(WORLD), True), case
    assert rec["message"] == {0: {"ok": True}}
    assert {r: v["got"] for r, v in rec["failures"].items()} == dict.fromkeys(range(WORLD), [1])


def test_hung_or_killed_peer_raises_transfer_error(job):
    rec = job["records"]
    assert job["hung"] == [] and job["exitcodes"] == [0, 0, 3]
    for case in ("hung peer", "after failure", "killed peer"):
        assert set(rec[case]) == {0, 1}, case
        for r, v in rec[case].items():
            assert v["raised"] == "TransferError", (case, r)
            assert f"rank {r} of {WORLD}" in v["msg"] or "earlier operation failed" in v["msg"], (case, v["msg"])
    assert all("earlier operation failed" in v["msg"] for v in rec["after failure"].values())
