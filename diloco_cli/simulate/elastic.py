"""Elastic data-parallel: one job on every slice that is up, which pauses to reconfigure
whenever a slice fails (shrink) or comes back from repair (grow).

No work is lost: the replicas hold the model, so the job drops the failed slice's
replica, re-forms its collectives and goes on.  But every change of membership stops all
chips for ``pause`` seconds; changes that arrive during a pause are taken by that same
pause (the job re-forms with the slices that are up when it ends).  It keeps no spares:
slices in repair simply do not train.
"""

from __future__ import annotations

import math
import random
from collections import deque

from diloco_cli.simulate.cluster import Cluster, Outcome


def simulate_elastic(cluster: Cluster, pause: float, rng: random.Random) -> Outcome:
    """One replica: every slice up and training at time zero."""
    up = cluster.slices
    running, since = True, 0.0  # training since, or pausing until
    repairs: deque[float] = deque()
    useful, up_seconds = 0.0, 0.0
    interruptions = 0
    horizon = cluster.horizon_seconds
    repair = cluster.repair_seconds

    candidate = cluster.next_candidate(0.0, rng)
    while True:
        next_repair = repairs[0] if repairs else math.inf
        pause_end = math.inf if running else since
        now = min(candidate, next_repair, pause_end)
        if now >= horizon:
            break
        if now == pause_end:
            running, since = True, now
            continue
        if now == candidate:
            candidate = cluster.next_candidate(now, rng)
            if int(rng.random() * cluster.slices) < len(repairs):
                continue  # landed on a slice already in repair
            interruptions += 1
            repairs.append(now + repair)
            change = -1
        else:
            repairs.popleft()
            change = +1
        if running:
            useful += up * (now - since)
            up_seconds += now - since
            running, since = False, now + pause
        up += change  # during a pause, the pause takes it
    if running:
        useful += up * (horizon - since)
        up_seconds += horizon - since
    return Outcome(useful_slice_seconds=useful, up_seconds=up_seconds, interruptions=interruptions, cluster=cluster)
