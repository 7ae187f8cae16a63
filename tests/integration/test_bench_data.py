"""``bench.data``'s quick mode runs, writes its JSON and reports against its targets.

Speeds are reported, not asserted (the machines are shared); what the loader reads is
deterministic: every byte of the range once (a range that fits the cache stays in it).
"""

import json

import pytest

pytestmark = pytest.mark.slow


def test_data_benchmark_quick(tmp_path):
    from bench import data

    output = tmp_path / "data.json"
    data.main(["--quick", "--output", str(output)])
    document = json.loads(output.read_text())
    assert document["settings"]["dataset_megabytes"] == 32 and document["settings"]["delay_ms_each_way"] == 50
    rows = document["results"]["rows"]
    assert sorted({row["source"] for row in rows}) == ["S3 (moto) +50 ms each way", "local disk"]
    assert len(rows) == 2 * document["settings"]["repeats"] and all(
        row["tokens_per_second"] > 0 and row["stalled_batches"] >= 0 for row in rows
    )
    for row in rows:
        if row["source"] != "local disk":  # 8 chunks of 4 MB, in a cache of 16: read once, kept for the next epoch
            assert row["link_bytes_per_range_byte"] == pytest.approx(1.0, abs=0.02)
    results = document["results"]
    assert results["model_tokens_per_second"] > 0 and results["link_ceiling_tokens_per_second"] > 0
    assert set(results["targets"]) == {"bucket_vs_disk", "loader_vs_model"}
