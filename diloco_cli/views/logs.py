"""``diloco logs``: print log files, and with ``--follow`` keep printing what they gain."""

from __future__ import annotations

import sys
import time
from pathlib import Path


def stream_logs(paths: dict[str, Path], follow: bool, poll_seconds: float = 0.2) -> None:
    """Print each log whole (headed by its name when there are several), then, when
    following, every new line as it is written (prefixed by its process) until Ctrl-C."""
    several = len(paths) > 1
    handles = {}
    for name, path in paths.items():
        if several:
            sys.stdout.write(f"==> {name} <==\n")
        if not path.exists():
            sys.stdout.write("(no output yet)\n")
            continue
        handle = open(path, "rb")  # noqa: SIM115 - kept open while following
        sys.stdout.write(handle.read().decode(errors="replace"))
        handles[name] = handle
    sys.stdout.flush()
    try:
        while follow:
            wrote = False
            for name, path in paths.items():
                if name not in handles and path.exists():
                    handles[name] = open(path, "rb")  # noqa: SIM115
                handle = handles.get(name)
                for line in handle.readlines() if handle else []:
                    sys.stdout.write((f"{name}: " if several else "") + line.decode(errors="replace"))
                    wrote = True
            if wrote:
                sys.stdout.flush()
            time.sleep(poll_seconds)
    except KeyboardInterrupt:
        pass
    finally:
        for handle in handles.values():
            handle.close()
