"""Getting the project onto a host: build a wheel once, copy it, install it into the
host's environment; skipped when the host already has this exact build.

The wheel is built from the project's source tree and cached by a hash of that source,
so a second ``up`` rebuilds nothing and, when the host's environment carries the same
hash, copies and installs nothing either.  It is platform independent (``py3-none-any``,
the codec's C source inside it): any supported Python on any platform installs it, and
the host compiles the kernels for itself after installing (without a compiler the codec
uses its torch path).
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import paramiko

import diloco_cli
from diloco_cli import __version__
from diloco_cli.config.regions import HostConfig
from diloco_cli.launch.ssh import SSHError, expand_home, put_file, run

MARK = ".diloco-source"

INSTALL = r"""
import fcntl, os, subprocess, sys
venv, digest, requirement, *extra = sys.argv[1:]
mark = os.path.join(venv, ".diloco-source")
os.makedirs(os.path.dirname(venv) or ".", exist_ok=True)
with open(venv + ".lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # hosts that share a home directory install once
    if os.path.exists(mark) and open(mark).read().strip() == digest:
        print("up to date")
        sys.exit(0)
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", venv], check=True)
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--retries", "2",
                    "--timeout", "30", "--upgrade", requirement, *extra], check=True)
    kernels = subprocess.run([python, "-m", "diloco_cli.codec.build"], capture_output=True, text=True)
    print(kernels.stdout.strip() or kernels.stderr.strip()[-300:])
    with open(mark, "w") as handle:
        handle.write(digest)
    print("installed")
"""
"""Runs on the host with its own Python: create or refresh the environment under a lock."""
SOURCE_DATE_EPOCH = "1700000000"
"""Fixed zip timestamps: the same source builds the same wheel."""


@dataclass(frozen=True)
class Distribution:
    """What hosts install: a wheel of this source tree, or the released version."""

    requirement: str
    """A path to a wheel, or ``diloco-cli==VERSION`` for the package index."""
    source_hash: str
    wheel: Path | None = None


def project_root() -> Path | None:
    """The source tree diloco runs from, if it runs from one (not from an installed wheel)."""
    root = Path(diloco_cli.__file__).resolve().parent.parent
    return root if (root / "pyproject.toml").exists() and (root / "setup.py").exists() else None


def source_files(root: Path) -> list[Path]:
    """What a wheel is built from: the project's files, no build products."""
    files = [root / "pyproject.toml", root / "setup.py", root / "README.md"]
    return files + sorted(
        p
        for p in (root / "diloco_cli").rglob("*")
        if p.is_file() and p.suffix not in (".pyc", ".so") and "__pycache__" not in p.parts
    )


def source_hash(root: Path) -> str:
    digest = hashlib.sha256()
    for path in source_files(root):
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        digest.update(path.read_bytes() if path.exists() else b"")
    return digest.hexdigest()[:20]


def build_distribution(cache_dir: Path) -> Distribution:
    """The wheel of this source tree (built once per source hash), or the released version."""
    root = project_root()
    if root is None:
        return Distribution(requirement=f"diloco-cli=={__version__}", source_hash=f"release-{__version__}")
    digest = source_hash(root)
    target = cache_dir / digest
    wheels = sorted(target.glob("diloco_cli-*.whl"))
    if not wheels:
        target.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="diloco-wheel-") as clean:  # no stale build products
            for path in source_files(root):
                copy = Path(clean) / path.relative_to(root)
                copy.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, copy)
            command = [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "--no-deps",
                "--no-build-isolation",
                "--quiet",
                "-w",
                str(target),
                clean,
            ]
            environment = {**os.environ, "SOURCE_DATE_EPOCH": SOURCE_DATE_EPOCH, "DILOCO_PURE_WHEEL": "1"}
            result = subprocess.run(command, capture_output=True, text=True, env=environment)
        if result.returncode != 0:
            raise SSHError(f"building a wheel of {root} failed:\n{result.stderr[-2000:]}")
        wheels = sorted(target.glob("diloco_cli-*.whl"))
    return Distribution(requirement=str(wheels[-1]), source_hash=digest, wheel=wheels[-1])


def installed_hash(client: paramiko.SSHClient, host: HostConfig) -> str | None:
    venv = expand_home(client, host.venv)
    result = run(client, f"cat {shlex.quote(venv + '/' + MARK)} 2>/dev/null")
    return result.stdout.strip() or None


def bootstrap_host(
    client: paramiko.SSHClient, host: HostConfig, distribution: Distribution, extras: list[str], progress=None
) -> str:
    """Create or refresh the host's environment with this distribution; returns what it did."""
    if installed_hash(client, host) == distribution.source_hash:
        return "up to date"
    venv = expand_home(client, host.venv)
    requirement = distribution.requirement
    if distribution.wheel is not None:
        remote_wheel = f"{venv}-wheels/{distribution.wheel.name}"
        put_file(client, distribution.wheel, remote_wheel, callback=progress)
        requirement = remote_wheel
    if extras:
        requirement += f"[{','.join(sorted(extras))}]"
    arguments = [venv, distribution.source_hash, requirement, *host.install]
    result = run(
        client,
        f"{shlex.quote(host.python)} -c {shlex.quote(INSTALL)} " + " ".join(shlex.quote(a) for a in arguments),
        timeout=3600,
    )
    if result.code != 0:
        raise SSHError(
            f"host {host.name}: installing diloco into {venv} failed:\n{(result.stderr or result.stdout)[-2000:]}"
        )
    if result.stdout.strip().endswith("up to date"):
        return "up to date"
    compiled = "kernels compiled" in result.stdout
    return "installed" if compiled else "installed (no C compiler there: the codec's torch path)"
