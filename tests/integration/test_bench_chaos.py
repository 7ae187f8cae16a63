"""bench.chaos --quick: a run under kills and an outage against the same run without,
with the ledger's verdict and the simulator's prediction beside the measured goodput."""

import json

import pytest

pytestmark = pytest.mark.slow


def test_chaos_benchmark_quick(tmp_path):
    from bench import chaos

    output = tmp_path / "chaos.json"
    chaos.main(["--quick", "--output", str(output)])
    results = json.loads(output.read_text())["results"]
    calm, stormy = results["runs"]
    assert calm["restarts"] == 0 and stormy["restarts"] > 0  # the faults happened, and only in the chaos run
    assert results["targets"]["ledger"]["met"]  # nothing merged twice, every last send merged
    assert stormy["merged_twice"] == 0
    assert 0 < results["goodput"] and 0 < results["predicted_goodput"] <= 1
    # goodput is a ratio of two runs' timings (noisy on a shared machine); what cannot vary
    # is the tokens: nothing merged that was not trained, and a kill redoes at most the
    # steps since the learner's last checkpoint
    training = chaos.recipe_for(True).training
    tokens_per_step = training.batch_size * chaos.recipe_for(True).data.sequence_length
    budget = training.num_learners * training.inner_steps * tokens_per_step
    redone = stormy["restarts"] * training.checkpoint_every_steps * tokens_per_step
    assert 0 < calm["merged_tokens"] <= budget
    assert 0 < stormy["merged_tokens"] <= budget + redone
    assert stormy["loss"] < 4.5 and calm["loss"] < 4.5  # both trained (from ~5.5)
