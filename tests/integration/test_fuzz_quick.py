"""The fuzzer's quick form (``python -m tests.fuzz --quick``, 1 s per target here) runs every
target, writes its JSON, and finds nothing untyped."""

import json

import pytest

pytestmark = pytest.mark.slow


def test_fuzz_quick(tmp_path):
    from tests import fuzz

    output = tmp_path / "fuzz.json"
    fuzz.main(["--quick", "--seconds", "1", "--output", str(output)])
    document = json.loads(output.read_text())
    assert document["benchmark"] == "fuzz" and document["settings"]["seconds_per_target"] == 1
    rows = {row["target"]: row for row in document["results"]["rows"]}
    assert list(rows) == [target.name for target in fuzz.TARGETS]
    for name, row in rows.items():
        assert row["inputs"] > 100 and row["accepted"] + row["typed_errors"] + row["untyped"] == row["inputs"]
        if name != "frame.declared_values":  # it never raises
            assert row["distinct_typed_errors"] >= 3, name
        assert row["untyped"] == 0 and not row["untyped_examples"], (name, row["untyped_examples"])
    assert document["results"]["inputs"] == sum(row["inputs"] for row in rows.values())
