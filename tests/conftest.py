import os
import shutil
import subprocess

# gcsfs must see this before it is first imported (else it hangs on a gRPC call).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

SYSTEM_TOOLS = {
    "/usr/sbin/sshd": "openssh-server",
    "tmux": "tmux",
    "ip": "iproute2",
    "chromium": "chromium",
    "chromedriver": "chromium-driver",
    "/usr/sbin/slurmctld": "slurm-wlm",
    "/usr/sbin/munged": "munge",
}
"""What the tests drive for real (sshd for SSH hosts, tmux for the live view, ip/tc for
network namespaces, a headless chromium for the HTML report, a Slurm cluster for Slurm
regions), by the Debian package that provides it."""

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402


def pytest_sessionstart(session):
    """Install the system tools the tests need where this machine allows it (root with
    apt-get, as on a fresh CI machine); elsewhere the tests that need a missing one fail
    saying which package to install.  Under pytest-xdist only the controller installs,
    before it starts the workers."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    missing = sorted({package for tool, package in SYSTEM_TOOLS.items() if shutil.which(tool) is None})
    if not missing or os.geteuid() != 0 or shutil.which("apt-get") is None:
        return
    print(f"installing what the tests drive: {' '.join(missing)}", flush=True)
    environment = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=environment, stdout=subprocess.DEVNULL)
    subprocess.run(
        ["apt-get", "install", "-y", "-qq", *missing], check=True, env=environment, stdout=subprocess.DEVNULL
    )


settings.register_profile("default", deadline=None, max_examples=40)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

torch.set_num_threads(1)


@pytest.fixture
def s3(monkeypatch):
    """A moto S3 server, its address and dummy credentials in the environment."""
    from testbed.servers import moto_s3_server

    with moto_s3_server() as server:
        for variable, value in server.env.items():
            monkeypatch.setenv(variable, value)
        yield server


@pytest.fixture(scope="session")
def secret():
    from diloco_cli.codec import RunSecret

    return RunSecret(bytes(range(32)))


def pytest_addoption(parser):
    parser.addoption(
        "--chaos-seconds",
        type=int,
        default=12,
        help="how long tests/integration/test_chaos.py strikes, in seconds (CI: 12)",
    )
    parser.addoption("--chaos-seed", type=int, default=1, help="the seed of its events")
    parser.addoption(
        "--kill-seeds",
        type=int,
        default=1,
        help="how many seeded runs tests/integration/test_faults.py kills the syncer in (CI: 1)",
    )


@pytest.fixture(autouse=True)
def _no_local_process_outlives_its_test(request):
    """A test that fails half-way leaves its run's processes behind: stop them."""
    tmp_path = request.getfixturevalue("tmp_path") if "tmp_path" in request.fixturenames else None
    yield
    if tmp_path is None:
        return
    runs_dir = tmp_path / "runs"
    if runs_dir.exists():
        from diloco_cli.launch.local import stop_local
        from diloco_cli.launch.runs import list_runs

        for record in list_runs(runs_dir):
            stop_local(record, timeout=5)


@pytest.fixture
def harness(tmp_path, secret):
    """A syncer and two learners of one region, advanced by hand (tests/support/harness.py)."""
    from tests.support.harness import Harness

    made = Harness(tmp_path, secret)
    yield made
    made.close()
