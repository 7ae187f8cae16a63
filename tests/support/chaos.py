"""Chaos against a running local run: processes (learners, reducers, the syncer or its
shards) killed and
paused, objects (payloads, aggregates, updates, snapshots...) damaged at rest, litter
dropped, at random but reproducibly from a seed (the events, not their timing). For
tests that must hold whatever happens::

    chaos = Chaos(runs_dir, "run", seed=3)
    while time.monotonic() < deadline:
        chaos.strike()          # one random event, logged in chaos.events
        time.sleep(1.5)
    chaos.calm()                # every paused process continues

Damaged objects are remembered (``chaos.damaged``), so an audit can tell refused work
from lost work; litter is remembered too (``chaos.litter``), to check it is swept.

Two events are the test's to place: a region's bucket wiped and recreated
(:meth:`Chaos.wipe`), and an authentic heartbeat kept early and copied back later over a
learner's newer one (:meth:`Chaos.keep_heartbeats`, :meth:`Chaos.replay_heartbeat`)."""

from __future__ import annotations

import os
import random
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from diloco_cli.launch.runs import load_run
from diloco_cli.store.aggregates import AGGREGATE_KEY
from diloco_cli.store.region import ANY_SNAPSHOT_KEY, ANY_UPDATE_KEY, CHECKPOINT_KEY, PAYLOAD_KEY, RELAY_KEY

KINDS = {
    "payload": PAYLOAD_KEY,
    "aggregate": AGGREGATE_KEY,
    "relay": RELAY_KEY,
    "update": ANY_UPDATE_KEY,
    "snapshot": ANY_SNAPSHOT_KEY,
    "checkpoint": CHECKPOINT_KEY,
}
EVENTS = (
    "kill learner",
    "kill syncer",
    "pause learner",
    "pause syncer",
    "damage payload",
    "damage marker",
    "damage update",
    "damage snapshot",
    "damage checkpoint",
    "litter",
)
REDUCER_EVENTS = ("kill reducer", "pause reducer", "damage aggregate", "damage relay")
"""Events of the regions' reducers (drawn among the others; "damage" finds nothing to
damage where the reducer forwards no object of that kind: relays under K = M)."""


@dataclass
class Chaos:
    runs_dir: Path
    run: str
    seed: int = 0
    pause_seconds: float = 2.0
    events: list[str] = field(default_factory=list)
    damaged: dict[str, float] = field(default_factory=dict)
    """Bucket keys damaged (``<region>:<key>``, markers with their ``.ready``) and when
    (wall clock)."""
    litter: list[Path] = field(default_factory=list)
    paused: dict[int, float] = field(default_factory=dict)
    kept: dict[str, bytes] = field(default_factory=dict)
    """Heartbeats as they were when kept, by learner (to be replayed)."""

    def __post_init__(self) -> None:
        self.random = random.Random(self.seed)
        record = load_run(self.runs_dir, self.run)
        self.spec = record.spec
        self.learners = [learner.id for learner in self.spec.learners]
        self.reducers = [reducer.name for reducer in self.spec.reducers]
        self.syncers = [shard.name for shard in self.spec.syncer_shards]
        self.events_drawn = EVENTS + (REDUCER_EVENTS if self.reducers else ())
        self.roots = {region.name: Path(region.root.removeprefix("file://")) for region in self.spec.regions}

    def strike(self, event: str | None = None) -> str:
        """One random event, or one of the kind ``event`` names (``kill syncer``: a random
        syncer shard killed); a pause ends by itself on a later strike or at ``calm``."""
        self._resume_due()
        event = event or self.random.choice(self.events_drawn)
        what, _, target = event.partition(" ")
        if what in ("kill", "pause"):
            population = {"learner": self.learners, "reducer": self.reducers, "syncer": self.syncers}[target]
            process = self.random.choice(population)
            done = self._signal(process, signal.SIGKILL if what == "kill" else signal.SIGSTOP)
            detail = f"{event} {process}" + ("" if done else " (not running)")
        elif what == "damage":
            detail = f"{event} {self._damage(target)}"
        else:
            detail = f"litter {self._litter()}"
        self.events.append(detail)
        return detail

    def wipe(self, region: str) -> float:
        """Everything of the run in ``region``'s bucket gone at once, the folder made
        again empty (a bucket deleted and recreated); returns when (wall clock)."""
        root = self.roots[region]
        gone = root.with_name(f"{root.name}.wiped")
        root.rename(gone)
        root.mkdir()
        wiped_at = time.time()
        shutil.rmtree(gone, ignore_errors=True)
        self.events.append(f"wipe region {region}")
        return wiped_at

    def keep_heartbeats(self) -> None:
        """Keep each learner's heartbeat as it is now, to replay it later."""
        for learner in self.spec.learners:
            path = self.roots[learner.region] / "heartbeats" / f"{learner.id}.json"
            if path.exists():
                self.kept[learner.id] = path.read_bytes()

    def replay_heartbeat(self, learner: str) -> str:
        """The learner's kept heartbeat (authentic, and older) copied over its current one."""
        region = next(spec.region for spec in self.spec.learners if spec.id == learner)
        path = self.roots[region] / "heartbeats" / f"{learner}.json"
        path.with_suffix(".replayed").write_bytes(self.kept[learner])
        path.with_suffix(".replayed").replace(path)  # whole, as its writer writes it
        detail = f"replay heartbeat of {learner}"
        self.events.append(detail)
        return detail

    def calm(self) -> None:
        for pid in list(self.paused):
            self._continue(pid)

    def _child(self, process: str) -> int | None:
        state = load_run(self.runs_dir, self.run).process_state(process) or {}
        return state.get("child_pid") if state.get("state") == "running" else None

    def _signal(self, process: str, signum: int) -> bool:
        pid = self._child(process)
        if pid is None:
            return False
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            return False
        if signum == signal.SIGSTOP:
            self.paused[pid] = time.monotonic() + self.pause_seconds
        return True

    def _resume_due(self) -> None:
        for pid, until in list(self.paused.items()):
            if time.monotonic() >= until:
                self._continue(pid)

    def _continue(self, pid: int) -> None:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        del self.paused[pid]

    def _damage(self, kind: str) -> str:
        region = self.random.choice(sorted(self.roots))
        root = self.roots[region]
        pattern = KINDS["payload" if kind == "marker" else kind]
        keys = sorted(
            str(path.relative_to(root)) for path in root.rglob("*.dlc") if pattern.match(str(path.relative_to(root)))
        )
        keys = [key for key in keys if (root / f"{key}.ready").exists()]
        if not keys:
            return "(nothing to damage)"
        key = self.random.choice(keys) + (".ready" if kind == "marker" else "")
        path = root / key
        data = bytearray(path.read_bytes())
        data[self.random.randrange(len(data))] ^= 1 << self.random.randrange(8)
        path.write_bytes(bytes(data))
        self.damaged.setdefault(f"{region}:{key}", time.time())
        return f"{region}:{key}"

    def _litter(self) -> str:
        region = self.random.choice(sorted(self.roots))
        root = self.roots[region]
        learner = self.random.choice(self.learners)
        sequence = self.random.randrange(10**12)
        choices = [
            root / "payloads" / learner / f"000-{sequence:012d}.dlc",  # an upload killed before its marker
            root / "payloads" / learner / f"000-{sequence:012d}.dlc.{sequence:x}.partial",  # a local write killed
            root / "global" / f"stray-{sequence}.bin",  # junk
        ]
        path = self.random.choice(choices)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"litter")
        self.litter.append(path)
        return f"{region}:{path.relative_to(root)}"
