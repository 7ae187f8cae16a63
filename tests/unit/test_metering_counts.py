"""Every byte metered, in-process: keys by kind, counts that continue across restarts with
their history, histories of several processes summed (tests/integration/test_metering.py
checks the counts against what real S3 servers received and sent)."""

from __future__ import annotations

import pytest

from diloco_cli.bandwidth.report import summed_history
from diloco_cli.codec import RunSecret
from diloco_cli.store.metering import StorageMeter, Traffic, thinned
from diloco_cli.store.region import kind_of_key


def test_kinds_of_keys():
    assert kind_of_key("payloads/r0-0/000-000000000001.dlc") == "payload"
    assert kind_of_key("payloads/r0-0/000-000000000001.dlc.ready") == "marker"
    assert kind_of_key("relays/r0-0/000-000000000001.dlc") == "aggregate"  # what crosses from a region's reducer
    assert kind_of_key("aggregates/000-000001000001.dlc") == "aggregate"
    assert kind_of_key("global/updates/0000000003-001.dlc") == "update"
    assert kind_of_key("global/snapshots/0000000000.dlc") == "snapshot"
    assert kind_of_key("checkpoints/r0-0/0000000015.dlc") == "checkpoint"
    assert kind_of_key("global/head.json") == "head"
    assert kind_of_key("global/syncer.json") == "status"
    assert kind_of_key("heartbeats/r0-0.json") == "heartbeat"
    assert kind_of_key("control/r0-0.epoch") == "control"
    assert kind_of_key("stray/junk") == "other"


def test_counts_continue_across_restarts_with_their_history():
    first = StorageMeter()
    first.count("payload", requests=2, op="write", up=1000, seconds=0.5)
    before = first.snapshot()
    second = StorageMeter()
    second.count("payload", requests=1, op="write", up=300)
    second.count("listing", requests=1, op="list", down=700)
    total = before.plus(second.snapshot())
    assert total.kinds["payload"] == Traffic(requests=3, writes=3, bytes_up=1300, seconds=0.5)
    assert total.bytes_up == 1300 and total.bytes_down == 700 and total.requests == 4
    # the second start's samples continue from the first's totals
    assert [sample[1:] for sample in total.history] == [(1000, 0), (1300, 700)]
    assert len(thinned([(float(i), i, 0) for i in range(500)], 120)) <= 120
    assert thinned([(float(i), i, 0) for i in range(500)], 120)[-1] == (499.0, 499, 0)


def test_histories_of_several_processes_add_up_as_step_functions():
    a = [(10.0, 100, 1), (20.0, 200, 2)]
    b = [(15.0, 1000, 10), (30.0, 3000, 30)]
    assert summed_history([a, b]) == [(10.0, 100, 1), (15.0, 1100, 11), (20.0, 1200, 12), (30.0, 3200, 32)]


def test_a_restarted_syncer_continues_its_counts_from_its_last_status(tmp_path):
    from diloco_cli.runtime.syncer.loop import Syncer
    from diloco_cli.store.documents import SyncerPhase
    from tests.support.harness import Harness

    harness = Harness(tmp_path, RunSecret.generate())
    harness.train(harness.learners[0], 10)
    harness.merge()
    harness.syncer.write_status(SyncerPhase.RUNNING)
    before = harness.bucket.read_syncer_status().storage["east"]
    assert before.kinds["aggregate"].bytes_down > 0 and before.kinds["update"].bytes_up > 0  # relays read
    restarted = Syncer(harness.spec, harness.secret)
    restarted.start()
    restarted.write_status(SyncerPhase.RUNNING)
    after = harness.bucket.read_syncer_status().storage["east"]
    for kind, traffic in before.kinds.items():
        assert after.kinds[kind].requests >= traffic.requests and after.kinds[kind].bytes_down >= traffic.bytes_down, (
            kind
        )
    assert after.requests > before.requests  # the new start's own calls come on top
    assert after.history[: len(before.history)] == before.history


def test_the_newest_history_sample_is_always_the_present_totals(monkeypatch):
    """A plot of the history ends at the report's figures: the last sample moves on to each
    snapshot, the ones before it stay at least SAMPLE_SECONDS apart."""
    import diloco_cli.store.metering as metering

    now = [1000.0]
    monkeypatch.setattr(metering.time, "time", lambda: now[0])
    meter = StorageMeter()
    for _ in range(30):  # a snapshot every 2 s, 100 bytes between them
        meter.count("payload", requests=1, op="write", up=100)
        counters = meter.snapshot()
        assert counters.history[-1] == (now[0], counters.total.bytes_up, 0)
        now[0] += 2.0
    times = [when for when, _, _ in counters.history]
    assert all(later - earlier >= metering.SAMPLE_SECONDS for earlier, later in zip(times[:-2], times[1:-1]))
    assert counters.history[-1][1] == 3000 and len(times) in (6, 7)


def test_each_kind_is_priced_as_its_link_is_and_the_kinds_add_up_to_the_links():
    """An update read 10 GB across the internet from an AWS bucket (0.09 $/GB) and a
    heartbeat written in the region: the kinds' costs are the links' split by kind."""
    from diloco_cli.bandwidth.prices import GB, load_prices
    from diloco_cli.bandwidth.report import _kinds, _link
    from diloco_cli.store.metering import StorageCounters

    prices, provider = load_prices(), {"east": "aws"}
    syncer = StorageCounters(
        kinds={
            "update": Traffic(requests=1000, writes=0, bytes_down=10 * GB),
            "head": Traffic(requests=2000, writes=2000, bytes_up=2_000_000),
        }
    )
    learner = StorageCounters(kinds={"heartbeat": Traffic(requests=500, writes=500, bytes_up=1_000_000)})
    sources = [("syncer", "east", [syncer]), ("east", "east", [learner])]
    kinds = {row.kind: row for row in _kinds(sources, prices, provider)}
    links = [_link(source, bucket, counts, 1, prices, provider) for source, bucket, counts in sources]
    assert kinds["update"].cost_dollars == pytest.approx(10 * 0.09 + 1000 / 1000 * 0.0004)
    assert kinds["heartbeat"].wan_bytes == 0 and kinds["heartbeat"].cost_dollars == pytest.approx(500 / 1000 * 0.005)
    assert sum(row.cost_dollars for row in kinds.values()) == pytest.approx(sum(link.cost_dollars for link in links))
    assert all(row.cost_dollars == 0 for row in _kinds(sources, None, provider))


def test_request_overhead_is_counted_apart_and_reports_show_wire_bytes():
    """Heads ride beside the objects: compression sees objects only, links and kinds every
    byte (objects and heads), and the history ends at the links' figures."""
    from diloco_cli.bandwidth.report import _kinds, _link
    from diloco_cli.store.wire import S3_WIRE, wire_model

    path = "/bucket/run/payloads/r0-0/000-000000000001.dlc"  # 46 characters
    assert S3_WIRE.estimate("write", path) == (860 + 46, 385)
    assert S3_WIRE.estimate("read", path, missing=True) == (750 + 46, 630)
    assert S3_WIRE.estimate_batch("/bucket", ["bucket/a/1", "bucket/a/2"]) == (
        715 + 7 + 180 + 2 * 30 + 20,
        245 + 110 + 2 * 35 + 20,
    )
    assert wire_model("file").estimate("write", path) == (0, 0) and wire_model("gs") is not S3_WIRE
    meter = StorageMeter()
    meter.count("payload", requests=1, op="write", up=10_000, raw=80_000, overhead=S3_WIRE.estimate("write", path))
    meter.count("payload", requests=1, op="read", down=10_000, overhead=S3_WIRE.estimate("read", path))
    counters = meter.snapshot()
    payload = counters.kinds["payload"]
    assert (payload.bytes_up, payload.overhead_up, payload.wire_up) == (10_000, 906 + 796, 11_702)
    assert (payload.bytes_down, payload.overhead_down, payload.wire_down) == (10_000, 910, 10_910)
    assert counters.history[-1][1:] == (11_702, 10_910)
    link = _link("syncer", "east", [counters], 1, None, {"east": None})
    assert (link.bytes_up, link.bytes_down, link.overhead_bytes) == (11_702, 10_910, 1702 + 910)
    (kind,) = _kinds([("syncer", "east", [counters])], None, {"east": None})
    assert kind.wan_bytes == 11_702 + 10_910 and kind.overhead_bytes == 2612
