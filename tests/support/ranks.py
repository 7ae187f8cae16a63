"""Start a module as the ranks of a process group on this machine, as torchrun would
(its environment variables, a free port on loopback), and wait for all of them."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_ranks(
    module: str, arguments: Sequence[str], world_size: int, timeout: float, environment: Mapping[str, str] = {}
) -> None:
    """``python -m module arguments`` as ``world_size`` ranks (one thread each), with
    ``environment`` added; fails naming the rank that did not exit 0, with its output."""
    port = str(free_port())
    processes = []
    for rank in range(world_size):
        variables = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "OMP_NUM_THREADS": "1",
            **environment,
        }
        command = [sys.executable, "-m", module, *arguments]
        processes.append(
            subprocess.Popen(
                command, cwd=REPOSITORY, env=variables, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    outputs = [process.communicate(timeout=timeout)[0] for process in processes]
    for rank, (process, output) in enumerate(zip(processes, outputs)):
        assert process.returncode == 0, f"rank {rank} failed:\n{output}"
