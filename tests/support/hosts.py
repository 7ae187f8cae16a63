"""What the tests' SSH hosts run: one Python environment that every test host shares.

The test hosts (sshd servers on this machine, in namespaces or not, and a Slurm cluster's
login node) share this machine's file system, so one environment, installed once per
test session through diloco's own bootstrap over a loopback sshd, serves them all
(``tests/integration/conftest.py``'s ``host_venv``)."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.support.sshd import sshd_server

BASE_PYTHON = str(Path(getattr(sys, "_base_executable", sys.executable)).resolve())
"""The interpreter the hosts' environment is made from (not this test run's venv)."""


def install_host_venv(root: Path) -> str:
    """One environment shared by every test host (they share this filesystem), installed
    once here through diloco's own bootstrap over a loopback sshd, with the package index
    reachable; hosts inside network namespaces then find it up to date."""
    from diloco_cli.config.regions import HostConfig
    from diloco_cli.launch.bootstrap import bootstrap_host, build_distribution
    from diloco_cli.launch.ssh import SSHTarget, connect

    venv = str(root / "venv")
    (root / "sshd").mkdir()
    with sshd_server(root / "sshd") as server:
        known_hosts = root / "known_hosts"
        known_hosts.write_text(server.known_hosts_line() + "\n")
        host = HostConfig(
            name="installer",
            address=server.host,
            port=server.port,
            user=server.user,
            key_file=str(server.client_key_path),
            python=BASE_PYTHON,
            venv=venv,
            install=("torch==2.13.*",),
        )
        client = connect(
            SSHTarget("installer", server.host, server.port, server.user, str(server.client_key_path), str(known_hosts))
        )
        try:
            assert bootstrap_host(client, host, build_distribution(root / "wheels"), ["s3"]) == "installed"
            assert bootstrap_host(client, host, build_distribution(root / "wheels"), ["s3"]) == "up to date"
        finally:
            client.close()
    return venv
