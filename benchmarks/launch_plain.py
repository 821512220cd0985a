"""The smallest launcher: start N copies of a command with the ``torch.distributed`` environment
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) and wait for all,
as a cluster scheduler (``srun``, ``mpirun``) does; unlike ``torchrun`` it imports nothing, so
its own start-up (about a second of importing torch here) is not counted against the job.

    python benchmarks/launch_plain.py N PORT -- CMD ...
"""

from __future__ import annotations

import os
import subprocess
import sys


def main(argv: list[str]) -> int:
    n, port, cmd = int(argv[0]), argv[1], argv[argv.index("--") + 1:]
    procs = [subprocess.Popen(cmd, env=dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(n),
                                            MASTER_ADDR="127.0.0.1", MASTER_PORT=port)) for r in range(n)]
    return max(p.wait() for p in procs)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
