"""The state of a run, read from its buckets (any machine that can read them), plus what
its supervisors say when the caller knows them.

Heartbeats give the learners, ``global/syncer.json`` and ``global/head.json`` the syncer
and the global model (with syncer shards, each shard's under ``global/shard-<s>/``: the
view shows each shard, and the run as their sum).  With the run's secret every document
is verified (one that is not counts as refused); without it (``status --manifest``)
they are only displayed.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from diloco_cli.bandwidth.report import build_report, one_line
from diloco_cli.codec import PayloadError, RunSecret
from diloco_cli.core.heartbeats import replay_reason
from diloco_cli.store.aggregates import read_reducer_status
from diloco_cli.store.documents import ChaosLog, Head, Heartbeat, ReducerStatus, Refusals, SyncerStatus
from diloco_cli.store.filesystem import StorageError
from diloco_cli.store.metering import StorageCounters
from diloco_cli.store.region import RegionBucket, heartbeat_key
from diloco_cli.store.run_spec import LearnerSpec, RunSpec
from diloco_cli.views.coordinators import (
    ReducerSummary,
    SyncerSummary,
    reducer_summary,
    run_state,
    shards_as_one,
    syncer_summary,
)
from diloco_cli.views.format import ago, plural


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
    """Global versions since the oldest fragment this learner holds (with syncer shards,
    the most any of its fragments is behind its shard's head)."""
    install_lag_steps: float | None
    """Steps it trains between a send and the install that follows it (median, latest installs)."""
    last_seen_seconds: float | None
    restarts: int
    """As its supervisor counts them (a kill before the first heartbeat too) when the caller
    asked the supervisors, else as its heartbeats do; the higher of the two when both are
    known (a ``resume`` starts a new supervisor, counting from 0 again)."""
    bytes_up: int
    bytes_down: int
    unsent: int
    """Payloads waiting in the learner's outbox."""
    retries: int
    refusals: int


@dataclass
class RegionHealth:
    region: str
    learners_up: int = 0
    """Bytes the learners wrote to this region's bucket, checkpoints apart."""
    checkpoints_up: int = 0
    """Bytes of the learners' checkpoints (they stay in the region)."""
    learners_down: int = 0
    syncer_up: int = 0
    """Bytes the syncer wrote to this region's bucket (updates, snapshots, heads)."""
    syncer_down: int = 0
    """Bytes the syncer read from it (payloads, markers, heartbeats)."""
    retries: int = 0
    """Storage calls to this bucket retried, by its learners and the syncer."""
    failures: int = 0
    """Storage calls to it that failed after every retry."""
    reducer_bytes: int = 0
    """Bytes the region's reducer moved in its own bucket (never across the WAN)."""
    refusals: dict[str, int] = field(default_factory=dict)
    """Objects of this bucket refused as damaged or forged, by kind."""
    latest_refusal: dict[str, Any] | None = None
    """The newest refusal: kind, key, reason, time."""


@dataclass
class RunStatus:
    run: str
    state: str
    version: int
    """Global versions published (with syncer shards, by every shard together: each
    numbers its own)."""
    tokens: int
    heldout_loss: float | None
    heldout_version: int | None
    """The global version the held-out loss was measured at (evaluations lag the merges)."""
    elapsed_seconds: float
    learners: list[LearnerRow]
    syncer: SyncerSummary
    regions: list[RegionHealth] = field(default_factory=list)
    evaluations: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    """What is wrong, in sentences that say what to run."""
    bandwidth: str | None = None
    """One line: bytes across links and in regions, compression, data-parallel's bytes."""
    chaos: str | None = None
    """One line, in chaos mode: the faults injected so far and the latest ones."""
    scaling: str | None = None
    """One line once the run was scaled: M now, and the changes (``diloco scale``)."""
    reducers: list[ReducerSummary] = field(default_factory=list)
    """The regions' reducers (one per region and syncer shard)."""
    syncer_shards: list[SyncerSummary] = field(default_factory=list)
    """Each syncer shard (runs with ``sync.shards`` > 1; ``syncer`` is then their sum)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class BucketReads:
    heartbeats: dict[str, Heartbeat] = field(default_factory=dict)
    syncers: dict[int, SyncerStatus] = field(default_factory=dict)
    """Per syncer shard, its newest status in any region."""
    heads: dict[int, Head] = field(default_factory=dict)
    """Per syncer shard, its newest head in any region."""
    refused: dict[str, Refusals] = field(default_factory=dict)
    unreachable: dict[str, str] = field(default_factory=dict)
    chaos: ChaosLog | None = None
    reducers: dict[tuple[str, int], ReducerStatus] = field(default_factory=dict)
    """Per region and syncer shard, its reducer's status."""

    @property
    def syncer(self) -> SyncerStatus | None:
        """The status of the syncer (of shard 0, with syncer shards)."""
        return self.syncers.get(0)


def read_buckets(spec: RunSpec, secret: RunSecret | None, now: float) -> BucketReads:
    """Every region's heartbeats, each syncer shard's newest status and head, and what
    was refused."""
    read = BucketReads()
    for bucket in spec.buckets(secret):
        try:
            _read_bucket(spec, bucket, read, now)
        except StorageError as error:  # show the others, and say which cannot be read
            read.unreachable[bucket.name] = str(error)
    _refuse_replayed_heartbeats(spec, read, now)
    return read


def _refuse_replayed_heartbeats(spec: RunSpec, read: BucketReads, now: float) -> None:
    """A heartbeat older than the newest one a syncer (shard) took in is a replay: it
    counts as refused in its region, and the learner shows as the syncer heard it (a
    finished learner does not show training again)."""
    for learner, beat in list(read.heartbeats.items()):
        heard = [status.heartbeats[learner] for status in read.syncers.values() if learner in status.heartbeats]
        seen = max(heard, key=lambda seen: (seen.epoch, seen.time), default=None)
        reason = replay_reason(seen, beat)
        if seen is not None and reason is not None:
            region = spec.learner(learner).region
            read.refused.setdefault(region, Refusals()).record("heartbeat", heartbeat_key(learner), reason, now)
            read.heartbeats[learner] = beat.as_heard(seen)


def _read_bucket(spec: RunSpec, bucket: RegionBucket, read: BucketReads, now: float) -> None:
    refused = read.refused.setdefault(bucket.name, Refusals())
    for learner in (s.id for s in spec.learners if s.region == bucket.name):
        try:
            if (beat := bucket.read_heartbeat(learner)) is not None:
                read.heartbeats[learner] = beat
        except PayloadError as error:
            refused.record("heartbeat", heartbeat_key(learner), str(error), now)
    if spec.chaos is not None:
        try:
            log = bucket.read_chaos_log()
            if log is not None and (read.chaos is None or log.count > read.chaos.count):
                read.chaos = log
        except PayloadError as error:
            refused.record("chaos", "chaos.json", str(error), now)
    for shard, view in enumerate(bucket.syncer_shards(len(spec.syncer_shards))):
        layout = view.layout
        try:
            candidate = view.read_syncer_status()
            newest = read.syncers.get(shard)
            if candidate and (newest is None or candidate.time > newest.time):
                read.syncers[shard] = candidate
        except PayloadError as error:
            refused.record("status", layout.status_key, str(error), now)
        try:
            head = view.read_head()
            if head and (shard not in read.heads or head.version > read.heads[shard].version):
                read.heads[shard] = head
        except PayloadError as error:
            refused.record("head", layout.head_key, str(error), now)
        if spec.reducers:
            try:
                if (reducer := read_reducer_status(view)) is not None:
                    read.reducers[bucket.name, shard] = reducer
            except PayloadError as error:
                refused.record("status", layout.reducer_status_key, str(error), now)


def collect_status(
    spec: RunSpec, secret: RunSecret | None = None, processes: list[dict] | None = None, now: float | None = None
) -> RunStatus:
    """The run as its buckets show it; ``processes`` (from the run's supervisors, when
    the caller can ask them) adds what is down and what to run about it."""
    now = time.time() if now is None else now
    read = read_buckets(spec, secret, now)
    shards = spec.syncer_shards
    syncers = [read.syncers.get(shard.index) for shard in shards]
    head_versions = {
        shard.index: read.heads[shard.index].version if shard.index in read.heads else 0 for shard in shards
    }
    rows = [
        _learner_row(spec, learner.id, read.heartbeats.get(learner.id), head_versions, now) for learner in spec.learners
    ]
    regions = {region.name: RegionHealth(region.name) for region in spec.regions}
    region_refusals = {name: Refusals() for name in regions}
    for learner in spec.learners:
        beat = read.heartbeats.get(learner.id)
        if beat is not None:
            _add_storage(regions[learner.region], beat.storage, learner=True)
            region_refusals[learner.region] = region_refusals[learner.region].plus(beat.refusals)
    for name in regions:
        for syncer in syncers:
            if syncer is not None and name in syncer.storage:
                _add_storage(regions[name], syncer.storage[name], learner=False)
        refused = [syncer.refusals.get(name) for syncer in syncers if syncer is not None] + [read.refused.get(name)]
        refused += [reducer.refusals for (region, _), reducer in read.reducers.items() if region == name]
        for refusals in refused:
            if refusals is not None:
                region_refusals[name] = region_refusals[name].plus(refusals)
        regions[name].refusals = dict(region_refusals[name].counts)
        latest = region_refusals[name].latest
        regions[name].latest_refusal = latest.model_dump() if latest else None
    evaluations = [e.model_dump() for e in read.syncer.evaluations] if read.syncer else []
    down = processes_down(processes)
    for row in rows:  # a supervisor also counts the kills that came before a first heartbeat
        process = next((p for p in processes or [] if p["process"] == row.learner), {})
        row.restarts = max(row.restarts, process.get("restarts", 0))
        if process.get("supervisor") == "pending" and row.state not in ("finished", "drained"):
            row.state = process["job_state"]  # queued (again): "pending (Resources)", not silent or dead
    state = run_state(syncers, now)
    names_down = {shard.name for shard in shards} & set(down)
    if names_down and state not in ("finished", "stopped"):
        state = "syncer down"
    summaries = [
        syncer_summary(syncer, run_state([syncer], now) == "syncer not reporting", now, shard.name in down)
        for syncer, shard in zip(syncers, shards)
    ]
    for summary, shard in zip(summaries, shards):
        summary.name, summary.version = shard.name, head_versions[shard.index]
    reported = [syncer.time for syncer in syncers if syncer is not None]
    status = RunStatus(
        run=spec.run,
        state=state,
        version=sum(head_versions.values()),
        tokens=sum(row.tokens for row in rows),
        heldout_loss=evaluations[-1]["loss"] if evaluations else None,
        heldout_version=evaluations[-1]["version"] if evaluations else None,
        elapsed_seconds=(max(reported, default=now) if state in ("finished", "stopped") else now) - spec.created,
        learners=rows,
        syncer=summaries[0] if len(summaries) == 1 else shards_as_one(summaries),
        regions=list(regions.values()),
        evaluations=evaluations,
        syncer_shards=summaries if len(summaries) > 1 else [],
    )
    present = {shard.name: syncer for shard, syncer in zip(shards, syncers) if syncer is not None}
    if present or read.heartbeats:
        report = build_report(spec, read.heartbeats, present, None, state, now, list(read.reducers.values()))
        status.bandwidth = one_line(report)
    if spec.chaos is not None:
        status.chaos = chaos_line(read.chaos, now)
    if spec.scaling:
        status.scaling = scaling_line(spec, {row.learner: row.state for row in rows}, now)
    status.reducers = [
        reducer_summary(
            r.region, read.reducers.get((r.region, shard.index)), now, shard.index if len(shards) > 1 else None
        )
        for r in spec.reducers
        for shard in shards
    ]
    for reducer in read.reducers.values():
        if reducer.region in regions:
            regions[reducer.region].reducer_bytes += reducer.storage.bytes_up + reducer.storage.bytes_down
    status.problems = problems(status, processes) + [
        f"region {name}: its bucket cannot be read now ({error})" for name, error in sorted(read.unreachable.items())
    ]
    return status


def _add_storage(region: RegionHealth, counters: StorageCounters, learner: bool) -> None:
    if learner:
        checkpoints = counters.kinds["checkpoint"].bytes_up if "checkpoint" in counters.kinds else 0
        region.learners_up += counters.bytes_up - checkpoints
        region.checkpoints_up += checkpoints
        region.learners_down += counters.bytes_down
    else:
        region.syncer_up += counters.bytes_up
        region.syncer_down += counters.bytes_down
    region.retries += counters.retries
    region.failures += counters.failures


def scaling_line(spec: RunSpec, states: dict[str, str], now: float) -> str:
    """``M=3 after 2 changes: +1 in a 4 min ago (added a-2); -1 in a 1 min ago (draining a-2)``;
    ``drained`` once every learner of a drain has finished (``states``: by learner)."""
    changes = []
    for change in spec.scaling[-3:]:
        count = len(change.added) - len(change.drained)
        done = all(states.get(learner) == "drained" for learner in change.drained)
        verb = "drained" if done else "draining"
        who = f"added {', '.join(change.added)}" if change.added else f"{verb} {', '.join(change.drained)}"
        changes.append(f"{count:+d} in {change.region} {ago(now - change.time)} ({who})")
    earlier = f"{len(spec.scaling) - 3} earlier; " if len(spec.scaling) > 3 else ""
    return (
        f"scaled: M={len(spec.active_learners)} after {plural(len(spec.scaling), 'change')}: "
        f"{earlier}{'; '.join(changes)}"
    )


def _learner_state(placed: LearnerSpec, beat: Heartbeat | None) -> str:
    """The heartbeat's state, but ``draining``/``drained`` for a learner told to leave."""
    state = beat.state.value if beat else "not started"
    if placed.drain:
        return "drained" if state == "finished" else "draining"
    return state


def _learner_row(
    spec: RunSpec, learner: str, beat: Heartbeat | None, head_versions: dict[int, int], now: float
) -> LearnerRow:
    """``head_versions``: each syncer shard's newest version."""
    placed = spec.learner(learner)
    held = {int(p): int(v) for p, v in beat.base_versions.items() if int(v) >= 0} if beat else {}
    bases = list(held.values())
    count = len(head_versions)
    return LearnerRow(
        learner=learner,
        region=placed.region,
        host=placed.host,
        state=_learner_state(placed, beat),
        step=beat.step if beat else 0,
        total_steps=beat.total_steps if beat else spec.recipe.training.inner_steps,
        tokens=beat.tokens if beat else 0,
        loss=beat.loss if beat else None,
        steps_per_second=1.0 / beat.step_seconds if beat and beat.step_seconds else None,
        base_version=min(bases) if bases else None,
        staleness=max(head_versions[p % count] - v for p, v in held.items()) if held else None,
        install_lag_steps=beat.install_lag_steps if beat else None,
        last_seen_seconds=now - beat.time if beat else None,
        restarts=beat.restarts if beat else 0,
        bytes_up=beat.storage.bytes_up if beat else 0,
        bytes_down=beat.storage.bytes_down if beat else 0,
        unsent=beat.unsent if beat else 0,
        retries=beat.storage.retries if beat else 0,
        refusals=beat.refusals.total if beat else 0,
    )


def processes_down(processes: list[dict] | None) -> dict[str, str]:
    """The processes whose supervisor gave up (``failed``) or is gone without finishing
    (``gone``), from the supervisors' rows (``probe_run``)."""
    down = {}
    for process in processes or []:
        if process["supervisor"] == "failed":
            down[process["process"]] = "failed"
        elif not process["supervisor_alive"] and process["supervisor"] not in ("finished", "stopped"):
            down[process["process"]] = "gone"
    return down


def problems(status: RunStatus, processes: list[dict] | None) -> list[str]:
    """What is down or was left behind, each with what to run."""
    run = status.run
    found = []
    down = processes_down(processes)
    for process in processes or []:
        name = process["process"]
        error = f"; last error: {process['last_error']}" if process.get("last_error") else ""
        if down.get(name) == "failed":
            found.append(
                f"{name} is down: its supervisor gave up after repeated crashes{error} "
                f"(see `diloco logs {run} {name}`); once the cause is fixed, `diloco resume {run}` restarts it"
            )
        elif down.get(name) == "gone":
            job = f" (Slurm job {process['job']}: {process.get('job_state')})" if process.get("job") else ""
            found.append(f"{name} is down{job or ' (its supervisor is gone)'}; `diloco resume {run}` restarts it")
        elif process["supervisor"] == "pending":
            found.append(f"{name} waits in Slurm's queue: job {process['job']} {process['job_state']}")
        elif process["supervisor"] in ("running", "restarting") and (line := restart_line(process, run)):
            found.append(line)
    for syncer in status.syncer_shards or [status.syncer]:
        who = "the syncer" if syncer.name == "syncer" else syncer.name
        if syncer.state == "not reporting" and syncer.name not in down:
            ago = syncer.last_report_seconds or 0
            hint = "" if processes else f" (`diloco status {run} --probe` asks its host)"
            found.append(
                f"{who} has not reported for {ago:.0f} s; if it is down, `diloco resume {run}` restarts it{hint}"
            )
        if syncer.ending and syncer.state == "running":
            found.append(f"{who} cannot end the run yet: {syncer.ending}")
    for region, why in sorted(status.syncer.unreachable.items()):
        found.append(
            f"region {region} is unreachable from the syncer ({why}); "
            "it merges the other regions meanwhile and catches "
            f"{region} up when a probe reaches it; its learners keep training and keep their unsent payloads"
        )
    for learner, why in sorted(status.syncer.given_up.items()):
        if why.startswith("never started"):  # a scheduler's job still queued, most likely
            found.append(
                f"the run went on without {learner}: it {why}; a Slurm job of it may still wait in the queue "
                f"(`diloco status {run} --probe` shows it, `diloco down {run}` cancels it)"
            )
        else:
            found.append(f"the run went on without {learner} ({why}); `diloco resume {run}` brings it back")
    return found


CRASH_LOOP = 2
"""Crashes in a row, each within a minute of its start, that make a crash loop: one
crash (a single kill) is a restart, not a loop."""


def restart_line(process: dict, run: str) -> str | None:
    """What a supervisor that still runs says of its process, with one count: a crash
    loop by its crashes in a row, else a process that crashed and came back by its
    restarts; None for one never restarted."""
    name, crashes, restarts = process["process"], process.get("crashes", 0), process.get("restarts", 0)
    error = f"; last error: {process['last_error']}" if process.get("last_error") else ""
    logs = f"`diloco logs {run} {name}`"
    if crashes >= CRASH_LOOP:
        return (
            f"{name} is crash-looping: it crashed {crashes} times in a row, each within a minute of its start"
            f"{error}; see {logs}: its supervisor gives up after 10 in a row, and "
            f"`diloco resume {run}` starts it again once the cause is fixed"
        )
    if restarts:
        times = "once after a crash" if restarts == 1 else f"{restarts} times after crashes"
        return f"{name} was restarted {times}{error} (see {logs})"
    return None


def chaos_line(log: ChaosLog | None, now: float) -> str:
    """``chaos: 7 faults injected; latest: kill west-0 12 s ago, stop east-1 40 s ago``."""
    if log is None or not log.count:
        return "chaos: no process fault injected yet (storage outages show as unreachable regions)"
    latest = ", ".join(
        f"{event.action} {event.target} {now - event.time:.0f} s ago"
        + ("" if event.outcome == "done" else f" ({event.outcome})")
        for event in reversed(log.events[-3:])
    )
    return f"chaos: {plural(log.count, 'process fault')} injected; latest: {latest}"
