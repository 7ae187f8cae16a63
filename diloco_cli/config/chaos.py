"""Chaos: faults injected into a run on purpose, reproducibly from a seed.

``diloco up --chaos SPEC`` kills learners, reducers and the syncer (SIGKILL), pauses learners
(SIGSTOP, then SIGCONT), takes a region's storage down for a while (every call to
that region's bucket, from its learners or from the syncer, fails or hangs), slows given
learners down as slower chips would be, and keeps the learners' payloads once merged (to
audit a run).  SPEC is a comma-separated list::

    seed=7                     the schedule's seed (default 0)
    kill-learner=0.5/min       SIGKILL a random learner at this rate (Poisson)
    kill-syncer=0.1/min        SIGKILL the syncer (a random syncer shard) at this rate
    kill-reducer=0.2/min       SIGKILL a random region's reducer at this rate
    stop-learner=0.5/min:20s   SIGSTOP a random learner for 20 s at this rate
    outage=local-b@60s+30s     region local-b's storage down from 60 s to 90 s after the start
    outage=local-b@60s+30s:hang   the same, calls hanging instead of failing
    outage-rate=0.1/min:30s    an outage of a random region for 30 s at this rate
    slow-learner=local-b-0:0.6 learner local-b-0 at 0.6 of full speed (repeatable)
    keep-payloads              payloads stay in the buckets once merged (for an audit)

Times count from the run's creation (``diloco up --chaos``) or from the moment the plan
was given to a running run (``diloco chaos RUN SPEC``).  The schedule is a pure function of the plan, the
run's learners and regions, so every process computes the same windows from the
manifest, and a rerun with the same seed injects the same faults.
"""

from __future__ import annotations

import random
import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from diloco_cli.config.errors import ConfigError

FROZEN = ConfigDict(frozen=True, extra="forbid")
HORIZON_SECONDS = 2 * 24 * 3600.0
"""How far ahead random events are drawn (two days: longer than any chaos experiment)."""


class Outage(BaseModel):
    """One region's storage, down for a while."""

    model_config = FROZEN

    region: str
    start_seconds: float = Field(ge=0)
    """From the run's creation."""
    duration_seconds: float = Field(gt=0)
    mode: Literal["fail", "hang"] = "fail"
    """``fail``: every call fails at once; ``hang``: it waits (up to the window's end,
    at most a minute) and then fails, as a black-holed link does."""


class ChaosPlan(BaseModel):
    """What faults to inject, at what rates."""

    model_config = FROZEN

    seed: int = 0
    """Seeds the schedule: the same plan and seed give the same faults."""
    kill_learner_per_minute: float = Field(default=0.0, ge=0)
    kill_syncer_per_minute: float = Field(default=0.0, ge=0)
    kill_reducer_per_minute: float = Field(default=0.0, ge=0)
    """SIGKILL a random region's reducer (runs with reducers) at this rate."""
    stop_learner_per_minute: float = Field(default=0.0, ge=0)
    stop_seconds: float = Field(default=20.0, gt=0)
    """How long a stopped learner stays stopped."""
    outages: tuple[Outage, ...] = ()
    """Outage windows at given times."""
    outage_per_minute: float = Field(default=0.0, ge=0)
    """Outages of a random region at this rate."""
    outage_seconds: float = Field(default=30.0, gt=0)
    begins_at_seconds: float = Field(default=0.0, ge=0)
    """When the plan's times start, in seconds after the run's creation: 0 for ``diloco
    up --chaos``, the moment it was given for ``diloco chaos`` on a running run."""
    slow_learners: dict[str, Annotated[float, Field(gt=0, le=1)]] = Field(default_factory=dict)
    """Learners slowed down on purpose, to reproduce mixed hardware on one machine: learner
    id (e.g. ``local-a-1``) to speed, 0 < speed <= 1; after each step such a learner waits
    (1/speed - 1) times the step's compute time.  Empty: every learner at full speed."""
    keep_payloads: bool = False
    """Keep the learners' payloads in the buckets once merged or superseded (their
    reducer never reads them again), so a test can audit every send of a run."""

    @property
    def has_process_faults(self) -> bool:
        return any(
            rate > 0
            for rate in (
                self.kill_learner_per_minute,
                self.kill_syncer_per_minute,
                self.kill_reducer_per_minute,
                self.stop_learner_per_minute,
            )
        )

    def outage_windows(self, regions: list[str]) -> list[Outage]:
        """Every outage of the run: the given ones and the random ones, by start."""
        drawn = []
        if self.outage_per_minute > 0 and regions:
            generator = random.Random(f"{self.seed}/outages")
            for start in poisson_times(generator, self.outage_per_minute):
                drawn.append(
                    Outage(
                        region=generator.choice(sorted(regions)),
                        start_seconds=start,
                        duration_seconds=self.outage_seconds,
                    )
                )
        return sorted([*self.outages, *drawn], key=lambda outage: outage.start_seconds)


class ProcessEvent(BaseModel):
    """One process fault: a SIGKILL, or a SIGSTOP for ``seconds`` (its SIGCONT is the
    driver's ``continue``)."""

    model_config = FROZEN

    at_seconds: float
    """From the run's creation."""
    action: Literal["kill", "stop", "continue"]
    target: str
    """A learner's id, ``syncer`` (a shard's ``syncer-<s>``), or a reducer's process name
    (``reducer-<region>``)."""
    seconds: float | None = None


def process_events(
    plan: ChaosPlan,
    learners: list[str],
    reducers: list[str] = (),
    horizon: float = HORIZON_SECONDS,
    syncers: list[str] = ("syncer",),
) -> list[ProcessEvent]:
    """The kills and pauses of a plan, by time: a pure function of the plan and the run's
    learners, reducers and syncer shards (a rerun with the same seed kills the same
    processes at the same times; reducers, and which syncer shard a kill hits, draw from
    streams of their own, so adding them moves no other event)."""
    generator = random.Random(f"{plan.seed}/processes")
    of_syncers = random.Random(f"{plan.seed}/syncers")
    events = []
    if plan.kill_reducer_per_minute > 0 and reducers:
        of_reducers = random.Random(f"{plan.seed}/reducers")
        for at in poisson_times(of_reducers, plan.kill_reducer_per_minute, horizon):
            events.append(ProcessEvent(at_seconds=at, action="kill", target=of_reducers.choice(sorted(reducers))))
    for rate, action, pick in (
        (plan.kill_learner_per_minute, "kill", lambda: generator.choice(sorted(learners))),
        (plan.kill_syncer_per_minute, "kill", lambda: of_syncers.choice(sorted(syncers))),
        (plan.stop_learner_per_minute, "stop", lambda: generator.choice(sorted(learners))),
    ):
        if rate > 0:
            for at in poisson_times(generator, rate, horizon):
                events.append(
                    ProcessEvent(
                        at_seconds=at,
                        action=action,
                        target=pick(),
                        seconds=plan.stop_seconds if action == "stop" else None,
                    )
                )
    return sorted(events, key=lambda event: event.at_seconds)


def poisson_times(generator: random.Random, per_minute: float, horizon: float = HORIZON_SECONDS) -> list[float]:
    """Event times (seconds) of a Poisson process of this rate, up to ``horizon``."""
    times, now = [], 0.0
    while True:
        now += generator.expovariate(per_minute / 60.0)
        if now > horizon:
            return times
        times.append(now)


DURATION = re.compile(r"^(?P<value>\d+(?:\.\d+)?)(?P<unit>s|m|min|h)?$")
RATE = re.compile(r"^(?P<value>\d+(?:\.\d+)?)/(?P<unit>s|min|m|h)$")
OUTAGE = re.compile(r"^(?P<region>[A-Za-z0-9_.-]+)@(?P<start>[^+]+)\+(?P<duration>[^:]+)(?::(?P<mode>fail|hang))?$")
SLOW_LEARNER = re.compile(r"^(?P<learner>[A-Za-z0-9_.-]+):(?P<speed>\d*\.?\d+)$")
KEYS = (
    "seed",
    "kill-learner",
    "kill-syncer",
    "kill-reducer",
    "stop-learner",
    "outage",
    "outage-rate",
    "slow-learner",
)
FLAGS = ("keep-payloads",)
"""Items without a value."""


def _seconds(text: str, item: str) -> float:
    match = DURATION.match(text.strip())
    if not match:
        raise ConfigError(f"--chaos {item!r}: {text!r} is not a duration (like 30s, 2m or 1h)")
    return float(match["value"]) * {"s": 1, None: 1, "m": 60, "min": 60, "h": 3600}[match["unit"]]


def _per_minute(text: str, item: str) -> float:
    match = RATE.match(text.strip())
    if not match:
        raise ConfigError(f"--chaos {item!r}: {text!r} is not a rate (like 0.5/min or 2/h)")
    return float(match["value"]) * {"s": 60, "m": 1, "min": 1, "h": 1 / 60}[match["unit"]]


def _slow_learner(text: str, item: str) -> tuple[str, float]:
    match = SLOW_LEARNER.match(text.strip())
    if not match or not 0 < float(match["speed"]) <= 1:
        raise ConfigError(
            f"--chaos {item!r}: a slow learner is LEARNER:SPEED with 0 < SPEED <= 1 (a fraction of full speed), "
            "like local-b-0:0.6"
        )
    return match["learner"], float(match["speed"])


def parse_chaos(text: str) -> ChaosPlan:
    """A :class:`ChaosPlan` from ``--chaos`` text; ConfigError says what is wrong."""
    fields: dict = {"outages": [], "slow_learners": {}}
    for item in (part.strip() for part in text.split(",") if part.strip()):
        key, separator, value = item.partition("=")
        if key in FLAGS:
            if separator:
                raise ConfigError(f"--chaos {item!r}: {key} takes no value (write just {key})")
            fields[key.replace("-", "_")] = True
        elif not separator or key not in KEYS:
            raise ConfigError(
                f"--chaos {item!r}: expected KEY=VALUE with KEY one of {', '.join(KEYS)}, or {', '.join(FLAGS)}"
            )
        elif key == "seed":
            if not value.lstrip("-").isdigit():
                raise ConfigError(f"--chaos {item!r}: the seed is an integer")
            fields["seed"] = int(value)
        elif key in ("kill-learner", "kill-syncer", "kill-reducer"):
            fields[f"{key.replace('-', '_')}_per_minute"] = _per_minute(value, item)
        elif key in ("stop-learner", "outage-rate"):
            rate, colon, duration = value.partition(":")
            prefix = "stop_learner" if key == "stop-learner" else "outage"
            fields[f"{prefix}_per_minute"] = _per_minute(rate, item)
            if colon:
                fields["stop_seconds" if key == "stop-learner" else "outage_seconds"] = _seconds(duration, item)
        elif key == "slow-learner":
            learner, speed = _slow_learner(value, item)
            if learner in fields["slow_learners"]:
                raise ConfigError(f"--chaos {item!r}: {learner} is slowed twice; give each learner one speed")
            fields["slow_learners"][learner] = speed
        else:
            match = OUTAGE.match(value)
            if not match:
                raise ConfigError(
                    f"--chaos {item!r}: an outage is REGION@START+DURATION[:fail|:hang], like local-b@60s+30s"
                )
            fields["outages"].append(
                Outage(
                    region=match["region"],
                    start_seconds=_seconds(match["start"], item),
                    duration_seconds=_seconds(match["duration"], item),
                    mode=match["mode"] or "fail",
                )
            )
    return ChaosPlan(**fields)
