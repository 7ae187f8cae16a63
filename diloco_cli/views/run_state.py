"""The state of a run, read from its buckets alone (any machine that can read them).

Heartbeats give the learners, ``global/syncer.json`` and ``global/head.json`` the syncer
and the global model; nothing here needs the run's secret.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from diloco_cli.runtime.run_spec import RunSpec

SYNCER_SILENT_SECONDS = 30.0
"""A syncer status older than this is reported as not reporting."""


@dataclass
class LearnerRow:
    learner: str
    region: str
    host: str
    state: str
    step: int
    total_steps: int
    tokens: int
    loss: float | None
    steps_per_second: float | None
    base_version: int | None
    staleness: int | None
    """Global versions since the oldest fragment this learner holds."""
    last_seen_seconds: float | None
    restarts: int
    bytes_up: int
    bytes_down: int


@dataclass
class RegionBytes:
    region: str
    learners_up: int = 0
    learners_down: int = 0
    syncer_up: int = 0
    """Bytes the syncer wrote to this region's bucket (updates, snapshots, heads)."""
    syncer_down: int = 0
    """Bytes the syncer read from it (payloads, markers, heartbeats)."""


@dataclass
class SyncerSummary:
    state: str
    last_merge_seconds_ago: float | None
    last_merge: dict[str, Any] | None
    merges: int
    merges_per_minute: int
    quorum: int | None
    effective_quorum: int | None
    grace_seconds: float | None
    live_learners: list[str]
    reasons: dict[str, str]


@dataclass
class RunStatus:
    run: str
    state: str
    version: int
    tokens: int
    heldout_loss: float | None
    elapsed_seconds: float
    learners: list[LearnerRow]
    syncer: SyncerSummary
    regions: list[RegionBytes] = field(default_factory=list)
    evaluations: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def collect_status(spec: RunSpec, now: float | None = None) -> RunStatus:
    now = time.time() if now is None else now
    buckets = spec.buckets(None)
    heartbeats: dict[str, dict] = {}
    syncer: dict[str, Any] | None = None
    head: dict[str, Any] | None = None
    for bucket in buckets:
        heartbeats.update(bucket.read_heartbeats())
        candidate = bucket.read_syncer_status()
        if candidate and (syncer is None or candidate.get("time", 0) > syncer.get("time", 0)):
            syncer = candidate
        head_candidate = bucket.read_head()
        if head_candidate and (head is None or head_candidate["version"] > head["version"]):
            head = head_candidate
    version = int(head["version"]) if head else 0
    rows = []
    for learner in spec.learners:
        beat = heartbeats.get(learner.id, {})
        bases = [int(v) for v in beat.get("base_versions", {}).values() if int(v) >= 0]
        step_seconds = beat.get("step_seconds")
        rows.append(
            LearnerRow(
                learner=learner.id,
                region=learner.region,
                host=learner.host,
                state=beat.get("state", "not started"),
                step=int(beat.get("step", 0)),
                total_steps=int(beat.get("total_steps", spec.recipe.training.inner_steps)),
                tokens=int(beat.get("tokens", 0)),
                loss=beat.get("loss"),
                steps_per_second=1.0 / step_seconds if step_seconds else None,
                base_version=min(bases) if bases else None,
                staleness=version - min(bases) if bases else None,
                last_seen_seconds=now - beat["time"] if "time" in beat else None,
                restarts=int(beat.get("restarts", 0)),
                bytes_up=int(beat.get("bytes_up", 0)),
                bytes_down=int(beat.get("bytes_down", 0)),
            )
        )
    regions = {region.name: RegionBytes(region.name) for region in spec.regions}
    for row in rows:
        regions[row.region].learners_up += row.bytes_up
        regions[row.region].learners_down += row.bytes_down
    for name, counts in (syncer or {}).get("bytes", {}).items():
        if name in regions:
            regions[name].syncer_up = int(counts.get("up", 0))
            regions[name].syncer_down = int(counts.get("down", 0))
    evaluations = (syncer or {}).get("evaluations", [])
    last_merge = (syncer or {}).get("last_merge")
    if syncer is None:
        state = "starting"
    elif syncer["state"] in ("finished", "stopped"):
        state = syncer["state"]
    elif now - syncer.get("time", 0) > SYNCER_SILENT_SECONDS:
        state = "syncer not reporting"
    else:
        state = "running"
    return RunStatus(
        run=spec.run,
        state=state,
        version=version,
        tokens=sum(row.tokens for row in rows),
        heldout_loss=evaluations[-1]["loss"] if evaluations else None,
        elapsed_seconds=(syncer or {}).get("time", now) - spec.created if state in ("finished", "stopped") else now - spec.created,
        learners=rows,
        syncer=SyncerSummary(
            state=(syncer or {}).get("state", "starting"),
            last_merge_seconds_ago=now - last_merge["time"] if last_merge else None,
            last_merge=last_merge,
            merges=int((syncer or {}).get("merges", 0)),
            merges_per_minute=int((syncer or {}).get("merges_per_minute", 0)),
            quorum=(syncer or {}).get("quorum"),
            effective_quorum=(syncer or {}).get("effective_quorum"),
            grace_seconds=(syncer or {}).get("grace_seconds"),
            live_learners=(syncer or {}).get("live_learners", []),
            reasons=(syncer or {}).get("reasons", {}),
        ),
        regions=list(regions.values()),
        evaluations=evaluations,
    )
