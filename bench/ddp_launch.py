"""Start the W ranks of ``bench.ddp_worker`` as subprocesses and return rank 0's JSON.

On loopback by default, or each rank behind its own command prefix (``ip netns exec NS``)
and bound to its own interface: how the WAN benchmark runs its data-parallel baseline.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPOSITORY = Path(__file__).resolve().parent.parent


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def rank_command(
    rank: int,
    world_size: int,
    master: str,
    steps: int,
    *,
    recipe: Path | None,
    overrides: Sequence[str],
    eval_every: int,
    bucket_mb: float,
    dtype: str,
    threads: int,
    max_seconds: float | None,
    interface: str | None,
    out: Path | None,
    timeout: float,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The command line of rank ``rank`` of ``python -m bench.ddp_worker``."""
    command = [sys.executable, "-m", "bench.ddp_worker", "--rank", str(rank), "--world-size", str(world_size)]
    command += ["--master", master, "--steps", str(steps), "--eval-every", str(eval_every)]
    command += ["--bucket-mb", str(bucket_mb), "--dtype", dtype, "--threads", str(threads), "--timeout", str(timeout)]
    command += ["--recipe", str(recipe)] if recipe else []
    command += [item for override in overrides for item in ("--set", override)]
    command += ["--max-seconds", str(max_seconds)] if max_seconds is not None else []
    command += ["--interface", interface] if interface else []
    command += ["--out", str(out)] if out else []
    return command + list(extra_args)


def wait_for_ranks(processes: Sequence[subprocess.Popen], logs: Sequence[Any], timeout: float) -> None:
    """Return once every rank exited cleanly; on a rank's failure, or past ``timeout``,
    raise RuntimeError with every rank's log (the caller stops those still running)."""
    deadline = time.monotonic() + timeout
    failed = None
    while any(p.poll() is None for p in processes):
        failed = next((r for r, p in enumerate(processes) if p.returncode not in (None, 0)), None)
        if failed is not None or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    codes = [p.poll() for p in processes]
    if all(code == 0 for code in codes):
        return
    reason = f"rank {failed} failed" if failed is not None else ("timed out" if None in codes else "a rank failed")
    raise RuntimeError(
        f"ddp run {reason} (exit codes {codes})\n"
        + "\n".join(f"--- rank {r}:\n{_tail(log)}" for r, log in enumerate(logs))
    )


def launch_local(
    world_size: int,
    steps: int,
    *,
    recipe: Path | None = None,
    overrides: Sequence[str] = (),
    eval_every: int = 0,
    bucket_mb: float = 0.0,
    dtype: str = "bf16",
    threads: int = 1,
    max_seconds: float | None = None,
    master_addr: str = "127.0.0.1",
    port: int | None = None,
    prefixes: Sequence[Sequence[str]] | None = None,
    interfaces: Sequence[str | None] | None = None,
    extra_args: Sequence[str] = (),
    timeout: float = 900.0,
    workdir: Path | None = None,
) -> dict[str, Any]:
    """Run W ranks of ``bench.ddp_worker`` as subprocesses and return rank 0's JSON.

    By default every rank runs on this machine on loopback (gloo bound to ``lo``).  To
    place ranks elsewhere give ``prefixes[r]``, an argv put before rank r's command (e.g.
    ``["ip", "netns", "exec", "ns1"]``), ``interfaces[r]``, the interface its gloo binds to
    (e.g. ``"veth0"``), and ``master_addr``, rank 0's address as the others reach it.
    ``port`` defaults to a free port of this namespace.  A rank that fails (or the whole
    run outliving ``timeout``) stops them all and raises RuntimeError with their stderr.
    """
    if prefixes is not None and len(prefixes) != world_size:
        raise ValueError(f"{len(prefixes)} prefixes for {world_size} ranks")
    if interfaces is None:
        interfaces = ["lo" if master_addr.startswith("127.") or master_addr == "localhost" else None] * world_size
    if len(interfaces) != world_size:
        raise ValueError(f"{len(interfaces)} interfaces for {world_size} ranks")
    master = f"{master_addr}:{port or free_port()}"
    settings = {"recipe": recipe, "overrides": overrides, "eval_every": eval_every, "bucket_mb": bucket_mb}
    settings |= {"dtype": dtype, "threads": threads, "max_seconds": max_seconds, "timeout": timeout}
    with tempfile.TemporaryDirectory(prefix="ddp-", dir=workdir) as directory:
        out = Path(directory) / "rank0.json"
        environment = {
            **os.environ,
            "OMP_NUM_THREADS": str(threads),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPOSITORY), os.environ.get("PYTHONPATH")])),
        }
        processes, logs = [], []
        try:
            for rank in range(world_size):
                command = rank_command(
                    rank,
                    world_size,
                    master,
                    steps,
                    interface=interfaces[rank],
                    out=out if rank == 0 else None,
                    extra_args=extra_args,
                    **settings,
                )
                prefix = list(prefixes[rank]) if prefixes else []
                logs.append(open(Path(directory) / f"rank{rank}.log", "w+b"))
                processes.append(
                    subprocess.Popen(
                        prefix + command, cwd=REPOSITORY, env=environment, stdout=logs[-1], stderr=subprocess.STDOUT
                    )
                )
            wait_for_ranks(processes, logs, timeout)
            return json.loads(out.read_text())
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()
            for log in logs:
                log.close()


def _tail(log: Any, size: int = 3000) -> str:
    log.flush()
    log.seek(0)
    return log.read().decode(errors="replace")[-size:]
