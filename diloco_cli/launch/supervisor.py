"""The supervisor: run one learner or syncer, restart it on a crash with backoff.

It runs detached (its own session, so it outlives the shell or SSH session that started
it), appends the child's output to a log file and records its state in a small JSON file.
On SIGTERM it forwards the signal to the child, waits for it and exits without
restarting.  A child that exits 0 has finished; any other exit is a crash and is
restarted after 1, 2, 4 ... up to 30 seconds, until it has crashed ``max_crashes`` times
in a row without running a minute.  The state file keeps the crashes in a row (back to 0
once a child has run a minute), the restarts in all, and the last error line of the
child's output (else how it ended: ``killed by SIGKILL``), so that ``status`` can say that
a process was restarted or is crash-looping, and why.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HEALTHY_SECONDS = 60.0
"""A child that ran this long resets the count of consecutive crashes."""

LOG_TAIL_BYTES = 64 << 10
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Warning)\b.*")
"""The last line of a Python traceback: ``ValueError: what went wrong``."""
ROUTINE_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ \S+ (DEBUG|INFO) ")
"""A log record below WARNING, as the processes log (``diloco_cli.cli.internal``): what
went well, never why a child died."""


def last_error(log_path: Path, start: int = 0) -> str | None:
    """The line of the log, from byte ``start`` on (the child's own output), that best
    says why the child died: the last exception line (the end of a traceback), else its
    last line that is not a routine log record, else None (a child killed while it
    logged only progress)."""
    try:
        with open(log_path, "rb") as log:
            log.seek(max(start, log.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
            tail = log.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    lines = [
        line.strip()
        for line in tail.splitlines()
        if line.strip() and not line.startswith("[supervisor ") and not ROUTINE_LINE.match(line)
    ]
    exceptions = [line for line in lines if EXCEPTION_LINE.match(line)]
    found = exceptions[-1] if exceptions else lines[-1] if lines else None
    return found[:300] if found else None


def exit_reason(code: int) -> str:
    """``exit 3``, or ``killed by SIGKILL`` for a child a signal ended."""
    if code >= 0:
        return f"exit {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def _write_state(path: Path, **state: Any) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps({**state, "supervisor_pid": os.getpid(), "time": time.time()}))
    os.replace(temporary, path)


def supervise(
    command: list[str], log_path: Path, state_path: Path, max_crashes: int = 10, max_backoff: float = 30.0
) -> int:
    stopping = False
    child: subprocess.Popen | None = None

    def stop(signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    restarts = crashes = 0
    error: str | None = None
    with open(log_path, "ab", buffering=0) as log:

        def note(message: str) -> None:
            log.write(f"[supervisor {time.strftime('%Y-%m-%d %H:%M:%S')}] {message}\n".encode())

        while True:
            started, output_from = time.monotonic(), log.tell()
            note(f"starting (restart {restarts}): {' '.join(command)}")
            child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            running = {"child_pid": child.pid, "restarts": restarts, "last_error": error, "command": command}
            _write_state(state_path, state="running", crashes=crashes, **running)
            try:
                code = child.wait(timeout=HEALTHY_SECONDS)
            except subprocess.TimeoutExpired:  # healthy: no longer a crash loop
                if crashes:
                    _write_state(state_path, state="running", crashes=0, **running)
                code = child.wait()
            if stopping:
                note(f"stopped (exit {code})")
                _write_state(state_path, state="stopped", exit_code=code, restarts=restarts)
                return 0
            if code == 0:
                note("finished")
                _write_state(state_path, state="finished", exit_code=0, restarts=restarts)
                return 0
            crashes = 1 if time.monotonic() - started >= HEALTHY_SECONDS else crashes + 1
            error = last_error(log_path, output_from) or exit_reason(code)
            if crashes >= max_crashes:
                note(f"exit {code}: gave up after {crashes} crashes in a row")
                _write_state(
                    state_path, state="failed", exit_code=code, restarts=restarts, crashes=crashes, last_error=error
                )
                return 1
            delay = min(max_backoff, 2.0 ** (crashes - 1))
            note(f"exit {code}: restarting in {delay:.0f} s")
            _write_state(
                state_path, state="restarting", exit_code=code, restarts=restarts + 1, crashes=crashes, last_error=error
            )
            deadline = time.monotonic() + delay
            while time.monotonic() < deadline and not stopping:
                time.sleep(0.1)
            if stopping:
                _write_state(state_path, state="stopped", exit_code=code, restarts=restarts)
                return 0
            restarts += 1


def main(argv: list[str]) -> int:
    """``python -m diloco_cli.launch.supervisor LOG STATE -- COMMAND...``"""
    separator = argv.index("--")
    log_path, state_path = (Path(p) for p in argv[:separator])
    return supervise(argv[separator + 1 :], log_path, state_path)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
