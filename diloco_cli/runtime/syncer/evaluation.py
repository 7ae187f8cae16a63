"""The held-out loss of the global weights, every ``sync.evaluate_every`` versions.

The syncer builds the recipe's model once, on the CPU, and evaluates a version by
copying the global weights into it and taking the mean loss (the recipe's
``training.loss``) over fixed held-out batches.  Each evaluation is labelled with the
version it is of and the tokens the learners had trained then.

With syncer shards, shard 0 evaluates (every ``evaluate_every`` of its versions) the
whole model: its own fragments, and the other shards' as they published them last,
read from a region's bucket and checked against their heads
(:class:`~diloco_cli.runtime.global_weights.GlobalCopy`).  When those cannot be read
now, the version is not evaluated (a warning says why) rather than evaluated half stale;
the final evaluation waits until every other shard has finished.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

import torch

from diloco_cli.codec import PayloadError
from diloco_cli.config.recipe import Recipe
from diloco_cli.core.types import Version
from diloco_cli.data.learner import heldout_batches
from diloco_cli.runtime.global_weights import GlobalCopy
from diloco_cli.store.documents import Evaluation
from diloco_cli.store.filesystem import StorageError
from diloco_cli.training.inner import evaluate, resolve_loss

log = logging.getLogger("diloco.syncer")


class Evaluator:
    """The recipe's model and held-out batches, kept for evaluating global versions.
    ``others``: the other syncer shards' fragments (shard 0 of several); ``enabled``:
    False for the other shards, which never evaluate."""

    def __init__(
        self, recipe: Recipe, model: torch.nn.Module, others: GlobalCopy | None = None, enabled: bool = True
    ) -> None:
        self.every = recipe.sync.evaluate_every
        self.model = model
        self.enabled = enabled
        self.others = others
        self.batches = heldout_batches(recipe) if enabled else []
        self.loss_fn = resolve_loss(recipe.training.loss)

    def due(self, version: Version) -> bool:
        return self.enabled and version % self.every == 0

    def evaluate(
        self, theta: Mapping[str, torch.Tensor], version: Version, tokens: int, whole: bool = False
    ) -> Evaluation | None:
        """The held-out loss of ``theta`` (the weights of ``version``), when learners had
        trained ``tokens`` tokens; with other syncer shards, of ``theta`` with their
        fragments as they published them last (``whole``: ``theta`` is the whole model
        already, version 0).  None when those cannot be read now."""
        if self.others is not None and not whole:
            try:
                self.others.refresh()
            except (PayloadError, FileNotFoundError, StorageError) as error:
                log.warning(
                    "version %d not evaluated: the other syncer shards' weights cannot be read (%s)", version, error
                )
                return None
            theta = {**theta, **self.others.theta}
        with torch.no_grad():
            for name, parameter in self.model.named_parameters():
                parameter.copy_(theta[name])
        loss = evaluate(self.model, self.batches, self.loss_fn)
        log.info("version %d: held-out loss %.4f", version, loss)
        return Evaluation(version=version, loss=loss, tokens=tokens, time=time.time())

    def others_finished(self) -> bool:
        """Whether every other syncer shard has finished and the copy holds its final
        weights (always, without other shards)."""
        if self.others is None:
            return True
        try:
            return all(head.finished for head in self.others.refresh())
        except (PayloadError, FileNotFoundError, StorageError) as error:
            log.info("the other syncer shards' final weights cannot be read yet (%s)", error)
            return False
