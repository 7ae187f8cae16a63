"""The region file: where learners run, where each region's bucket is, where the syncer is.

``regions/local.yaml`` spells out the default: two regions of two learners each, as
processes on this machine, each region with its own ``file://`` bucket under
``./runs/<run>/``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from diloco_cli.config.credentials import refuse_inline_credentials
from diloco_cli.core.types import LearnerId, RegionName

FROZEN = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
"""Every section: read-only once loaded, no unknown key, no nan or infinity in a number."""

LOCAL_HOST = "local"

SECRET_ENVIRONMENT = ("SECRET", "TOKEN", "PASSWORD", "CREDENTIAL", "PRIVATE_KEY")
"""Environment variable names that hold secrets rather than point at them."""


class SlurmJobs(BaseModel):
    """A host that is a Slurm cluster's login node: the run's processes placed on it (its
    learners, and the region's reducer and the syncer where they go there) are submitted
    there with ``sbatch``, one job each, and run on the compute nodes the scheduler picks;
    its ``venv`` and ``work_dir`` must be on a file system the compute nodes share."""

    model_config = FROZEN

    partition: str = Field(pattern=r"^[A-Za-z0-9._-]+$")
    """The partition the jobs go to (``sbatch --partition``)."""

    account: str | None = Field(default=None, pattern=r"^[A-Za-z0-9._-]+$")
    """The account charged (``--account``); default: the user's default account."""

    qos: str | None = Field(default=None, pattern=r"^[A-Za-z0-9._-]+$")
    """The quality of service (``--qos``)."""

    time_limit: str | None = Field(default=None, pattern=r"^(\d+-)?\d+(:\d{2}){0,2}$")
    """Each job's time limit (``--time``: minutes, ``HH:MM:SS`` or ``D-HH:MM:SS``); before
    it, the job is signalled, its learner checkpoints where it stands and the job is
    requeued to go on from there."""

    signal_seconds: int = Field(default=120, ge=10)
    """How long before the time limit the job is signalled (``--signal=B:TERM@...``)."""

    gpus_per_learner: int = Field(default=0, ge=0)
    """GPUs each learner's job asks for on each of its nodes (``--gres=gpu:N``); its
    processes there share them."""

    nodes_per_learner: int = Field(default=1, ge=1)
    """Nodes each learner's job spans (``--nodes``).  Above 1 the learner is one
    ``torchrun`` group over them: ``srun`` starts a ``torchrun`` of the host's
    ``processes_per_learner`` processes on each node, rank 0 (the one that talks to
    storage) on the job's first node, where the others meet it."""

    cpus_per_task: int = Field(default=1, ge=1)
    """CPUs each learner's job asks for (``--cpus-per-task``, on each of its nodes); the
    reducer's and the syncer's jobs ask for one."""

    memory: str | None = Field(default=None, pattern=r"^\d+[KMGT]?$")
    """Memory per learner's job (``--mem``, e.g. ``64G``); default: the partition's."""

    sbatch_options: tuple[str, ...] = ()
    """More ``sbatch`` options, each one ``--name=value`` (e.g. ``--constraint=a100``)."""

    setup: tuple[str, ...] = ()
    """Shell lines each job runs before diloco starts, e.g. ``module load cuda/12.4``."""

    @model_validator(mode="after")
    def _options_are_options(self) -> SlurmJobs:
        bad = [option for option in self.sbatch_options if not option.startswith("--") or "\n" in option]
        if bad:
            raise ValueError(f"sbatch_options {bad} are not options: give each as one '--name=value'")
        if any("\n" in line for line in self.setup):
            raise ValueError("setup lines are one shell line each: give a list of lines")
        return self


class HostConfig(BaseModel):
    """A machine that runs learners: this one (``local``) or one reached over SSH."""

    model_config = FROZEN

    name: str = Field(default=LOCAL_HOST, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """A short name for the host, used in logs and status; ``local`` is this machine."""

    learners: int = Field(default=1, ge=1)
    """Learners started on this host."""

    processes_per_learner: int = Field(default=1, ge=1)
    """Processes per learner (``torchrun --nproc-per-node``); they train one learner
    together with torch.distributed and only rank 0 talks to storage."""

    gpus: tuple[int, ...] | None = None
    """The GPUs (as ``nvidia-smi`` numbers them) this host's learners share out, each
    learner taking the next ``processes_per_learner`` of them; null: every GPU
    ``nvidia-smi`` shows on the host (none where it is missing).  A host whose learners
    need more GPUs than this is refused before anything starts."""

    address: str | None = None
    """Hostname or IP address to reach over SSH (required unless the host is ``local``)."""

    port: int = Field(default=22, ge=1, le=65535)
    """SSH port."""

    user: str | None = None
    """SSH user (default: yours)."""

    key_file: str | None = None
    """Private key for SSH (default: your agent and ~/.ssh keys)."""

    python: str = "python3"
    """The interpreter on the host that creates the environment below."""

    venv: str = "~/.diloco/venv"
    """The Python environment diloco creates (with --system-site-packages, so a torch
    already on the host is reused) or refreshes on the host, and runs from."""

    install: tuple[str, ...] = ()
    """Extra pip requirements installed with diloco, e.g. ``torch==2.13.*``; torch is
    only installed when named here (diloco never pulls a multi-GB build on its own)."""

    work_dir: str = "~/.diloco/runs"
    """Where run files live on the host: the secret (mode 0600), logs, process state."""

    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables for the processes on this host (e.g. AWS_PROFILE); not for
    secrets."""

    slurm: SlurmJobs | None = None
    """This host is a Slurm cluster's login node: the processes placed on it run as jobs
    (docs/regions.md, "A region on a Slurm cluster")."""

    @property
    def is_local(self) -> bool:
        return self.name == LOCAL_HOST

    @model_validator(mode="after")
    def _remote_hosts_have_an_address(self) -> HostConfig:
        if not self.is_local and not self.address:
            raise ValueError(f"host {self.name!r} needs an address (or name it 'local' to run on this machine)")
        if self.is_local and self.slurm is not None:
            raise ValueError("a Slurm login node is reached over SSH: give the host a name and an address")
        if self.slurm is not None and self.gpus is not None:
            raise ValueError(
                f"host {self.name!r} is a Slurm login node: its jobs get GPUs from the scheduler "
                "(slurm.gpus_per_learner), not from a gpus list"
            )
        return self

    @model_validator(mode="after")
    def _gpus_through_the_gpus_list(self) -> HostConfig:
        repeated = sorted({gpu for gpu in self.gpus or () if (self.gpus or ()).count(gpu) > 1})
        if repeated:
            raise ValueError(
                f"gpus of host {self.name!r} lists {', '.join(map(str, repeated))} more than once: "
                "each learner gets GPUs of its own; list each GPU once"
            )
        if "CUDA_VISIBLE_DEVICES" in self.env:
            raise ValueError(
                f"env of host {self.name!r} sets CUDA_VISIBLE_DEVICES: diloco gives each learner its own GPUs; "
                "list the GPUs its learners may use in gpus: instead"
            )
        return self

    @model_validator(mode="after")
    def _no_secrets_in_environment(self) -> HostConfig:
        secrets = sorted(
            name
            for name in self.env
            if any(word in name.upper() for word in SECRET_ENVIRONMENT)
            and not name.upper().endswith(("_FILE", "_PATH"))
        )
        if secrets:
            raise ValueError(
                f"env of host {self.name!r} sets {', '.join(secrets)}: secrets stay on the host "
                "(its ~/.aws/credentials, an instance role); "
                "point at them instead (AWS_PROFILE, AWS_SHARED_CREDENTIALS_FILE)"
            )
        return self


class RegionConfig(BaseModel):
    """One region: its bucket and its hosts."""

    model_config = FROZEN

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9-]{0,30}$")
    """The region's name: lowercase letters, digits and dashes (e.g. ``us-east``)."""

    bucket: str
    """fsspec URL of the region's bucket (``s3://...``, ``gs://...``, ``file://...``);
    ``{run}`` is replaced by the run's name, else the run lives under ``<bucket>/<run>``;
    ``{runs_dir}`` by the local runs directory (``./runs``)."""

    storage_options: dict[str, Any] = Field(default_factory=dict)
    """Filesystem options (endpoint_url, profile, ...).  Credentials come from the
    environment or a named profile, never from this file."""

    hosts: tuple[HostConfig, ...] = (HostConfig(),)
    """The hosts of this region."""

    data_source: str | None = None
    """This region's copy of the training text (an fsspec URL it can read fast), instead
    of the recipe's data.source; data stays in its region."""

    data_storage_options: dict[str, Any] = Field(default_factory=dict)
    """Filesystem options for ``data_source``."""

    reducer_host: str | None = None
    """The host of this region that runs its reducer (a CPU process beside the region's
    bucket that merges the region's sends before they cross the WAN); default: the
    region's first host."""

    @model_validator(mode="after")
    def _no_inline_credentials(self) -> RegionConfig:
        refuse_inline_credentials(self.storage_options, f"storage_options of region {self.name!r}")
        refuse_inline_credentials(self.data_storage_options, f"data_storage_options of region {self.name!r}")
        if self.reducer_host is not None and self.reducer_host not in {host.name for host in self.hosts}:
            names = ", ".join(host.name for host in self.hosts)
            raise ValueError(
                f"reducer_host {self.reducer_host!r} of region {self.name!r} is not one of its hosts ({names})"
            )
        return self

    @property
    def reducer(self) -> str:
        """The host that runs the region's reducer."""
        return self.reducer_host or self.hosts[0].name

    def run_root(self, run: str, runs_dir: str) -> str:
        """The URL under which this run's objects live in this region's bucket."""
        bucket = self.bucket.replace("{runs_dir}", runs_dir)
        if "{run}" in bucket:
            return bucket.replace("{run}", run).rstrip("/")
        return f"{bucket.rstrip('/')}/{run}"

    @property
    def num_learners(self) -> int:
        return sum(host.learners for host in self.hosts)


class SSHSettings(BaseModel):
    """How hosts are reached."""

    model_config = FROZEN

    known_hosts: str = "~/.ssh/known_hosts"
    """The known_hosts file host keys are checked against."""

    connect_timeout: float = Field(default=10.0, gt=0)
    """Seconds before an unreachable host is reported."""


class SyncerPlacement(BaseModel):
    """Where the syncer runs and keeps its state."""

    model_config = FROZEN

    host: str | None = None
    """``local`` (the machine that runs ``diloco up``) or the name of a host of a region.
    Default: the host of the first region's reducer, so that the syncer sits in that
    region's network and its traffic with that region's bucket never crosses the WAN
    (``local`` when that region's hosts are this machine)."""

    region: str | None = None
    """The region whose network the syncer's machine is in, for bandwidth reports: its
    traffic with that region's bucket is then region-local.  Default: the region of
    ``host`` when it is a region's host, the first region when ``host`` is not given,
    else (``host: local`` given for a multi-region run) a place of its own, every byte it
    moves crossing a link."""

    home: str = "file://{runs_dir}/{run}/syncer"
    """fsspec URL of the syncer's own store (its state and ledger); ``{run}`` and
    ``{runs_dir}`` are replaced as in bucket URLs.  Left at this default with the syncer
    on a region's host, it is ``<the region's run root>/syncer``, beside the run in that
    region's bucket."""

    storage_options: dict[str, Any] = Field(default_factory=dict)
    """Filesystem options for ``home``."""

    shard_hosts: tuple[str, ...] | None = None
    """With the recipe's ``sync.shards: N``, the host of each syncer shard, in shard
    order (N names; ``local`` or a host of a region, as ``host``); each shard's home is
    ``home`` with ``/shard-<s>`` appended (beside the run in the bucket of its host's
    region, when ``home`` is left at its default).  Default: every shard where ``host``
    says the syncer goes."""

    @model_validator(mode="after")
    def _no_inline_credentials(self) -> SyncerPlacement:
        refuse_inline_credentials(self.storage_options, "storage_options of the syncer")
        return self


class RegionsFile(BaseModel):
    """Where a run's learners and syncer go."""

    model_config = FROZEN

    regions: tuple[RegionConfig, ...] = (
        RegionConfig(name="local-a", bucket="file://{runs_dir}/{run}/buckets/local-a", hosts=(HostConfig(learners=2),)),
        RegionConfig(name="local-b", bucket="file://{runs_dir}/{run}/buckets/local-b", hosts=(HostConfig(learners=2),)),
    )
    """The regions, each with its own bucket."""

    syncer: SyncerPlacement = SyncerPlacement()
    """Where the syncer runs and keeps its state."""

    ssh: SSHSettings = SSHSettings()
    """How SSH hosts are reached."""

    @model_validator(mode="after")
    def _unique_names(self) -> RegionsFile:
        names = [region.name for region in self.regions]
        if len(set(names)) != len(names):
            raise ValueError(f"region names must be unique, got {names}")
        hosts: dict[str, HostConfig] = {}
        for region in self.regions:
            for host in region.hosts:
                if not host.is_local and host.name in hosts and hosts[host.name] != host:
                    raise ValueError(f"host {host.name!r} is described twice, differently")
                hosts[host.name] = host
        if not self.regions:
            raise ValueError("at least one region is needed")
        if self.syncer.region is not None and self.syncer.region not in names:
            raise ValueError(f"syncer.region {self.syncer.region!r} is not one of the regions ({', '.join(names)})")
        return self

    @property
    def num_learners(self) -> int:
        return sum(region.num_learners for region in self.regions)

    def learner_placements(self) -> list[tuple[LearnerId, RegionConfig, HostConfig]]:
        """Every learner with its region and host, in shard order: ``<region>-<n>``."""
        placements = []
        for region in self.regions:
            index = 0
            for host in region.hosts:
                for _ in range(host.learners):
                    placements.append((LearnerId(f"{region.name}-{index}"), region, host))
                    index += 1
        return placements

    def host(self, name: str) -> HostConfig:
        for region in self.regions:
            for host in region.hosts:
                if host.name == name:
                    return host
        raise KeyError(name)

    def remote_hosts(self) -> list[HostConfig]:
        """Every SSH host, once each, in file order."""
        seen: dict[str, HostConfig] = {}
        for region in self.regions:
            for host in region.hosts:
                if not host.is_local:
                    seen.setdefault(host.name, host)
        for name in (self.syncer_host(), *(self.syncer.shard_hosts or ())):
            if name != LOCAL_HOST:
                seen.setdefault(name, self.host(name))
        return list(seen.values())

    def syncer_host(self) -> str:
        """The host the syncer runs on (see :attr:`SyncerPlacement.host`)."""
        return self.syncer.host if self.syncer.host is not None else self.regions[0].reducer

    def syncer_region(self) -> str | None:
        """The region the syncer runs in (see :attr:`SyncerPlacement.region`), or None."""
        if self.syncer.region is not None:
            return self.syncer.region
        if self.syncer.host is None:
            return self.regions[0].name
        return self._region_of_host(self.syncer.host)

    def _region_of_host(self, name: str) -> str | None:
        for region in self.regions:
            if any(host.name == name and not host.is_local for host in region.hosts):
                return region.name
        return None

    def syncer_shard_places(self, shards: int) -> list[tuple[str, str | None]]:
        """(host, region) of each of ``shards`` syncer shards: as ``syncer.shard_hosts``
        names them (a shard on the syncer's host is in the syncer's region), else every
        one where the syncer goes.  The caller checks that the names are ``shards``."""
        hosts = self.syncer.shard_hosts or (self.syncer_host(),) * shards
        return [
            (host, self.syncer_region() if host == self.syncer_host() else self._region_of_host(host)) for host in hosts
        ]

    def region(self, name: RegionName | str) -> RegionConfig:
        for region in self.regions:
            if region.name == name:
                return region
        raise KeyError(name)
