"""The region file: where learners run, where each region's bucket is, where the syncer is.

``regions/local.yaml`` spells out the default: two regions of two learners each, as
processes on this machine, each region with its own ``file://`` bucket under
``./runs/<run>/``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from diloco_cli.core.types import LearnerId, RegionName

FROZEN = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

CREDENTIAL_KEYS = frozenset(
    {"key", "secret", "token", "password", "aws_access_key_id", "aws_secret_access_key", "session_token", "client_secret"}
)
"""Storage options that would put a credential into a file that travels with the run."""

NON_SECRET_TOKENS = frozenset({"anon", "google_default", "cloud", "browser"})
"""gcsfs ``token`` values that name a way to authenticate rather than a credential."""

LOCAL_HOST = "local"


class HostConfig(BaseModel):
    """A machine that runs learners: this one (``local``) or one reached over SSH."""

    model_config = FROZEN

    name: str = Field(default=LOCAL_HOST, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """A short name for the host, used in learner names, logs and status."""

    learners: int = Field(default=1, ge=1)
    """Learners started on this host."""

    processes_per_learner: int = Field(default=1, ge=1)
    """Processes per learner (``torchrun --nproc-per-node``); they train one learner
    together with torch.distributed and only rank 0 talks to storage."""

    @property
    def is_local(self) -> bool:
        return self.name == LOCAL_HOST


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

    @model_validator(mode="after")
    def _no_inline_credentials(self) -> RegionConfig:
        inline = sorted(
            key
            for key, value in self.storage_options.items()
            if key.lower() in CREDENTIAL_KEYS and not (key.lower() == "token" and value in NON_SECRET_TOKENS)
        )
        if inline:
            raise ValueError(
                f"storage_options of region {self.name!r} hold credentials ({', '.join(inline)}): "
                "set them in the environment (AWS_ACCESS_KEY_ID, GOOGLE_APPLICATION_CREDENTIALS, ...) "
                "or name a profile instead"
            )
        return self

    def run_root(self, run: str, runs_dir: str) -> str:
        """The URL under which this run's objects live in this region's bucket."""
        bucket = self.bucket.replace("{runs_dir}", runs_dir)
        if "{run}" in bucket:
            return bucket.replace("{run}", run).rstrip("/")
        return f"{bucket.rstrip('/')}/{run}"

    @property
    def num_learners(self) -> int:
        return sum(host.learners for host in self.hosts)


class SyncerPlacement(BaseModel):
    """Where the syncer runs and keeps its state."""

    model_config = FROZEN

    host: str = LOCAL_HOST
    """``local`` (the machine that runs ``diloco up``) or the name of a host of a region."""

    home: str = "file://{runs_dir}/{run}/syncer"
    """fsspec URL of the syncer's own store (its state and ledger); ``{run}`` and
    ``{runs_dir}`` are replaced as in bucket URLs."""

    storage_options: dict[str, Any] = Field(default_factory=dict)
    """Filesystem options for ``home``."""


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

    @model_validator(mode="after")
    def _unique_names(self) -> RegionsFile:
        names = [region.name for region in self.regions]
        if len(set(names)) != len(names):
            raise ValueError(f"region names must be unique, got {names}")
        if not self.regions:
            raise ValueError("at least one region is needed")
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

    def region(self, name: RegionName | str) -> RegionConfig:
        for region in self.regions:
            if region.name == name:
                return region
        raise KeyError(name)
