"""The held-out loss of the global weights, every ``sync.evaluate_every`` versions.

The syncer builds the recipe's model once, on the CPU, and evaluates a version by
copying the global weights into it and taking the mean loss (the recipe's
``training.loss``) over fixed held-out batches.  Each evaluation is labelled with the
version it is of and the tokens the learners had trained then.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

import torch

from diloco_cli.config.recipe import Recipe
from diloco_cli.core.types import Version
from diloco_cli.data.learner import heldout_batches
from diloco_cli.store.documents import Evaluation
from diloco_cli.training.inner import evaluate, resolve_loss

log = logging.getLogger("diloco.syncer")


class Evaluator:
    """The recipe's model and held-out batches, kept for evaluating global versions."""

    def __init__(self, recipe: Recipe, model: torch.nn.Module) -> None:
        self.every = recipe.sync.evaluate_every
        self.model = model
        self.batches = heldout_batches(recipe)
        self.loss_fn = resolve_loss(recipe.training.loss)

    def due(self, version: Version) -> bool:
        return version % self.every == 0

    def evaluate(self, theta: Mapping[str, torch.Tensor], version: Version, tokens: int) -> Evaluation:
        """The held-out loss of ``theta`` (the weights of ``version``), when learners had
        trained ``tokens`` tokens."""
        with torch.no_grad():
            for name, parameter in self.model.named_parameters():
                parameter.copy_(theta[name])
        loss = evaluate(self.model, self.batches, self.loss_fn)
        log.info("version %d: held-out loss %.4f", version, loss)
        return Evaluation(version=version, loss=loss, tokens=tokens, time=time.time())
