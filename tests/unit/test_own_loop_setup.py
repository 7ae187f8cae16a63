"""A user's own training loop, before any run: ``join`` outside a run says how to start one,
and the example recipes load (the runs: tests/integration/test_own_loop.py)."""

from pathlib import Path

import pytest

from diloco_cli.config.loading import load_model
from diloco_cli.config.recipe import Recipe

ROOT = Path(__file__).resolve().parents[2]


def test_join_outside_a_run_says_how_to_start_one(monkeypatch):
    import torch

    from diloco_cli import join
    from diloco_cli.runtime.learner.own_loop import NotInARun

    for variable in ("DILOCO_MANIFEST", "DILOCO_LEARNER", "DILOCO_SECRET_FILE"):
        monkeypatch.delenv(variable, raising=False)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(NotInARun, match="training.entry_point.*diloco up"):
        join(model, torch.optim.AdamW(model.parameters()), tokens_per_step=1)


def test_the_example_recipes_load():
    for path in ("examples/plain-loop.yaml", "examples/hf-trainer.yaml"):
        assert load_model(Recipe, ROOT / path).training.entry_point
