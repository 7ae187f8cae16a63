"""Fixtures the integration tests share."""

import pytest


@pytest.fixture(scope="session")
def host_venv(tmp_path_factory):
    """One environment shared by every test host (they share this filesystem), installed
    once a session through diloco's own bootstrap over a loopback sshd, with the package
    index reachable; hosts inside network namespaces then find it up to date."""
    from tests.support.hosts import install_host_venv

    return install_host_venv(tmp_path_factory.mktemp("hostenv"))
