"""Each learner its own GPUs: a host's GPUs shared out among the learners it runs.

A host's GPUs are its ``gpus`` list in the region file, else every GPU ``nvidia-smi``
shows there (none on a host without it).  Its learners, in placement order, each take
the next ``processes_per_learner`` of them, so no two learners (nor two ``torchrun``
groups) share a GPU; a host whose learners need more GPUs than it has is refused before
anything starts.  A learner's processes see only its GPUs (``CUDA_VISIBLE_DEVICES``,
numbered as ``nvidia-smi`` numbers them), so local rank ``r`` trains on the learner's
``r``-th GPU.  With ``training.device: cpu``, or on hosts without GPUs, nothing is set.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Mapping, Sequence

from diloco_cli.config.errors import ConfigError
from diloco_cli.config.regions import LOCAL_HOST, RegionsFile
from diloco_cli.store.run_spec import LearnerSpec, RunSpec

NVIDIA_SMI_QUERY = ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"]
"""Lists a host's GPUs, one index a line (also run on SSH hosts by preflight)."""


def local_gpus() -> tuple[int, ...]:
    """The GPUs of this machine as ``nvidia-smi`` lists them; none without it."""
    if shutil.which(NVIDIA_SMI_QUERY[0]) is None:
        return ()
    try:
        listed = subprocess.run(NVIDIA_SMI_QUERY, capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise ConfigError(
            f"host local: nvidia-smi is there but fails ({error}); fix the driver or list gpus:"
        ) from None
    return tuple(int(line) for line in listed.split() if line.strip().isdigit())


def host_gpus(regions: RegionsFile, found: Mapping[str, Sequence[int]]) -> dict[str, tuple[int, ...]]:
    """Every host's GPUs to share out: its ``gpus`` list, else those ``found`` there
    (``nvidia-smi``); a listed GPU that ``nvidia-smi`` does not show is a ConfigError."""
    gpus: dict[str, tuple[int, ...]] = {}
    for region in regions.regions:
        for host in region.hosts:
            if host.slurm is not None:  # the scheduler gives each job its GPUs (and sets CUDA_VISIBLE_DEVICES)
                gpus[host.name] = ()
                continue
            present = tuple(found.get(host.name, ()))
            if host.gpus is None:
                gpus.setdefault(host.name, present)
                continue
            missing = sorted(set(host.gpus) - set(present)) if present else []
            if missing:
                raise ConfigError(
                    f"host {host.name}: gpus lists {', '.join(map(str, missing))}, which nvidia-smi does not show "
                    f"there (it shows {', '.join(map(str, present))}); list GPUs the host has"
                )
            if host.name in gpus and gpus[host.name] != tuple(host.gpus):
                raise ConfigError(f"host {host.name}: its regions list different gpus; list the same on each")
            gpus[host.name] = tuple(host.gpus)
    return gpus


def share_out(learners: Sequence[LearnerSpec], gpus: Mapping[str, Sequence[int]]) -> tuple[LearnerSpec, ...]:
    """The learners with their GPUs: on each host with GPUs, each learner in turn takes
    the next ``processes`` of them.  A ConfigError names a host whose learners need more."""
    taken: dict[str, int] = {}
    placed = []
    for learner in learners:
        available = tuple(gpus.get(learner.host, ()))
        if not available:
            placed.append(learner)
            continue
        first = taken.get(learner.host, 0)
        taken[learner.host] = first + learner.processes
        placed.append(learner.model_copy(update={"devices": available[first : first + learner.processes]}))
    for host, needed in taken.items():
        available = tuple(gpus[host])
        if needed > len(available):
            on_host = sum(1 for learner in learners if learner.host == host)
            learners_need = f"{on_host} learner{'s need' if on_host > 1 else ' needs'}"
            raise ConfigError(
                f"host {host}: its {learners_need} {needed} GPUs, one per process; "
                f"it has {len(available)} ({', '.join(map(str, available))}); lower learners or "
                "processes_per_learner there, or list more GPUs in gpus:"
            )
    return tuple(placed)


def with_devices(spec: RunSpec, regions: RegionsFile, found: Mapping[str, Sequence[int]]) -> RunSpec:
    """The run with every learner's GPUs (none when the recipe trains on the CPU)."""
    if spec.recipe.training.device == "cpu":
        return spec
    return spec.model_copy(update={"learners": share_out(spec.learners, host_gpus(regions, found))})


def found_gpus(regions: RegionsFile, facts: Mapping[str, Mapping]) -> dict[str, tuple[int, ...]]:
    """The GPUs ``nvidia-smi`` shows on every host: this machine's, and each SSH host's
    from its preflight ``facts``."""
    found = {name: tuple(fact.get("gpus") or ()) for name, fact in facts.items()}
    if any(host.is_local for region in regions.regions for host in region.hosts):
        found[LOCAL_HOST] = local_gpus()
    return found


def device_environment(learner: LearnerSpec) -> dict[str, str]:
    """What a learner's processes need in their environment to see only its GPUs."""
    if not learner.devices:
        return {}
    return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ",".join(map(str, learner.devices))}
