"""Test knobs live in the chaos plan, not in the recipe (issue 30, 7): slowed learners
(``--chaos slow-learner=ID:SPEED``) and payloads kept for an audit (``--chaos
keep-payloads``); a recipe that still sets the keys they replace is told what became of them."""

import types

import pytest

from diloco_cli.config.chaos import parse_chaos
from diloco_cli.config.errors import ConfigError
from diloco_cli.config.loading import load_model
from diloco_cli.config.recipe import Recipe
from diloco_cli.launch.resolve import with_chaos
from diloco_cli.runtime.learner import loop as learner_loop
from diloco_cli.views.dry_run import render_dry_run
from tests.support.harness import Harness
from tests.support.runs import write_yaml


def test_slow_learners_and_kept_payloads_parse_and_mistakes_say_what_is_wrong():
    plan = parse_chaos("seed=2, slow-learner=east-0:0.5, slow-learner=west-1:.25, keep-payloads")
    assert plan.slow_learners == {"east-0": 0.5, "west-1": 0.25} and plan.keep_payloads
    assert not plan.has_process_faults  # nothing for the driver to do: each learner slows itself
    plain = parse_chaos("kill-learner=1/min")
    assert plain.slow_learners == {} and not plain.keep_payloads
    for bad, message in (
        ("slow-learner=east-0", "a slow learner is LEARNER:SPEED with 0 < SPEED <= 1"),
        ("slow-learner=east-0:0", "0 < SPEED <= 1"),
        ("slow-learner=east-0:1.5", "0 < SPEED <= 1"),
        ("slow-learner=east-0:fast", "like local-b-0:0.6"),
        ("slow-learner=:0.5", "LEARNER:SPEED"),
        ("slow-learner=east-0:0.5,slow-learner=east-0:0.8", "east-0 is slowed twice"),
        ("keep-payloads=no", "keep-payloads takes no value"),
        ("keep-payload", "KEY one of .*slow-learner.*, or keep-payloads"),
    ):
        with pytest.raises(ConfigError, match=message):
            parse_chaos(bad)


def test_a_slow_learner_must_be_a_learner_of_the_run(tmp_path, secret):
    harness = Harness(tmp_path, secret)
    try:
        with pytest.raises(ConfigError, match=r"slow-learner of east-9, not a learner of this run.*east-0, east-1"):
            with_chaos(harness.spec, parse_chaos("slow-learner=east-9:0.5"))
        slowed = with_chaos(harness.spec, parse_chaos("slow-learner=east-1:0.5"))
        assert slowed.speed_of("east-1") == 0.5 and slowed.speed_of("east-0") == 1.0
        assert harness.spec.speed_of("east-1") == 1.0 and not harness.spec.keeps_payloads
        shown = render_dry_run(slowed)  # what `diloco up --dry-run --chaos ...` prints
        assert "learner east-1 on local, shard 1, at 0.5 of full speed (--chaos slow-learner)" in shown
        assert "learner east-0 on local, shard 0\n" in shown and "chaos plan:\n" in shown
        assert "  slow_learners:\n    east-1: 0.5\n  keep_payloads: false" in shown
    finally:
        harness.close()


@pytest.mark.parametrize(
    ("key", "value", "replacement"),
    [
        ("training.learner_speeds", {"east-0": 0.5}, "--chaos slow-learner=ID:SPEED"),
        ("sync.delete_consumed_payloads", False, "--chaos keep-payloads"),
    ],
)
def test_a_retired_test_knob_says_in_one_line_what_became_of_it(tmp_path, key, value, replacement):
    section, name = key.split(".")
    assert name not in Recipe.model_fields[section].annotation.model_fields
    path = write_yaml(tmp_path / "recipe.yaml", {section: {name: value}})
    with pytest.raises(ConfigError) as raised:
        load_model(Recipe, path)
    message = str(raised.value)
    assert message.startswith(f"{path}: '{key}' is no longer a setting: ") and "remove the key" in message
    assert replacement in message and "\n" not in message


@pytest.mark.parametrize(("chaos", "expected_sleep"), [(None, None), ("slow-learner=east-0:0.25", 3.0)])
def test_a_slowed_learner_waits_1_over_speed_minus_1_times_its_compute_time(
    tmp_path, secret, monkeypatch, chaos, expected_sleep
):
    """Each inner step computes for 1 s (by a fake clock): at speed 0.25 the learner then
    waits 3 s, and its step time (what its heartbeat reports, what the grace window reads)
    is 4 s; the other learner, and every learner of a run without the plan, does not wait."""
    harness = Harness(tmp_path, secret, chaos=chaos)
    try:
        now, slept, step_times = [0.0], [], []

        def sleep(seconds):
            slept.append(seconds)
            now[0] += seconds

        def inner_step(*arguments, **keywords):
            now[0] += 1.0
            return real_inner_step(*arguments, **keywords)

        real_inner_step = learner_loop.inner_step
        monkeypatch.setattr(learner_loop, "time", types.SimpleNamespace(perf_counter=lambda: now[0], sleep=sleep))
        monkeypatch.setattr(learner_loop, "inner_step", inner_step)
        for learner in harness.learners:
            monkeypatch.setattr(learner, "after_step", lambda loss, seconds: step_times.append(seconds))
            learner.loop.train_step()
        if expected_sleep is None:
            assert slept == [] and step_times == [1.0, 1.0]
        else:
            assert slept == [pytest.approx(expected_sleep)]  # east-0 only
            assert step_times == [pytest.approx(1.0 + expected_sleep), 1.0]
    finally:
        harness.close()


@pytest.mark.parametrize("chaos", [None, "keep-payloads"])
def test_consumed_payloads_are_deleted_unless_the_plan_keeps_them(tmp_path, secret, chaos):
    harness = Harness(tmp_path, secret, chaos=chaos)
    try:
        for learner in harness.learners:
            harness.train(learner, 10)
        harness.merge()
        for reducer in harness.reducers:
            reducer.turn()  # takes in that the syncer let the relays go
        assert harness.syncer.home.history(), "nothing was merged"
        kept = harness.bucket.payload_keys()
        assert bool(kept) == (chaos == "keep-payloads"), kept
    finally:
        harness.close()
