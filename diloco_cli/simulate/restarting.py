"""Jobs that stop when one of their slices fails and restart on a spare: plain
data-parallel (one job of every slice) and Decoupled DiLoCo (M jobs, the learners).

Both are the same machine.  A *group* of slices trains while all its slices are up,
keeping its work every ``interval`` seconds of training at a cost of ``save`` seconds
(plain: a checkpoint; a learner: a send, free, since it overlaps training).  When one of
its slices fails it stops, loses what it did since it last kept its work, swaps the slice
for a spare and restarts, which takes ``restart`` seconds.  A slice of it that fails
while it restarts is swapped for a spare too, within the same restart: the group is
down already, and comes back once with every slice it was given (so the cost of a
failure does not compound as failures come faster).  With no spare left it waits for
the next repaired slice, then restarts.  Groups share the spares and nothing else: one
learner's failure never stops another.

Between events a running group's progress is deterministic, so what it kept is counted
in closed form when it stops: ``floor(ran / (interval + save))`` segments of ``interval``.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque

from diloco_cli.simulate.cluster import Cluster, Outcome

RUNNING, RESTARTING, WAITING = 0, 1, 2


def kept_work(ran: float, interval: float, save: float, censored: bool = False) -> float:
    """Training seconds kept by a group that ran ``ran`` seconds: its complete segments of
    ``interval`` training plus ``save``.  ``censored``: the run was cut by the horizon,
    not by a failure, so the training of its last, unfinished segment counts too."""
    if math.isinf(interval):
        return ran if censored else 0.0
    segments = math.floor(ran / (interval + save))
    kept = segments * interval
    if censored:
        kept += min(ran - segments * (interval + save), interval)
    return kept


def simulate_restarting(
    cluster: Cluster,
    group_slices: list[int],
    interval: float,
    save: float,
    restart: float,
    rng: random.Random,
) -> Outcome:
    """One replica: groups of ``group_slices`` slices each, the rest of the cluster's
    slices spares, every group running at time zero."""
    groups = len(group_slices)
    size = list(group_slices)
    up = list(group_slices)
    spares = cluster.slices - sum(size)
    assert spares >= 0, "the groups hold more slices than the cluster has"
    phase = [RUNNING] * groups
    since = [0.0] * groups  # when each running group started
    attempt = [0] * groups  # restart attempts, so a superseded restart's event is ignored
    restarts: list[tuple[float, int, int]] = []  # heap of (done at, attempt, group)
    repairs: deque[float] = deque()  # return times of slices in repair, in order
    waiting = 0
    running = groups
    up_since, up_seconds = 0.0, 0.0
    useful = 0.0  # slice-seconds kept
    interruptions = 0
    horizon = cluster.horizon_seconds
    repair = cluster.repair_seconds

    def start_restart(group: int, now: float) -> None:
        attempt[group] += 1
        phase[group] = RESTARTING
        heapq.heappush(restarts, (now + restart, attempt[group], group))

    candidate = cluster.next_candidate(0.0, rng)
    while True:
        next_repair = repairs[0] if repairs else math.inf
        while restarts and attempt[restarts[0][2]] != restarts[0][1]:
            heapq.heappop(restarts)  # superseded by a later attempt
        next_restart = restarts[0][0] if restarts else math.inf
        now = min(candidate, next_repair, next_restart)
        if now >= horizon:
            break
        if now == candidate:
            candidate = cluster.next_candidate(now, rng)
            index = int(rng.random() * cluster.slices) - len(repairs)
            if index < 0:
                continue  # landed on a slice already in repair
            interruptions += 1
            repairs.append(now + repair)
            if index < spares:
                spares -= 1
                continue
            index -= spares
            group = 0
            while index >= up[group]:
                index -= up[group]
                group += 1
            up[group] -= 1
            was_running = phase[group] == RUNNING
            if was_running:
                useful += size[group] * kept_work(now - since[group], interval, save)
                running -= 1
                if running == 0:
                    up_seconds += now - up_since
            elif phase[group] == WAITING:
                continue
            taken = min(spares, size[group] - up[group])
            spares -= taken
            up[group] += taken
            if up[group] == size[group]:
                if was_running:
                    start_restart(group, now)
                # else: restarting already, the swapped slice comes up with the rest
            else:
                attempt[group] += 1
                phase[group] = WAITING
                waiting += 1
        elif now == next_repair:
            repairs.popleft()
            if waiting == 0:
                spares += 1
                continue
            group = phase.index(WAITING)
            up[group] += 1
            if up[group] == size[group]:
                waiting -= 1
                start_restart(group, now)
        else:
            _, _, group = heapq.heappop(restarts)
            phase[group] = RUNNING
            since[group] = now
            if running == 0:
                up_since = now
            running += 1
    for group in range(groups):
        if phase[group] == RUNNING:
            useful += size[group] * kept_work(horizon - since[group], interval, save, censored=True)
    if running > 0:
        up_seconds += horizon - up_since
    return Outcome(useful_slice_seconds=useful, up_seconds=up_seconds, interruptions=interruptions, cluster=cluster)


def split_evenly(slices: int, parts: int) -> list[int]:
    """``slices`` into ``parts`` groups as even as whole slices allow (the first ones one
    larger)."""
    base, extra = divmod(slices, parts)
    return [base + (1 if part < extra else 0) for part in range(parts)]
