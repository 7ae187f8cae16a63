"""What ``diloco scale`` prints: the change made, and where each drained learner's work
went."""

from __future__ import annotations

from typing import TYPE_CHECKING

from diloco_cli.store.run_spec import ScaleChange

if TYPE_CHECKING:
    from diloco_cli.launch.scale import DrainOutcome


def render_change(run: str, change: ScaleChange, quorum: int) -> str:
    """``run r: added east-1 in region east; M is now 3 (K=3)``"""
    verb = f"added {', '.join(change.added)}" if change.added else f"draining {', '.join(change.drained)}"
    return f"run {run}: {verb} in region {change.region}; M is now {change.learners_after} (K={quorum})"


def render_drained(outcome: DrainOutcome) -> str:
    """A drained learner that stopped with all its work accounted for: per fragment, how
    much reached a merge and how much an install of newer global weights overwrote
    before it was sent (the paper's rule for installs), and how much was sent from a base
    the syncer could not anchor (older than the window of updates it keeps: refused, and
    the learner resynced)."""
    fragments = "; ".join(
        f"fragment {fragment}: {merged:,} merged"
        + (f", {overwritten:,} overwritten by installs" if overwritten else "")
        + (f", {stale:,} refused as too stale to anchor" if stale else "")
        for fragment, (merged, overwritten, stale) in enumerate(outcome.per_fragment)
    )
    return (
        f"  {outcome.learner:<16} drained: it stopped, and every one of the {outcome.tokens:,} tokens it trained "
        f"is accounted for ({fragments})"
    )


def render_unfinished(run: str, outcomes: list[DrainOutcome], timeout: float) -> str:
    """The drained learners not done within ``timeout``, with how far each got."""
    waiting = ", ".join(
        f"{o.learner} ({o.accounted:,} of {o.tokens:,} tokens merged, overwritten or refused)"
        if o.tokens
        else f"{o.learner} (not stopped yet)"
        for o in outcomes
    )
    return f"error: after {timeout:.0f} s, not drained yet: {waiting}; `diloco status {run}` shows them"
