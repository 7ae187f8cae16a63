"""Chaos plans: specs parse and mistakes say what is wrong, and an outage window fails a
region's storage calls only inside it (the runs under them: tests/integration/test_outage.py)."""

import pytest

from diloco_cli.config.chaos import parse_chaos
from diloco_cli.config.errors import ConfigError
from diloco_cli.store.faults import StorageFaults


def test_chaos_specs_parse_and_mistakes_say_what_is_wrong():
    plan = parse_chaos(
        "seed=3,kill-learner=0.5/min,stop-learner=2/h:10s,outage=west@1m+30s:hang,outage-rate=0.1/min:20s"
    )
    assert (
        plan.kill_learner_per_minute == 0.5
        and plan.stop_learner_per_minute == pytest.approx(2 / 60)
        and plan.stop_seconds == 10
    )
    assert plan.outages[0].region == "west" and plan.outages[0].start_seconds == 60 and plan.outages[0].mode == "hang"
    windows = plan.outage_windows(["east", "west"])
    assert windows == parse_chaos("seed=3,outage=west@60s+30s:hang,outage-rate=0.1/min:20s").outage_windows(
        ["east", "west"]
    )  # reproducible
    assert windows != parse_chaos("seed=4,outage=west@60s+30s:hang,outage-rate=0.1/min:20s").outage_windows(
        ["east", "west"]
    )
    for bad, message in (
        ("kill=1/min", "KEY one of"),
        ("kill-learner=fast", "not a rate"),
        ("outage=west", r"REGION@START\+DURATION"),
    ):
        with pytest.raises(ConfigError, match=message):
            parse_chaos(bad)


def test_an_outage_window_fails_calls_only_inside_it():
    now = [100.0]
    faults = StorageFaults.of(parse_chaos("outage=west@10s+5s"), "west", ["east", "west"], started_at=80.0)
    faults._clock = lambda: now[0]
    assert StorageFaults.of(parse_chaos("outage=west@10s+5s"), "east", ["east", "west"], 80.0) is None
    faults.check("reading x")  # 20 s after the start: the window is 10 s to 15 s
    now[0] = 92.0
    with pytest.raises(ConnectionError, match="chaos: the storage of region west is down"):
        faults.check("reading x")
    now[0] = 95.0
    faults.check("reading x")
    # a plan given to a running run (`diloco chaos`) counts its times from then
    later = parse_chaos("outage=west@10s+5s").model_copy(update={"begins_at_seconds": 100.0})
    windows = StorageFaults.of(later, "west", ["east", "west"], started_at=80.0).windows
    assert [(w.start, w.end) for w in windows] == [(190.0, 195.0)]
