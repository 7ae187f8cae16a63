"""The processes of a run, and where each runs: the syncer (its shards), each region's
reducer, the learners.

One list, made from the resolved run, that every launcher starts from (``up`` here and
over SSH, ``resume``, ``scale``): each :class:`Service` has a name (its log, its
supervisor's record), a kind, a host (``local`` or a region's host) and the arguments of
its ``python -m diloco_cli`` command.  The syncer and the reducers are CPU processes of
one thread each; a learner may be a ``torchrun`` group.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from diloco_cli.launch.devices import device_environment
from diloco_cli.store.run_spec import RunSpec

SYNCER = "syncer"


@dataclass(frozen=True)
class Service:
    name: str
    kind: str
    """``syncer``, ``reducer`` or ``learner``."""
    host: str
    arguments: tuple[str, ...]
    """What follows ``python -m diloco_cli`` (the manifest and secret file come after)."""
    processes: int = 1
    """Processes of a learner under ``torchrun`` (1: a plain process)."""
    environment: tuple[tuple[str, str], ...] = ()
    """What its processes need in their environment besides threads (a learner's GPUs)."""

    @property
    def single_threaded(self) -> bool:
        """A CPU process of one thread (the syncer and reducers), not a learner."""
        return self.kind != "learner"

    def command(self, python: str, manifest: str, secret_file: str, nodes: int = 1) -> list[str]:
        """The command line, with ``python`` the interpreter to run it with.  A learner
        spanning ``nodes`` > 1 nodes of a Slurm job: ``srun`` starts one task per node,
        each that node's ``torchrun`` (:mod:`diloco_cli.launch.slurm_node`); a task that
        fails ends the others, so its supervisor sees one failure and restarts them all."""
        arguments = ["-m", "diloco_cli", *self.arguments, "--manifest", manifest, "--secret-file", secret_file]
        if nodes > 1:
            node = [python, "-m", "diloco_cli.launch.slurm_node", str(self.processes), "--", *arguments]
            return ["srun", f"--nodes={nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1", *node]
        if self.processes > 1:
            return [
                python,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={self.processes}",
                *arguments,
            ]
        return [python, *arguments]


def services(spec: RunSpec, names: Collection[str] | None = None) -> list[Service]:
    """The run's processes (those named, if ``names`` is given): the syncer (``syncer``,
    or each shard's ``syncer-<s>`` with ``sync.shards`` > 1), the regions' reducers (each
    reduces for every syncer shard), the learners, in that order."""
    found = [
        Service(
            shard.name,
            "syncer",
            shard.host,
            ("_syncer",) if shard.name == SYNCER else ("_syncer", "--shard", str(shard.index)),
        )
        for shard in spec.syncer_shards
    ]
    found += [
        Service(reducer.name, "reducer", reducer.host, ("_reducer", "--region", reducer.region))
        for reducer in spec.reducers
    ]
    found += [
        Service(
            learner.id,
            "learner",
            learner.host,
            ("_learner", "--learner", learner.id),
            learner.processes,
            tuple(device_environment(learner).items()),
        )
        for learner in spec.learners
    ]
    return found if names is None else [service for service in found if service.name in names]
