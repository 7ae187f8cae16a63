"""One node of a learner that spans several nodes of a Slurm job.

``srun`` starts this once on each node of the learner's job (``slurm.nodes_per_learner``);
it becomes that node's ``torchrun`` of ``processes_per_learner`` processes, numbered by the
node's place in the job (``SLURM_NODEID``), all meeting at the node ``srun`` ran from (the
job's first, ``SLURM_LAUNCH_NODE_IPADDR``), where rank 0, the one that talks to storage,
runs.  The port comes from the job id, so that two learners' jobs on one node do not meet.

    srun --nodes=2 --ntasks-per-node=1 python -m diloco_cli.launch.slurm_node 4 -- -m diloco_cli _learner ...
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

PORTS = (20000, 40000)
"""The range the rendezvous port is taken from (by job id)."""


def torchrun_command(python: str, processes: int, arguments: Sequence[str], environ: Mapping[str, str]) -> list[str]:
    """This node's ``torchrun`` for the learner command ``arguments`` (what follows ``python``)."""
    try:
        nodes, node, job = int(environ["SLURM_NNODES"]), int(environ["SLURM_NODEID"]), int(environ["SLURM_JOB_ID"])
        address = environ["SLURM_LAUNCH_NODE_IPADDR"]
    except (KeyError, ValueError) as error:
        raise SystemExit(
            f"diloco.launch.slurm_node runs under srun in a Slurm job (missing or bad {error}); "
            "diloco up starts it there for a learner with slurm.nodes_per_learner above 1"
        ) from None
    port = PORTS[0] + job % (PORTS[1] - PORTS[0])
    rendezvous = [
        "--nnodes",
        str(nodes),
        "--node-rank",
        str(node),
        "--master-addr",
        address,
        "--master-port",
        str(port),
    ]
    return [python, "-m", "torch.distributed.run", *rendezvous, f"--nproc-per-node={processes}", *arguments]


def main(argv: Sequence[str]) -> None:
    if len(argv) < 2 or argv[1] != "--" or not argv[0].isdigit():
        raise SystemExit("usage: python -m diloco_cli.launch.slurm_node PROCESSES -- -m diloco_cli _learner ...")
    command = torchrun_command(sys.executable, int(argv[0]), argv[2:], os.environ)
    sys.stdout.flush()
    os.execv(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
