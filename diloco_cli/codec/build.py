"""Compiling the codec's C kernels for the interpreter that runs diloco.

The kernels (``_kernels.c``) are plain C loaded with ctypes, without the Python C API,
so one source serves every Python version and platform: ``pip install`` of the source
tree compiles them (``setup.py``), and a host that received the platform-independent
wheel compiles them on the host after installing it (``python -m
diloco_cli.codec.build``, which ``diloco up`` runs there).  Without a C compiler the
codec uses its torch path, which computes the same bytes, more slowly.

This module imports nothing from diloco, so that ``setup.py`` can read its flags.
"""

from __future__ import annotations

import importlib.machinery
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-strict-aliasing"]
"""No contraction of a*b+c into fma: decoding must round q*scale to fp32 exactly like the
torch path, on every architecture."""

SOURCE = Path(__file__).with_name("_kernels.c")


def kernels_path() -> Path:
    """Where the compiled kernels go (and where the codec looks for them)."""
    return SOURCE.with_name("_kernels" + importlib.machinery.EXTENSION_SUFFIXES[0])


def compile_kernels() -> tuple[Path | None, str]:
    """Compile the kernels next to their source; returns (the library or None, what happened)."""
    compiler = shlex.split(sysconfig.get_config_var("CC") or "cc")
    target = kernels_path()
    command = [*compiler, *FLAGS, "-shared", "-fPIC", str(SOURCE), "-o", str(target)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as error:
        return None, f"no C compiler ({error}); the codec uses its torch path"
    if result.returncode != 0:
        return None, f"compiling the kernels failed ({result.stderr.strip()[-300:]}); the codec uses its torch path"
    return target, f"kernels compiled: {target.name}"


if __name__ == "__main__":
    library, outcome = compile_kernels()
    print(outcome)
    sys.exit(0)
