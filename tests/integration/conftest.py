"""Fixtures the integration tests share."""

import fcntl

import pytest


@pytest.fixture(scope="session")
def host_venv(tmp_path_factory, worker_id):
    """One environment shared by every test host (they share this filesystem), installed
    once a session through diloco's own bootstrap over a loopback sshd, with the package
    index reachable; hosts inside network namespaces then find it up to date.  Under
    pytest-xdist the first worker that needs it installs it in the session's folder, and
    the other waits for it and uses it."""
    from tests.support.hosts import install_host_venv

    session = tmp_path_factory.getbasetemp()
    if worker_id != "master":
        session = session.parent  # the folder of this session's workers
    installed = session / "hostenv-installed"
    with open(session / "hostenv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not installed.exists():
            folder = session / "hostenv"
            folder.mkdir()
            installed.write_text(install_host_venv(folder))
    return installed.read_text()
