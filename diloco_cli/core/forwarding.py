"""When a reducer forwards an aggregate, and which sends it holds: pure decisions.

Per fragment, a region's sends wait at its reducer until forwarding them is worth a WAN
upload.  The syncer merges once K of the M learners arrived (then waits a grace window
for the rest), so a region of M_r learners owes its *share of the quorum*,
``ceil(K * M_r / M)``:

* every live learner of the region arrived: forward now (under K=M this is the only
  way, so each region sends one aggregate per round: M_r payloads become one upload);
* the region's share arrived: wait at most ``window_seconds`` more for the others, then
  forward what arrived (under K=1 the share is one learner: the first send goes out
  within the window, and sends arriving after it form another aggregate that the syncer
  adds to the same round, or to the next);
* a send waited ``longest_wait_seconds`` whatever else happens: forward (a region whose
  learners' liveness is misjudged never holds work back for long).

A learner whose send of a fragment is in a forwarded aggregate not yet merged is not in
another one until that is resolved (an aggregate is merged or discarded whole); a
learner's newest send from a base holds all its work since that base, so older ones
from the same base are left out (they are deleted once the newer one is merged).  The
clock is injected; nothing here reads storage.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Protocol

from diloco_cli.core.types import FragmentIndex, LearnerId, Version


class Send(Protocol):
    """What the forwarding reads of a learner's send (a payload's marker)."""

    @property
    def key(self) -> str: ...

    @property
    def learner(self) -> LearnerId: ...

    @property
    def sequence(self) -> int: ...

    @property
    def base_version(self) -> Version: ...


@dataclass(frozen=True)
class Waiting:
    """A learner's send of a fragment, waiting at the reducer since ``seen_at``."""

    fragment: FragmentIndex
    send: Send
    seen_at: float


@dataclass(frozen=True)
class ForwardPolicy:
    quorum: int
    """K of the run."""
    num_learners: int
    """M of the run (active learners)."""
    region_learners: int
    """M_r: active learners of this region."""
    window_seconds: float
    longest_wait_seconds: float

    @property
    def relays(self) -> bool:
        """Under K < M each send is relayed as it is, for the syncer to anchor itself at
        whatever version the fragment has when it arrives: an aggregate anchored here
        would be useful only while that version lasts, and under K < M a merge without
        it may land first (another region's sends; docs/algorithm.md, "Reducers", 5).
        Under K = M every send of a round meets the same version: one aggregate."""
        return self.quorum < self.num_learners

    @property
    def region_share(self) -> int:
        """The region's share of the quorum, ``ceil(K * M_r / M)``, at least 1."""
        if self.num_learners <= 0:
            return 1
        return max(1, min(self.region_learners, math.ceil(self.quorum * self.region_learners / self.num_learners)))


def newest_per_base(waiting: Iterable[Waiting]) -> list[Waiting]:
    """Of each learner's sends from one base, the newest."""
    newest: dict[tuple[LearnerId, Version], Waiting] = {}
    for item in waiting:
        slot = (item.send.learner, item.send.base_version)
        if slot not in newest or item.send.sequence > newest[slot].send.sequence:
            newest[slot] = item
    return sorted(newest.values(), key=lambda item: (item.send.learner, item.send.sequence))


def to_relay(waiting: Iterable[Waiting]) -> list[Waiting]:
    """The sends to relay now, of every fragment: each one not superseded by a newer send
    of its fragment from the same base (a relay waits for nothing: it is never combined)."""
    by_fragment: dict[FragmentIndex, list[Waiting]] = {}
    for item in waiting:
        by_fragment.setdefault(item.fragment, []).append(item)
    return [item for fragment in sorted(by_fragment) for item in newest_per_base(by_fragment[fragment])]


def to_forward(
    waiting: Collection[Waiting],
    in_flight: Collection[LearnerId],
    live: Collection[LearnerId],
    policy: ForwardPolicy,
    now: float,
) -> list[Waiting]:
    """The sends of one fragment to forward now as one aggregate (empty: not yet).
    ``in_flight``: learners with a send of it in an aggregate not resolved yet; ``live``:
    the region's learners that may still send it."""
    free = [item for item in newest_per_base(waiting) if item.send.learner not in in_flight]
    if not free:
        return []
    arrived = {item.send.learner for item in free} | set(in_flight)
    oldest = min(item.seen_at for item in free)
    if not set(live) - arrived:
        return free
    if now - oldest >= policy.longest_wait_seconds:
        return free
    if len(arrived) >= policy.region_share:
        firsts: dict[LearnerId, float] = {}
        for item in free:
            firsts[item.send.learner] = min(item.seen_at, firsts.get(item.send.learner, item.seen_at))
        needed = max(1, policy.region_share - len(set(in_flight)))
        share_reached = sorted(firsts.values())[min(needed, len(firsts)) - 1]
        if now - share_reached >= policy.window_seconds:
            return free
    return []
