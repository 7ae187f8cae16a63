"""``diloco scale``: add learners to a running run, or drain some of them.

Adding: the new learners are placed on the region's hosts (the one with the fewest
learners first), written into the run's manifest everywhere (the run record here, each
SSH host's copy, every bucket's), and started like any learner: with no checkpoint of
their own they wait for the newest global weights and start from them.  Draining: the
manifest marks them; the syncer, which follows the manifest, tells each through its
control note, and the learner sends what it trained, sees it delivered and stops.
Either way the syncer's M (and K, when the recipe leaves K to M) follows, the active
learners are given the data's slices anew (each a slice of its own), and the run's
record keeps the change (``RunSpec.scaling``).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import ValidationError

from diloco_cli.config.errors import ConfigError
from diloco_cli.config.recipe import Recipe
from diloco_cli.core.types import LearnerId, RegionName
from diloco_cli.launch.live import check_running, publish_spec
from diloco_cli.launch.operations import start_processes
from diloco_cli.launch.runs import RunRecord
from diloco_cli.store.documents import LearnerState
from diloco_cli.store.filesystem import StorageError
from diloco_cli.store.home import tokens_merged, tokens_unanchored
from diloco_cli.store.run_spec import LearnerSpec, RunSpec, ScaleChange

Emit = Callable[[str], None]


def parse_change(text: str) -> int:
    """``+2`` or ``-1`` (a signed, non-zero count of learners)."""
    try:
        change = int(text)
    except ValueError:
        change = 0
    if change == 0 or text.strip()[:1] not in "+-":
        raise ConfigError(
            f"--learners {text!r}: give a signed count, +N to add learners or -N to drain them (e.g. +2, -1)"
        )
    return change


def plan_scale(spec: RunSpec, region: str, change: int, now: float) -> RunSpec:
    """The run after adding ``change`` learners to ``region`` (or draining ``-change``
    of them, the newest first); ConfigError says why it cannot be done."""
    regions = [r.name for r in spec.regions]
    if region not in regions:
        raise ConfigError(f"--region {region!r} is not a region of run {spec.run} (its regions: {', '.join(regions)})")
    in_region = [learner for learner in spec.learners if learner.region == region]
    active = [learner for learner in in_region if not learner.drain]
    if change > 0:
        added = _new_learners(spec, RegionName(region), in_region, change)
        learners, drained = spec.learners + added, ()
    else:
        if -change > len(active):
            raise ConfigError(
                f"region {region} has {len(active)} active learner(s) "
                f"({', '.join(learner.id for learner in active) or 'none'}); cannot drain {-change}"
            )
        drained = tuple(
            learner.id for learner in sorted(active, key=lambda learner: learner.shard, reverse=True)[:-change]
        )
        learners = tuple(
            learner.model_copy(update={"drain": True}) if learner.id in drained else learner
            for learner in spec.learners
        )
        added = ()
    remaining = sum(1 for learner in learners if not learner.drain)
    if remaining == 0:
        raise ConfigError(
            f"draining {', '.join(drained)} would leave run {spec.run} without learners; "
            f"stop it with `diloco down {spec.run}`"
        )
    quorum = spec.recipe.sync.quorum
    if quorum is not None and remaining < quorum:
        now_active = len(spec.active_learners)
        raise ConfigError(
            f"draining {', '.join(drained)} would leave run {spec.run} with M={remaining} learners, fewer than its "
            f"quorum K={quorum} (it has M={now_active} now); drain at most {now_active - quorum} "
            "(a run's sync.quorum is set when it starts)"
        )
    document = spec.recipe.model_dump(mode="json")
    document["training"]["num_learners"] = remaining
    try:
        recipe = Recipe.model_validate(document)
    except ValidationError as error:  # an invariant of the recipe a change could break
        raise ConfigError(
            f"run {spec.run} with M={remaining} learners: {error.errors()[0]['msg'].removeprefix('Value error, ')}"
        ) from None
    change_record = ScaleChange(
        time=now,
        region=RegionName(region),
        added=tuple(learner.id for learner in added),
        drained=drained,
        learners_after=remaining,
    )
    return spec.model_copy(update={"learners": learners, "recipe": recipe, "scaling": spec.scaling + (change_record,)})


def _new_learners(
    spec: RunSpec, region: RegionName, in_region: list[LearnerSpec], count: int
) -> tuple[LearnerSpec, ...]:
    """``count`` learners for the region's hosts, fewest learners first, named on from
    the region's (``<region>-<n>``), with shard numbers after every learner's."""
    if not in_region:
        raise ConfigError(
            f"region {region} never had a host with learners in this run; nothing says where to start them"
        )
    hosts = Counter(learner.host for learner in in_region if not learner.drain)
    for learner in in_region:
        hosts.setdefault(learner.host, 0)
    processes = {learner.host: learner.processes for learner in in_region}
    taken = {learner.id for learner in spec.learners}
    index, shard = 0, max(learner.shard for learner in spec.learners) + 1
    added = []
    for _ in range(count):
        while f"{region}-{index}" in taken:
            index += 1
        host = min(hosts, key=lambda name: (hosts[name], name))
        hosts[host] += 1
        devices = _free_devices(spec.learners + tuple(added), host, processes[host])
        added.append(
            LearnerSpec(
                id=LearnerId(f"{region}-{index}"),
                region=region,
                host=host,
                shard=shard,
                processes=processes[host],
                devices=devices,
            )
        )
        taken.add(added[-1].id)
        shard += 1
    return tuple(added)


def _free_devices(learners: tuple[LearnerSpec, ...], host: str, count: int) -> tuple[int, ...]:
    """``count`` GPUs of ``host`` that no active learner holds, from those its learners
    were given (none for a host without GPUs); ConfigError when too few are free."""
    on_host = [learner for learner in learners if learner.host == host]
    given = sorted({device for learner in on_host for device in learner.devices})
    if not given:
        return ()
    held = {device for learner in on_host if not learner.drain for device in learner.devices}
    free = [device for device in given if device not in held]
    if len(free) < count:
        holders = ", ".join(learner.id for learner in on_host if not learner.drain and learner.devices)
        raise ConfigError(
            f"host {host}: {len(free)} of its GPUs {', '.join(map(str, given))} are free, a learner needs {count} "
            f"(held by {holders}); drain a learner there first (--learners -1), or add a host with GPUs"
        )
    return tuple(free[:count])


@dataclass(frozen=True)
class DrainOutcome:
    learner: LearnerId
    tokens: int
    """Tokens it trained."""
    merged: tuple[int, ...] = ()
    """Per fragment, of those tokens, the ones its merged payloads carried."""
    overwritten: tuple[int, ...] = ()
    """Per fragment, the ones an install of newer global weights overwrote before they
    were sent (counted by the learner; none with installs that keep the unsent work)."""
    unanchored: tuple[int, ...] = ()
    """Per fragment, the ones its sends carried from a base too old to anchor (the
    syncer refused them and told it to resync; the ledger counts them)."""

    @property
    def per_fragment(self) -> list[tuple[int, int, int]]:
        """Per fragment: (merged, overwritten, unanchored) tokens."""
        return list(zip(self.merged, self.overwritten, self.unanchored or (0,) * len(self.merged)))

    @property
    def accounted(self) -> int:
        """Tokens merged, overwritten or refused as stale, in the fragment with the fewest:
        every token it trained once its last payloads are merged."""
        return min((sum(counts) for counts in self.per_fragment), default=0)

    @property
    def done(self) -> bool:
        return self.tokens > 0 and self.accounted >= self.tokens


def scale_run(record: RunRecord, region: str, change: int, emit: Emit = lambda line: None) -> RunSpec:
    """Change the running run and start its new learners; returns the run as it is now."""
    check_running(record, "scale")
    spec = plan_scale(record.spec, region, change, time.time())
    publish_spec(record, spec)
    last = spec.scaling[-1]
    if last.added:
        start_processes(record, list(last.added), "added", emit)
    for learner in last.drained:
        emit(f"  {learner:<16} {spec.learner(learner).host:<12} draining: it sends what it trained, then stops")
    return spec


def wait_for_drain(
    record: RunRecord,
    learners: tuple[LearnerId, ...],
    timeout: float,
    drained: Callable[[DrainOutcome], None] = lambda outcome: None,
    look_seconds: float = 2.0,
) -> list[DrainOutcome]:
    """Wait until each drained learner has stopped and everything it trained is merged
    or overwritten by an install (or ``timeout`` passes), calling ``drained`` as each
    is; returns how far each got."""
    spec, secret = record.spec, record.secret()
    homes = spec.homes(secret)
    deadline = time.monotonic() + timeout
    pending, outcomes = set(learners), {}
    while pending and time.monotonic() < deadline:
        history = None
        for learner in sorted(pending):
            try:
                beat = spec.bucket(spec.learner(learner).region, secret).read_heartbeat(learner)
            except (StorageError, ValueError):
                continue
            if beat is None or beat.state != LearnerState.FINISHED:
                continue
            history = history if history is not None else [r for home in homes for r in home.history()]
            fragments = range(spec.recipe.sync.num_fragments)
            outcome = DrainOutcome(
                learner,
                beat.tokens,
                merged=tuple(tokens_merged(history, learner, f) for f in fragments),
                overwritten=tuple(beat.tokens_overwritten.get(f, 0) for f in fragments),
                unanchored=tuple(tokens_unanchored(history, learner, f) for f in fragments),
            )
            outcomes[learner] = outcome
            if outcome.done:
                pending.discard(learner)
                drained(outcome)
        if pending:
            time.sleep(look_seconds)
    return [outcomes.get(learner, DrainOutcome(learner, 0)) for learner in learners]
