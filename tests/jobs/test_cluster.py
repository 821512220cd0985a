"""One offline job over several processes (``reshard.jobs.cluster``): real processes joined by gloo,
launched by ``torchrun`` or by hand with the ``torch.distributed`` environment (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), on one machine.

* the output of 2, 3 and 4 processes, and of two ``torchrun`` "nodes", is byte-identical to one
  process's, manifest included, for ``reshard reshard`` and ``reshard convert`` (both formats),
  also when every file is cut into stripes that several processes write;
* a process killed mid-write makes the others stop with a ``reshard`` error, no output that looks
  finished is left, and a rerun gives the identical result;
* the share of files is disjoint, complete and balanced by bytes.
"""

from __future__ import annotations

import filecmp
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.jobs.cluster import Cluster
from tests.support.dsconv import FIXTURES

TORCHRUN = Path(sys.executable).with_name("torchrun")
SOURCE = FIXTURES / "llama_tp2_dp2"
DCP_SOURCE = FIXTURES.parent / "dcp" / "llama_fsdp_tp_2x2"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _same_tree(a: Path, b: Path) -> None:
    """Every file of ``a`` is in ``b`` with the same bytes, and nothing else is."""
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert files_a == files_b
    for rel in files_a:
        assert filecmp.cmp(a / rel, b / rel, shallow=False), rel


def _single(tmp_path: Path, *args: str, source: Path = SOURCE) -> Path:
    out = tmp_path / "single"
    subprocess.run([sys.executable, "-m", "reshard", *args[:1], str(source), str(out), *args[1:]], check=True,
                   capture_output=True)
    return out


def _torchrun(out: Path, nproc: int, *args: str, nodes: int = 1, source: Path = SOURCE, env: dict | None = None
              ) -> None:
    port = _port()
    procs = []
    for node in range(nodes):
        launch = [str(TORCHRUN), f"--nproc_per_node={nproc}", f"--master_port={port}"]
        if nodes > 1:
            launch += [f"--nnodes={nodes}", f"--node_rank={node}", "--master_addr=127.0.0.1"]
        cmd = [*launch, "-m", "reshard", *args[:1], str(source), str(out), *args[1:]]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env=dict(os.environ, **(env or {}))))
    for p in procs:
        text, _ = p.communicate(timeout=300)
        assert p.returncode == 0, text[-3000:]


@pytest.mark.parametrize("args,nproc", [
    pytest.param(("reshard", "--tp", "1", "--dp", "4"), 4, marks=pytest.mark.slow),
    pytest.param(("reshard", "--tp", "2", "--dp", "3", "--workers", "2"), 3, marks=pytest.mark.slow),
    (("convert",), 3),
    pytest.param(("convert", "--format", "safetensors", "--max-file-gb", "0.0001"), 2, marks=pytest.mark.slow),
], ids=["reshard-4", "reshard-3-workers", "convert-3", "safetensors-2"])
def test_processes_write_what_one_process_writes(args, nproc, tmp_path):
    single = _single(tmp_path, *args)
    many = tmp_path / "many"
    _torchrun(many, nproc, *args)
    _same_tree(single, many)


@pytest.mark.parametrize("args,source", [
    (("convert", "--format", "dcp", "--max-file-gb", "0.0002"), SOURCE),
    pytest.param(("reshard", "--files", "3"), DCP_SOURCE, marks=pytest.mark.slow),
    pytest.param(("convert", "--format", "safetensors", "--max-file-gb", "0.0001"), DCP_SOURCE,
                 marks=pytest.mark.slow),
], ids=["deepspeed-to-dcp", "dcp-files-3", "dcp-to-safetensors"])
def test_dcp_jobs_over_processes_write_what_one_process_writes(args, source, tmp_path):
    single = _single(tmp_path, *args, source=source)
    many = tmp_path / "many"
    _torchrun(many, 2, *args, source=source)
    _same_tree(single, many)


@pytest.mark.parametrize("args,nproc", [
    (("reshard", "--tp", "1", "--dp", "4"), 3),
    pytest.param(("reshard", "--tp", "2", "--dp", "3", "--workers", "2"), 2, marks=pytest.mark.slow),
], ids=["reshard-3", "reshard-2-workers"])
def test_files_striped_over_processes_are_what_one_process_writes(args, nproc, tmp_path):
    """Stripes of 4 KiB: every output archive is written by several processes (and threads),
    each stripe at its place, and finished by one of them (``storage.zip_stripes``)."""
    single = _single(tmp_path, *args)
    many = tmp_path / "many"
    _torchrun(many, nproc, *args, env={"RESHARD_STRIPE_BYTES": "4096"})
    _same_tree(single, many)


def test_two_nodes_write_what_one_process_writes(tmp_path):
    """Two ``torchrun`` "nodes" of 2 processes; stripes of 4 KiB, so the nodes write stripes of the
    same files."""
    args = ("reshard", "--tp", "1", "--dp", "4")
    single = _single(tmp_path, *args)
    nodes = tmp_path / "nodes"
    _torchrun(nodes, 2, *args, nodes=2, env={"RESHARD_STRIPE_BYTES": "4096"})
    _same_tree(single, nodes)


# A process that dies after writing its first optimizer file: the others must notice and stop.
_KILL_ONE = textwrap.dedent("""
    import os, sys
    from reshard.storage import zip_stripes
    from reshard.cli import main
    if os.environ["RANK"] == os.environ["DIE_RANK"]:
        real = zip_stripes.Archive.write_stripe
        def write_then_die(self, i):
            if "optim" in self.rel and i:  # stripe 0 written, then killed mid-file
                os._exit(9)
            return real(self, i)
        zip_stripes.Archive.write_stripe = write_then_die
    sys.exit(main(sys.argv[1:]))
""")


def test_a_killed_process_stops_the_job_and_a_rerun_gives_the_same_files(tmp_path):
    args = ("reshard", "--tp", "1", "--dp", "4")
    single = _single(tmp_path, *args)
    out, world, port = tmp_path / "out", 3, _port()
    script = tmp_path / "kill_one.py"
    script.write_text(_KILL_ONE)
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), DIE_RANK="1", RESHARD_STRIPE_BYTES="4096")
        cmd = [sys.executable, str(script), args[0], str(SOURCE), str(out), *args[1:], "--timeout", "60"]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    texts = [p.communicate(timeout=180)[0] for p in procs]
    assert procs[1].returncode == 9
    for rank in (0, 2):
        assert procs[rank].returncode == 2, texts[rank][-2000:]
        assert "reshard: error:" in texts[rank] and "nothing was committed" in texts[rank], texts[rank][-2000:]
    assert not (out / "global_step3").exists() and not (out / "latest").exists()
    # the survivors remove the staging folder, and the output folder their job made once it is empty
    assert not out.exists() or not [p for p in out.iterdir() if not p.name.startswith(".reshard-partial")]
    _torchrun(out, world, *args)  # the rerun clears what the killed run left
    _same_tree(single, out)


def test_a_failure_on_one_process_is_every_process_error(tmp_path):
    """An output folder that exists already is refused by process 0; the others raise it too."""
    args = ("reshard", "--tp", "1", "--dp", "4")
    out = _single(tmp_path, *args).parent / "single"
    port, world, procs = _port(), 2, []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        cmd = [sys.executable, "-m", "reshard", args[0], str(SOURCE), str(out), *args[1:]]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    texts = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [2, 2], texts
    assert all("already exists" in t for t in texts), texts


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 10**9), max_size=40), st.integers(1, 9))
def test_shares_are_disjoint_complete_and_balanced(sizes, world):
    shares = [Cluster(rank, world).share(sizes) for rank in range(world)]
    every = sorted(i for share in shares for i in share)
    assert every == list(range(len(sizes)))
    loads = [sum(sizes[i] for i in share) for share in shares]
    # greedy largest-first: no process carries more than the lightest plus one job
    assert max(loads) <= min(loads) + max(sizes, default=0)


def test_a_store_that_never_opens_is_reported_within_the_timeout():
    from reshard.jobs.cluster import _wait_for_port

    with pytest.raises(RuntimeError, match=r"process 0's store at 127\.0\.0\.1:\d+ did not open within 0\.2 s"):
        _wait_for_port("127.0.0.1", _port(), 0.2)


@pytest.mark.parametrize("value", ["0", "-5", "64MiB"])
def test_a_bad_stripe_size_is_refused(value, monkeypatch):
    from reshard.errors import ReshardError
    from reshard.jobs.cluster import stripe_bytes

    monkeypatch.setenv("RESHARD_STRIPE_BYTES", value)
    with pytest.raises(ReshardError, match="RESHARD_STRIPE_BYTES must be a positive number of bytes"):
        stripe_bytes()
