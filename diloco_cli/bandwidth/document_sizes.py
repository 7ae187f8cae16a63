"""Sizes of the sealed JSON documents the traffic model counts besides payloads: the
head, heartbeats, the syncer's status, a reducer's status, and the storage counters
inside them.

Each is a constant part plus parts that grow with the fragments, the learners, the
regions, the evaluations so far and the counters' history;
:mod:`diloco_cli.bandwidth.model` calls :func:`head_bytes`, :func:`heartbeat_bytes` and
:func:`status_bytes` and :func:`reducer_status_bytes` with a run's numbers.  The constants were measured on sealed
documents built with :mod:`diloco_cli.store.documents` (a test checks these estimates
against real ones): JSON with ``", "`` and ``": "`` separators, 5-digit versions.
"""

from __future__ import annotations

from diloco_cli.store.metering import MAX_SAMPLES, SAMPLE_SECONDS

HEAD_BYTES = 234
"""A sealed ``global/head.json`` without fragments or recent updates (its tag included)."""
HEAD_BYTES_PER_FRAGMENT = 53
"""Per fragment: its version and its 32-hex-digit digest."""
HEAD_BYTES_PER_RECENT = 12
"""Per (version, fragment) pair of the head's ``recent`` list."""

HEARTBEAT_BYTES = 685
"""A sealed heartbeat with empty storage counters and no refusals, without fragments."""
HEARTBEAT_BYTES_PER_FRAGMENT = 21
"""Per fragment: its base version and the tokens installs overwrote."""

STATUS_BYTES = 807
"""A sealed ``global/syncer.json`` without learners, fragments, regions or evaluations
(its home store's counters empty)."""
STATUS_BYTES_PER_FRAGMENT = 73
"""Per fragment: its version, the reason it is not merging, its pending list's key."""
STATUS_BYTES_PER_REGION = 130
"""Per region: empty storage counters and refusals (plus twice the region's name)."""
STATUS_BYTES_PER_LISTED_NAME = 4
"""Per learner name in a list, besides the name: quotes and ``", "``."""
EVALUATION_BYTES = 83
"""Per held-out evaluation the status lists (every one of the run so far)."""

REDUCER_STATUS_BYTES = 550
"""A sealed ``reducer/status.json`` without fragments or learners (its counters empty)."""
REDUCER_STATUS_BYTES_PER_FRAGMENT = 30
"""Per fragment: its version and its keys in the in-flight and waiting lists."""
REDUCER_STATUS_BYTES_PER_LEARNER = 24
"""Per learner of the region, besides its name: the time of its heartbeat last seen."""

COUNTERS_BYTES_PER_KIND = 188
"""Storage counters (``store.metering``) per kind of object counted."""
COUNTERS_BYTES_PER_SAMPLE = 38
"""Storage counters per history sample held."""
LEARNER_KINDS = 8
"""Kinds a learner's counters hold: payload, marker, checkpoint, heartbeat, head, update,
listing, control."""
SYNCER_KINDS = 8
"""Kinds the syncer's counters of one region hold: payload, marker, heartbeat, update,
snapshot, head, status, listing."""
REDUCER_KINDS = 10
"""Kinds a reducer's counters hold: payload, marker, aggregate, reducer, heartbeat, head,
update, snapshot, listing, control."""
HOME_KINDS = 2
"""Kinds the syncer's counters of its home store hold: home, listing."""


def history_samples(run_seconds: float) -> float:
    """History samples a store's counters hold on average over a run of ``run_seconds``:
    ``min(run_seconds / (2 x 10 s), 0.75 x 120)`` (they grow one per 10 s, and are
    halved whenever they pass 120)."""
    return min(run_seconds / (2 * SAMPLE_SECONDS), 0.75 * MAX_SAMPLES)


def counters_bytes(kinds: int, samples: float) -> float:
    """Storage counters beyond their empty form: ``144 x kinds + 38 x samples``."""
    return COUNTERS_BYTES_PER_KIND * kinds + COUNTERS_BYTES_PER_SAMPLE * samples


def head_bytes(num_fragments: int, recent: float) -> float:
    """The sealed head: ``234 + 53 P + 12 x recent`` (``recent`` updates listed: between S
    and 2S in a long run, 1.5 S on average)."""
    return HEAD_BYTES + HEAD_BYTES_PER_FRAGMENT * num_fragments + HEAD_BYTES_PER_RECENT * recent


def heartbeat_bytes(num_fragments: int, samples: float) -> float:
    """A sealed heartbeat: ``685 + 21 P + counters(8 kinds, samples)``."""
    return HEARTBEAT_BYTES + HEARTBEAT_BYTES_PER_FRAGMENT * num_fragments + counters_bytes(LEARNER_KINDS, samples)


def status_bytes(
    num_learners: int,
    num_regions: int,
    num_fragments: int,
    evaluations: float,
    samples: float,
    learner_id_bytes: float = 10.0,
    region_name_bytes: float = 8.0,
) -> float:
    """The sealed syncer status::

        807 + 2 M (L + 4)                       last merge's and live learners' names
            + P (73 + M/2 (L + 4))              per fragment, half the learners pending
            + R (130 + 2 N + counters(8 kinds, samples))
            + counters(2 kinds, samples)        the syncer's home store
            + 83 x evaluations

    with L a learner id's length and N a region name's."""
    name = learner_id_bytes + STATUS_BYTES_PER_LISTED_NAME
    per_region = STATUS_BYTES_PER_REGION + 2 * region_name_bytes + counters_bytes(SYNCER_KINDS, samples)
    return (
        STATUS_BYTES
        + 2 * num_learners * name
        + num_fragments * (STATUS_BYTES_PER_FRAGMENT + num_learners / 2 * name)
        + num_regions * per_region
        + counters_bytes(HOME_KINDS, samples)
        + EVALUATION_BYTES * evaluations
    )


def reducer_status_bytes(
    num_fragments: int, region_learners: int, samples: float, learner_id_bytes: float = 10.0
) -> float:
    """A region's sealed reducer status::

        550 + 30 P + M_r (L + 24)               per learner its heartbeat's time
            + P M_r (L + 4)                     per fragment, each learner in flight or waiting
            + counters(10 kinds, samples)

    with M_r the region's learners and L a learner id's length."""
    name = learner_id_bytes + STATUS_BYTES_PER_LISTED_NAME
    return (
        REDUCER_STATUS_BYTES
        + REDUCER_STATUS_BYTES_PER_FRAGMENT * num_fragments
        + region_learners * (learner_id_bytes + REDUCER_STATUS_BYTES_PER_LEARNER)
        + num_fragments * region_learners * name
        + counters_bytes(REDUCER_KINDS, samples)
    )
