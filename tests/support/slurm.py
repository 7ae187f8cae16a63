"""A real Slurm cluster for tests: two nodes (both this machine), three partitions.

    from tests.support.slurm import slurm_cluster

    with slurm_cluster(tmp_path) as cluster:
        cluster.env            # {"SLURM_CONF": ...}: for sbatch, squeue ... run here
        cluster.sshd_config    # sshd_config lines that give SSH sessions the same

Debian's packages (``apt-get install -y slurm-wlm munge``): ``munged`` on a socket of its
own with a key of its own, ``slurmctld`` and ``slurmd`` on free ports with their state,
spool and logs in a fresh folder (``../shared/spec/machine-notes.md`` has the settings
that run here: root, no cgroups).  Two ``slurmd`` (``-N``), each a node of its own name
on a port of its own: the partitions ``east`` and ``west`` hold the first node, ``pair``
both (for a job that spans two nodes).  Each node declares 2 GPUs (two character devices
of its own, as ``/dev/null``) so that GPU requests are checked as on a real cluster, and
the partitions oversubscribe the 2 cores (jobs do not wait for each other).  No
accounting storage, but a job completion log (``jobcomp/filetxt``), which ``sacct -c``
reads; ``squeue`` and ``scontrol show job`` keep a finished job for ``MinJobAge`` (60)
seconds, then forget it within a minute.  A requeued job waits ``cred_expire`` (10 s;
two minutes by default) before it may start again, and the scheduler looks at the queue
every 2 s, so requeues come back within seconds.  On exit every job is cancelled and the
daemons stopped.  Needs root.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

DAEMONS = ("/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd")
INSTALL_HINT = "apt-get install -y slurm-wlm munge"
PARTITIONS = {"east": 1, "west": 1, "pair": 2}
"""Each partition and how many nodes it has (the first, or both)."""
NODE_GPUS = 2


class SlurmUnavailable(RuntimeError):
    """Slurm's daemons are missing, or we cannot run them."""


@dataclass
class SlurmCluster:
    directory: Path
    conf: Path
    node: str
    """The first node (every partition has it)."""
    processes: list[subprocess.Popen]

    @property
    def nodes(self) -> tuple[str, str]:
        return (self.node, f"{self.node}-2")

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    @property
    def sshd_config(self) -> list[str]:
        """What an sshd in front of this cluster (its login node) adds to its config."""
        return [f"SetEnv SLURM_CONF={self.conf}"]

    def run(self, *command: str, check: bool = True) -> subprocess.CompletedProcess:
        """A Slurm command here (``squeue``, ``scontrol`` ...), as text."""
        return subprocess.run(
            command, env={**os.environ, **self.env}, capture_output=True, text=True, timeout=60, check=check
        )

    def jobs(self) -> list[str]:
        return self.run("squeue", "-h", "-o", "%i").stdout.split()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _require() -> None:
    missing = [daemon for daemon in DAEMONS if not os.access(daemon, os.X_OK)]
    if missing:
        raise SlurmUnavailable(f"{', '.join(missing)} not found: install Slurm with `{INSTALL_HINT}`")
    if os.geteuid() != 0:
        raise SlurmUnavailable("slurm_cluster needs root (its daemons run as root)")


def _config(directory: Path, nodes: tuple[str, str], munge_socket: Path) -> str:
    node = nodes[0]
    ports = f"SlurmctldPort={_free_port()}"
    partitions = "\n".join(
        f"PartitionName={name} Nodes={','.join(nodes[:count])} MaxTime=INFINITE State=UP OverSubscribe=FORCE:8"
        + (" Default=YES" if name == "east" else "")
        for name, count in PARTITIONS.items()
    )
    declared = "\n".join(
        f"NodeName={name} NodeAddr=127.0.0.1 Port={_free_port()} CPUs={os.cpu_count() or 2} RealMemory=4000 "
        f"Gres=gpu:{NODE_GPUS} State=UNKNOWN"
        for name in nodes
    )
    return f"""ClusterName=diloco-test
SlurmctldHost={node}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
{ports}
AuthType=auth/munge
AuthInfo=socket={munge_socket},cred_expire=10
StateSaveLocation={directory}/state
SlurmdSpoolDir={directory}/spool/%n
SlurmctldPidFile={directory}/slurmctld.pid
SlurmdPidFile={directory}/slurmd.%n.pid
SlurmctldLogFile={directory}/slurmctld.log
SlurmdLogFile={directory}/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
ReturnToService=2
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=2,sched_interval=2
KillWait=30
MinJobAge=60
JobCompType=jobcomp/filetxt
JobCompLoc={directory}/jobcomp.txt
{declared}
{partitions}
"""


@contextlib.contextmanager
def slurm_cluster(tmp_dir, start_timeout: float = 30.0) -> Iterator[SlurmCluster]:
    """Start munged, slurmctld and slurmd for one node with two partitions; stop them on exit."""
    _require()
    directory = Path(tempfile.mkdtemp(prefix="slurm-", dir=str(tmp_dir)))
    for folder in ("state", "spool"):
        (directory / folder).mkdir()
    node = socket.gethostname().split(".")[0]
    nodes = (node, f"{node}-2")
    for name in nodes:
        (directory / "spool" / name).mkdir()
    key = directory / "munge.key"
    key.write_bytes(os.urandom(128))
    key.chmod(0o400)
    munge_socket = directory / "munge.sock"
    conf = directory / "slurm.conf"
    conf.write_text(_config(directory, nodes, munge_socket))
    devices = []
    for index in range(NODE_GPUS):  # GPUs the node declares: character devices as /dev/null
        device = directory / f"gpu{index}"
        os.mknod(device, 0o666 | 0o020000, os.makedev(1, 3))
        devices.append(str(device))
    (directory / "gres.conf").write_text(f"Name=gpu File={directory}/gpu[0-{NODE_GPUS - 1}]\n")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    processes: list[subprocess.Popen] = []
    cluster = SlurmCluster(directory, conf, node, processes)
    munge = [
        "/usr/sbin/munged", "--foreground", "--force", f"--socket={munge_socket}", f"--key-file={key}",
        f"--pid-file={directory}/munged.pid", f"--log-file={directory}/munged.log",
        f"--seed-file={directory}/munged.seed",
    ]  # fmt: skip
    try:
        for command in (
            munge,
            ["/usr/sbin/slurmctld", "-D", "-f", str(conf)],
            *(["/usr/sbin/slurmd", "-D", "-f", str(conf), "-N", name] for name in nodes),
        ):
            log = open(directory / f"{Path(command[0]).name}{'.' + command[-1] if '-N' in command else ''}.out", "ab")
            processes.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
            time.sleep(0.5)
        deadline = time.monotonic() + start_timeout
        while True:
            shown = cluster.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout.split("\n")
            if len({line.split()[0] for line in shown if line.endswith(("idle", "mix"))}) == len(nodes):
                break
            if time.monotonic() > deadline or any(p.poll() is not None for p in processes):
                logs = "\n".join(
                    f"--- {path.name}\n{path.read_text(errors='replace')[-1500:]}"
                    for path in sorted(directory.glob("*.log")) + sorted(directory.glob("*.out"))
                )
                raise SlurmUnavailable(f"the test cluster did not come up (sinfo: {shown}):\n{logs}")
            time.sleep(0.3)
        yield cluster
    finally:
        if processes:
            cluster.run("scancel", "--full", "--user=root", check=False)
            deadline = time.monotonic() + 40
            while time.monotonic() < deadline and cluster.run("squeue", "-h", check=False).stdout.strip():
                time.sleep(0.5)
        for process in reversed(processes):
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        subprocess.run(["pkill", "-f", f"slurmstepd.*{directory}"], check=False)
        shutil.rmtree(directory / "spool", ignore_errors=True)
