"""bench.topology --quick: the three topologies as whole runs on the emulated WAN.

What holds on any machine and a broken topology gets wrong: with reducers no payload
crosses a link (the syncer reads aggregates only), the syncer in
the first region moves nothing across that region's link, and the default moves fewer
WAN bytes per token than the landed topology.  Needs root and iproute2.
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def syncer_read(row: dict, kind: str) -> int:
    """Bytes of ``kind`` the syncer read, from every region's bucket."""
    return sum(kinds.get(kind, {}).get("bytes_down", 0) for kinds in row["syncer_kinds"].values())


def test_topology_benchmark_quick(tmp_path):
    from bench import topology

    output = tmp_path / "topology.json"
    topology.main(["--quick", "--output", str(output), "--latency-ms", "10"])
    document = json.loads(output.read_text())
    rows = {row["topology"]: row for row in document["results"]["rows"]}
    assert set(rows) == {"landed", "default", "default 2x4"}
    for row in rows.values():
        assert row["tokens"] > 0 and row["versions"] > 0 and row["final_loss"] > 0
        # the proxies see what the tool's own metering counts (objects and estimated heads,
        # within 2%) and the benchmark's own reads
        assert 0 < row["wan_bytes_per_token_metered"] <= 1.02 * row["wan_bytes_per_token"]
    landed, default = rows["landed"], rows["default"]
    assert syncer_read(landed, "payload") > 0  # the landed syncer reads every payload across
    assert syncer_read(default, "payload") == 0 and syncer_read(default, "aggregate") > 0
    assert set(default["metered_wan_bytes_by_source"]) == {"east"}  # the syncer sits in east: only west is far
    assert default["wan_bytes_per_token"] < landed["wan_bytes_per_token"]
    targets = document["results"]["targets"]
    assert targets["fewer_wan_bytes_than_landed"]["measured"] == pytest.approx(
        landed["wan_bytes_per_token"] / default["wan_bytes_per_token"]
    )
