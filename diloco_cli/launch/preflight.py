"""Preflight: every SSH host checked in parallel, one table, the first problem per host.

SSH with the expected host key; a usable Python; torch usable (importable there, or named
in the host's ``install`` list); free disk; clock skew; its GPUs (``nvidia-smi``, to share
out among its learners: :mod:`diloco_cli.launch.devices`); and, from the host itself, a
probe object written to, read from and deleted in its region's bucket.
"""

from __future__ import annotations

import json
import shlex
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import paramiko

from diloco_cli.config.regions import HostConfig, RegionsFile
from diloco_cli.launch.devices import NVIDIA_SMI_QUERY
from diloco_cli.launch.ssh import SSHError, SSHTarget, connect, run

MIN_FREE_DISK = 2 << 30
MAX_CLOCK_SKEW_SECONDS = 5.0

FACTS = (
    f"NVIDIA_SMI = {NVIDIA_SMI_QUERY!r}\n"
    + r"""
import json, os, shutil, subprocess, sys, sysconfig, time
venv, work = (os.path.expanduser(a) for a in sys.argv[1:3])
def torch_in(python):
    try:
        out = subprocess.run([python, "-c", "import torch; print(torch.__version__)"],
                             capture_output=True, text=True, timeout=120)
    except OSError as error:
        return None, str(error)
    return (out.stdout.strip(), None) if out.returncode == 0 else (None, (out.stderr.strip().splitlines() or ["?"])[-1])
def gpus():
    if not shutil.which("nvidia-smi"):
        return []
    out = subprocess.run(NVIDIA_SMI, capture_output=True, text=True, timeout=60)
    return [int(line) for line in out.stdout.split() if line.strip().isdigit()]
existing = work
while not os.path.exists(existing):
    existing = os.path.dirname(existing) or "/"
venv_python = os.path.join(venv, "bin", "python")
has_venv = os.path.exists(venv_python)
torch_version, torch_error = torch_in(venv_python if has_venv else sys.executable)
print(json.dumps({"python": sys.version.split()[0], "version_info": list(sys.version_info[:2]),
    "platform": sysconfig.get_platform(),
    "cores": os.cpu_count(), "disk_free": shutil.disk_usage(existing).free, "venv": has_venv,
    "torch": torch_version, "torch_error": torch_error, "home": os.path.expanduser("~"), "gpus": gpus(),
    "compiler": shutil.which((sysconfig.get_config_var("CC") or "cc").split()[0]) is not None}))
"""
)


def target_of(host: HostConfig, regions: RegionsFile) -> SSHTarget:
    return SSHTarget(
        name=host.name,
        address=host.address or host.name,
        port=host.port,
        user=host.user,
        key_file=host.key_file,
        known_hosts=regions.ssh.known_hosts,
        connect_timeout=regions.ssh.connect_timeout,
    )


@dataclass
class HostReport:
    host: HostConfig
    regions: list[str]
    checks: dict[str, str] = field(default_factory=dict)
    problem: str | None = None
    facts: dict = field(default_factory=dict)
    client: paramiko.SSHClient | None = None

    def fail(self, check: str, problem: str) -> None:
        self.checks[check] = "FAIL"
        if self.problem is None:
            self.problem = problem


def check_host(host: HostConfig, regions: RegionsFile, accept_new_host_keys: bool) -> HostReport:
    report = HostReport(host, [r.name for r in regions.regions if any(h.name == host.name for h in r.hosts)])
    try:
        report.client = connect(target_of(host, regions), accept_new_host_keys)
    except SSHError as error:
        report.fail("ssh", str(error))
        return report
    report.checks["ssh"] = "ok"
    client = report.client
    started = time.time()
    facts = run(
        client,
        f"{shlex.quote(host.python)} -c {shlex.quote(FACTS)} {shlex.quote(host.venv)} {shlex.quote(host.work_dir)}",
        timeout=180,
    )
    if facts.code != 0:
        report.fail(
            "python",
            f"host {host.name}: {host.python} does not run: {(facts.stderr or facts.stdout).strip()[-300:]}; "
            "set python: in the region file",
        )
        return report
    report.facts = json.loads(facts.stdout.strip().splitlines()[-1])
    if tuple(report.facts["version_info"]) < (3, 10):
        report.fail(
            "python",
            f"host {host.name}: Python {report.facts['python']} is too old; diloco needs 3.10 or newer (set python:)",
        )
    else:  # what `up` ships is py3-none-any: any Python >= 3.10 on any platform installs it
        compiled = "" if report.facts["compiler"] else ", no C compiler: the codec's slower torch path"
        report.checks["python"] = f"{report.facts['python']} {report.facts['platform']}{compiled}"
    if report.facts["torch"]:
        report.checks["torch"] = report.facts["torch"]
    elif any(requirement.split("=")[0].split("<")[0].split(">")[0].strip() == "torch" for requirement in host.install):
        report.checks["torch"] = "to install"
    else:
        report.fail(
            "torch",
            f"host {host.name}: torch is not usable ({report.facts['torch_error']}); "
            "install the torch build you use there, "
            "or add it to the host's install list (e.g. install: ['torch==2.13.*'])",
        )
    free = report.facts["disk_free"]
    if free < MIN_FREE_DISK:
        report.fail(
            "disk",
            f"host {host.name}: only {free / 2**30:.1f} GiB free under {host.work_dir}; "
            f"diloco wants {MIN_FREE_DISK >> 30} GiB",
        )
    else:
        report.checks["disk"] = f"{free / 2**30:.0f} GiB"
    gpus = report.facts.get("gpus") or []
    report.checks["gpus"] = f"{len(gpus)} ({','.join(map(str, gpus))})" if gpus else "none"
    if host.slurm is not None:  # a login node: its jobs run on the cluster's nodes
        from diloco_cli.launch.slurm import check_cluster

        report.checks["gpus"] = "from Slurm"
        report.checks["slurm"], problem = check_cluster(client, host, report.regions)
        if problem is not None:
            report.fail("slurm", problem)
    before = time.time()
    remote = float(run(client, "date +%s.%N").stdout.strip() or 0)
    skew = remote - (before + time.time()) / 2
    report.facts["clock_skew"] = skew
    if abs(skew) > MAX_CLOCK_SKEW_SECONDS:
        report.fail(
            "clock",
            f"host {host.name}: clock is {skew:+.1f} s off; "
            "sync it (chrony or ntp): liveness and status ages depend on it",
        )
    else:
        report.checks["clock"] = f"{skew:+.2f} s"
    del started
    return report


def preflight(regions: RegionsFile, accept_new_host_keys: bool) -> list[HostReport]:
    """Check every SSH host in parallel."""
    hosts = regions.remote_hosts()
    if not hosts:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(hosts))) as pool:
        return list(pool.map(lambda host: check_host(host, regions, accept_new_host_keys), hosts))


def probe_buckets_from_hosts(
    reports: list[HostReport], roots: dict[str, tuple[str, dict]], venvs: dict[str, str], run_dirs: dict[str, str]
) -> None:
    """From each host, write, read and delete a probe object in each of its regions'
    buckets; from a Slurm login node, in a short job on a compute node (where its jobs
    run), its output in the run's folder there (``run_dirs``)."""

    def probe(report: HostReport) -> None:
        host = report.host
        where = "ok"
        for region in report.regions:
            root, options = roots[region]
            command = (
                f"{' '.join(f'{k}={shlex.quote(v)}' for k, v in host.env.items())} "
                f"{shlex.quote(venvs[host.name])}/bin/python -m diloco_cli _probe "
                f"--url {shlex.quote(root)} --storage-options {shlex.quote(json.dumps(options))}"
            ).strip()
            if host.slurm is not None:
                from diloco_cli.launch.slurm import run_probe_job

                where, problem = run_probe_job(report.client, host, command, f"{run_dirs[host.name]}/logs")
                if problem is not None:
                    report.fail("bucket", f"host {host.name}, region {region}: {problem}")
                    return
                continue
            result = run(report.client, command, timeout=120)
            if result.code != 0:
                message = (result.stderr.strip() or result.stdout.strip()).splitlines()[-1:] or ["?"]
                report.fail("bucket", f"host {host.name}, region {region}: {message[0]}")
                return
        report.checks["bucket"] = "ok" if where == "ok" else f"ok from {where}"

    with ThreadPoolExecutor(max_workers=max(1, min(16, len(reports)))) as pool:
        list(pool.map(probe, [r for r in reports if r.problem is None]))
