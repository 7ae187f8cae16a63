"""Which regions the syncer can reach now, and when to look again at one it cannot.

During a region's outage every call to its bucket fails only after the retry policy has
spent its tries (tens of seconds), and the syncer's turn waits for every region's calls:
one region down would slow the merges of all the others.  So a region whose scan failed
is *unreachable*: its turns skip it (no listing, no heartbeats, no publication, no
status; what it misses is caught up later), and it is probed with a single try after a
backoff that doubles from :data:`FIRST_PROBE_SECONDS` to :data:`LONGEST_PROBE_SECONDS`.
A probe that succeeds makes it reachable again.  The clock is injected.
"""

from __future__ import annotations

from dataclasses import dataclass

FIRST_PROBE_SECONDS = 5.0
LONGEST_PROBE_SECONDS = 60.0


@dataclass
class Outage:
    since: float
    probe_at: float
    backoff: float
    reason: str


class Reachability:
    """The regions that are down, with when each is probed next."""

    def __init__(self) -> None:
        self.down: dict[str, Outage] = {}
        self.outages_seen = 0
        """Outages since this syncer started (each a region going down)."""

    def is_down(self, region: str) -> bool:
        return region in self.down

    def due_for_probe(self, region: str, now: float) -> bool:
        outage = self.down.get(region)
        return outage is not None and now >= outage.probe_at

    def failed(self, region: str, reason: str, now: float) -> None:
        """A call to the region failed after its retries (or a probe failed)."""
        outage = self.down.get(region)
        if outage is None:
            self.down[region] = Outage(
                since=now, probe_at=now + FIRST_PROBE_SECONDS, backoff=FIRST_PROBE_SECONDS, reason=reason
            )
            self.outages_seen += 1
            return
        outage.backoff = min(2 * outage.backoff, LONGEST_PROBE_SECONDS)
        outage.probe_at, outage.reason = now + outage.backoff, reason

    def reached(self, region: str) -> float | None:
        """A call to the region succeeded; returns how long it was down (None if it was not)."""
        outage = self.down.pop(region, None)
        return None if outage is None else outage.since
