"""Every byte metered: what the stores count equals what S3 servers received and sent
(counted by a byte-counting proxy in front of them), by kind, across restarts."""

from __future__ import annotations

import json
import os
import signal
import time
from contextlib import ExitStack

import pytest

from diloco_cli.codec import CodecSpec, RunSecret, encode_payload
from diloco_cli.launch.runs import load_run
from diloco_cli.store.metering import Traffic
from diloco_cli.store.region import RegionBucket
from testbed.delay_proxy import delay_proxy
from testbed.fault_proxy import FaultRules, fault_proxy
from tests.support.runs import (
    TINY_RECIPE,
    child_pid,
    deep_update,
    diloco,
    wait_processes_gone,
    write_yaml,
)

HEADER_BYTES = 1500
"""Most bytes of request or response headers (and listing estimate error) per request."""


def counting_proxy(server):
    host, port = server.endpoint_url.split("//")[1].split(":")
    return delay_proxy((host, int(port)), 0.0)


def proxy_bytes(proxy) -> tuple[int, int]:
    counts = proxy.settled_counts().as_dict()
    return counts["bytes_to_upstream"], counts["bytes_to_client"]


def assert_within_headers(what: str, metered: int, seen: int, requests: int, unreported: int = 0) -> None:
    assert metered <= seen + 2000, f"{what}: metered {metered} B but only {seen} B went through"
    slack = requests * HEADER_BYTES + 2000 + unreported
    assert seen - metered <= slack, f"{what}: {seen} B went through, {metered} B metered in {requests} requests"


def test_a_store_counts_what_the_s3_server_received_and_sent(s3):
    secret = RunSecret.generate()
    root = s3.create_bucket("metered") + "/run"
    tensors = [("w", __import__("torch").randn(64, 64))]
    payload = encode_payload(tensors, CodecSpec(), secret, {"base_version": 0, "c_steps": 1, "c_tokens": 64})
    with counting_proxy(s3) as proxy:
        bucket = RegionBucket("r0", root, {"endpoint_url": f"http://{proxy.host}:{proxy.port}"}, secret)
        for sequence in range(1, 6):
            bucket.send_payload("r0-0", 0, sequence, payload, {"base_version": 0, "c_steps": 1, "c_tokens": 64})
        keys = bucket.payload_keys()
        for key in keys:
            bucket.read_payload(key)
            bucket.delete_payload(key)
        bucket.store.put("heartbeats/r0-0.json", b"x" * 3000)
        counters = bucket.store.meter.snapshot()
        up, down = proxy_bytes(proxy)
    kinds = counters.kinds
    assert len(keys) == 5
    assert kinds["payload"].bytes_up == 5 * len(payload) == kinds["payload"].bytes_down
    assert kinds["payload"].raw_bytes == 5 * 64 * 64 * 4  # what the codec compressed, fp32
    assert kinds["payload"].writes == 5 and kinds["payload"].deletes == 5 and kinds["payload"].requests == 15
    assert kinds["marker"].writes == 5 and kinds["listing"].requests == kinds["listing"].writes >= 1
    assert kinds["heartbeat"].bytes_up == 3000
    assert_within_headers("up", counters.bytes_up, up, counters.requests)
    assert_within_headers("down", counters.bytes_down, down, counters.requests)


def test_every_request_the_s3_server_receives_is_metered_once_with_its_bytes(s3):
    """Counted by an HTTP proxy in front of moto, request by request: what each store
    operation sends is what the meter counts (an empty listing is one LIST, not s3fs's
    LIST + HEAD + LIST; a check for a missing marker one GET, not HEAD + LIST), and the
    wire bytes (objects and estimated heads) are within 10% of what went through each way;
    over a mix of the default job's sizes, within 1%."""
    torch = __import__("torch")
    secret = RunSecret.generate()
    root = s3.create_bucket("requests") + "/run"
    small = encode_payload([("w", torch.randn(32))], CodecSpec(), secret, {"base_version": 0})
    large = encode_payload([("w", torch.randn(400_000))], CodecSpec(), secret, {"base_version": 0})  # ~200 kB
    marker = {"base_version": 0, "c_steps": 1, "c_tokens": 32}
    with fault_proxy(s3.endpoint_url, FaultRules()) as proxy:
        bucket = RegionBucket("r0", root, {"endpoint_url": proxy.url}, secret)
        store = bucket.store

        def seen() -> tuple[int, int, int]:
            counts = proxy.stats.byte_counts()
            up = counts.get("head_up", 0) + counts.get("body_up", 0)
            return proxy.stats.total("forwarded"), up, counts.get("head_down", 0) + counts.get("body_down", 0)

        def metered() -> tuple[int, int, int]:
            counters = store.meter.snapshot()
            return counters.requests, counters.wire_up, counters.wire_down

        steps = [
            ("an empty listing", lambda: store.list("payloads")),
            ("a missing document", lambda: bucket.read_control("r0-0")),
            ("a missing marker", lambda: store.exists("global/updates/0000000001-000.dlc.ready")),
            ("a send (payload and marker)", lambda: bucket.send_payload("r0-0", 0, 1, small, marker)),
            ("a listing", lambda: store.list("payloads")),
            ("a marker there", lambda: store.exists("payloads/r0-0/000-000000000001.dlc.ready")),
            ("a read", lambda: store.get("payloads/r0-0/000-000000000001.dlc")),
            ("a document", lambda: store.put("heartbeats/r0-0.json", b"{}" * 1000)),
            ("a deletion of both", lambda: store.delete_marked("payloads/r0-0/000-000000000001.dlc")),
            ("a batch deletion", lambda: store.delete_many(["a/1", "a/2", "a/3"])),
        ]
        for what, step in steps:
            before_seen, before_metered = seen(), metered()
            step()
            sent = [a - b for a, b in zip(seen(), before_seen)]
            counted = [a - b for a, b in zip(metered(), before_metered)]
            assert counted[0] == sent[0], f"{what}: sent {sent[0]} requests, metered {counted[0]}"
            for direction, got, want in (("up", counted[1], sent[1]), ("down", counted[2], sent[2])):
                assert got == pytest.approx(want, rel=0.10), f"{what}: {want} B {direction}, metered {got}"
        # a learner's round at the default job's sizes, then its update read back
        for sequence in range(2, 6):
            bucket.send_payload("r0-0", 1, sequence, large, marker)
            store.put("heartbeats/r0-0.json", b"{}" * 1500)
            store.get("heartbeats/r0-0.json")
            bucket.read_control("r0-0")
        for key in bucket.payload_keys():
            bucket.read_payload(key)
        total_seen, total_metered = seen(), metered()
    assert total_metered[0] == total_seen[0]
    assert total_metered[1] == pytest.approx(total_seen[1], rel=0.01)
    assert total_metered[2] == pytest.approx(total_seen[2], rel=0.01)


def test_a_runs_report_matches_what_the_servers_saw_and_a_restarted_learner_continues(tmp_path, s3):
    """Two S3 regions, each behind its own byte-counting proxy that every learner and the
    syncer go through; a learner is killed once.  After the run, per bucket, the bytes the
    report gives its links (objects and the requests' estimated heads) are what the proxy
    passed within 1% (and, in the killed learner's region, what it moved after its last
    heartbeat: a checkpoint and a payload at most)."""
    runs_dir, name = tmp_path / "runs", "metered"
    changes = {"training": {"inner_steps": 90, "checkpoint_every_steps": 30}}
    recipe = write_yaml(tmp_path / "tiny.yaml", deep_update(TINY_RECIPE, changes))
    with ExitStack() as stack:
        proxies = [stack.enter_context(counting_proxy(s3)) for _ in range(2)]
        regions = []
        for index, proxy in enumerate(proxies):
            regions.append(
                {
                    "name": f"r{index}",
                    "bucket": s3.create_bucket(f"metered-{index}"),
                    "storage_options": {"endpoint_url": f"http://{proxy.host}:{proxy.port}"},
                }
            )
        # the syncer in a place of its own: every byte it moves goes through a proxy
        regions_file = write_yaml(tmp_path / "regions.yaml", {"regions": regions, "syncer": {"host": "local"}})
        diloco("up", str(recipe), "--regions", str(regions_file), "--name", name, "--runs-dir", str(runs_dir))
        record = load_run(runs_dir, name)
        direct = RegionBucket(
            "r0", record.spec.region("r0").root, {"endpoint_url": s3.endpoint_url}, record.secret()
        )  # not through the proxy
        deadline = time.monotonic() + 120
        while (beat := direct.read_heartbeat("r0-0")) is None or beat.step < 25:
            assert time.monotonic() < deadline, "r0-0 never reached step 25"
            time.sleep(0.3)
        os.kill(child_pid(runs_dir, name, "r0-0"), signal.SIGKILL)  # its supervisor starts it again
        # the processes' exit, not the run's status, is waited for: polling the status would
        # read through the proxies too
        wait_processes_gone(runs_dir, name, timeout=240)
        seen = [proxy_bytes(proxy) for proxy in proxies]
        final = direct.read_heartbeat("r0-0")
        final_r1 = RegionBucket(
            "r1", record.spec.region("r1").root, {"endpoint_url": s3.endpoint_url}, record.secret()
        ).read_heartbeat("r1-0")
        assert final.restarts == 1
        for kind, traffic in beat.storage.kinds.items():  # nothing counted before the kill was lost
            assert final.storage.kinds[kind].requests >= traffic.requests, kind
        assert final.storage.kinds["checkpoint"].bytes_up >= beat.storage.kinds.get("checkpoint", Traffic()).bytes_up
        report = json.loads(diloco("report", name, "--output", "json", "--runs-dir", str(runs_dir)).stdout)
    assert report["state"] == "finished" and report["learners_reporting"] == 2
    untouched = final_r1.storage.kinds
    checkpoint_bytes = untouched["checkpoint"].bytes_up // untouched["checkpoint"].writes
    payload_bytes = untouched["payload"].bytes_up // untouched["payload"].writes
    for index, (up, down) in enumerate(seen):
        links = [link for link in report["links"] if link["bucket"] == f"r{index}"]
        assert {link["source"] for link in links} == {f"r{index}", "syncer"}
        assert [link["wan"] for link in links if link["source"] == "syncer"] == [True]
        killed = index == 0
        unreported = checkpoint_bytes + 2 * payload_bytes if killed else 0
        for direction, seen_bytes in (("up", up), ("down", down)):
            metered = sum(link[f"bytes_{direction}"] for link in links)  # objects and estimated heads
            print(f"r{index} {direction}: {seen_bytes} B through the proxy, {metered} B in the report")
            # within 1%, besides diloco up's own calls (preflight probes, the manifest: ~20 requests)
            # and, in the killed learner's region, what it moved after its last heartbeat
            assert metered <= seen_bytes * 1.01, (
                f"r{index} {direction}: {seen_bytes} B went through, {metered} B metered"
            )
            assert seen_bytes - metered <= 0.01 * seen_bytes + 20 * HEADER_BYTES + unreported, (
                f"r{index} {direction}: {seen_bytes} B went through, {metered} B metered"
            )
    kinds = {row["kind"]: row for row in report["kinds"]}
    assert (
        kinds["checkpoint"]["wan_bytes"] == 0 and kinds["checkpoint"]["bytes_up"] > 0
    )  # checkpoints stay in their region
    payloads, aggregates = kinds["payload"], kinds["aggregate"]
    # payloads stay in their region (each region's reducer reads them); the syncer reads the
    # regions' aggregates across their links: their bytes down, and its requests' heads
    # (the killed learner may leave an unmarked payload, which the syncer removes as a
    # leftover: one request across its region's link, no payload bytes)
    syncer_payload_bytes = [link["kinds"].get("payload", 0) for link in report["links"] if link["source"] == "syncer"]
    assert payloads["bytes_down"] > 0 and payloads["wan_bytes"] == sum(syncer_payload_bytes)
    assert syncer_payload_bytes[1:] == [0] and syncer_payload_bytes[0] <= 2 * HEADER_BYTES, syncer_payload_bytes
    assert (
        0
        < aggregates["bytes_down"]
        < aggregates["wan_bytes"]
        <= aggregates["bytes_down"] + aggregates["overhead_bytes"]
    )
    payload = next(c for c in report["compression"] if c["kind"] == "payload")
    assert 6 < payload["ratio"] < 8.5  # int4 with a scale per block: a bit under 8x
    dp = report["data_parallel"]
    assert dp["bytes_per_worker_step"] == pytest.approx(2 * 1 / 2 * 2 * dp["parameters"])
    assert "ratio" not in dp  # only bytes between regions are compared
    # a hierarchical all-reduce of two regions: both leaders send 2 (2-1)/2 x 2 bytes x parameters each step
    assert dp["regions"] == 2 and dp["hierarchical_wan_bytes"] == pytest.approx(dp["steps"] * 2 * 2 * dp["parameters"])
    assert dp["hierarchical_wan_ratio"] == pytest.approx(dp["hierarchical_wan_bytes"] / report["wan_bytes"])
    # one worker in each of the two regions: both hops of the ring cross between them
    assert dp["region_crossings"] == 2 and dp["wan_bytes"] == pytest.approx(
        dp["steps"] * 2 * dp["bytes_per_worker_step"]
    )
    assert dp["wan_ratio"] == pytest.approx(dp["wan_bytes"] / report["wan_bytes"])
