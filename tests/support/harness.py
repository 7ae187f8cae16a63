"""A real syncer and real learners in the test's own process over a file:// bucket,
advanced step by step, so a test can tamper with the bucket (or the storage calls)
between their steps.  Tests get one through the ``harness`` fixture (tests/conftest.py):
the syncer reads the payloads itself; ``Harness(..., reducers=True)`` puts the region's
reducer between them (``harness.reducer``), as runs do by default.
"""

import time

import torch

from diloco_cli.config.recipe import Recipe
from diloco_cli.config.regions import RegionsFile
from diloco_cli.launch.resolve import resolve_run
from diloco_cli.runtime.learner.loop import Learner
from diloco_cli.runtime.reducer.loop import Reducer
from diloco_cli.runtime.syncer.loop import Syncer
from tests.support.runs import TINY_RECIPE, deep_update


class Harness:
    """A syncer and two learners of one region, advanced by hand."""

    def __init__(
        self, tmp_path, secret, checkpoint_every=1000, bucket=None, storage_options=None, reducers=False, **sync
    ):
        """``bucket`` (a URL, file:// in ``tmp_path`` by default) and its storage options;
        ``sync`` changes the recipe's sync section."""
        changes = {
            "training": {"num_learners": 2, "checkpoint_every_steps": checkpoint_every},
            "sync": {
                "quorum": 1,
                "snapshot_every": 3,
                "window_versions": 8,
                "evaluate_every": 2,
                "reducers": reducers,
                "forward_window_seconds": 0.0,
                **sync,
            },
        }
        recipe = Recipe.model_validate(deep_update(TINY_RECIPE, changes))
        region = {
            "name": "east",
            "bucket": bucket or f"file://{tmp_path}/east",
            "storage_options": storage_options or {},
            "hosts": [{"learners": 2}],
        }
        self.spec = resolve_run(recipe, RegionsFile.model_validate({"regions": [region]}), "tampered", tmp_path)
        self.secret = secret
        self.syncer = Syncer(self.spec, secret)
        self.syncer.start()
        self.reducer = Reducer(self.spec, "east", secret) if reducers else None
        if self.reducer is not None:
            self.reducer.start()
            self.reducer.turn()  # version 0 of the region, built from the seed
        self.bucket = self.spec.bucket("east", secret)
        self.learners = [self.learner(name) for name in ("east-0", "east-1")]

    def learner(self, name, start=True):
        """A learner's sync side, with the built-in loop behind it as ``.loop``; it polls
        only when a test says so (:meth:`poll`)."""
        loop = Learner(self.spec, name, self.secret)
        loop.setup()
        loop.sync.loop = loop
        loop.sync.poller.poll_seconds = float("inf")
        if start:
            loop.sync.start()
        return loop.sync

    def train(self, learner, steps):
        """Inner steps with the sends that fall due, delivered."""
        for _ in range(steps):
            learner.loop.train_step()
        assert learner.sends.outbox.wait_empty(10)

    def merge(self):
        """Turns (the reducer's, then the syncer's) until nothing is left to merge, each
        when the syncer asks to be woken (a grace window may be running)."""
        syncer, reducer = self.syncer, self.reducer
        for _ in range(20):
            if reducer is not None:
                reducer.turn(read_heartbeats=True)
            wake = syncer.turn()
            if reducer is not None:
                reducer.turn()  # takes in what was merged (deletes it, or forwards it again)
            rounds = syncer.decisions.rounds.values()
            holding = reducer is not None and (reducer.waiting or reducer.in_flight)
            if not syncer.observer.observed and not any(r.pending or r.merging for r in rounds) and not holding:
                return
            time.sleep(min(1.0, max(0.0, wake - syncer.clock())))
        raise AssertionError(f"the syncer did not merge everything it observed: {sorted(syncer.observer.observed)}")

    def poll(self, learner):
        """One poll, installed: the fragments installed."""
        return learner.poll_now()

    def assert_bases_equal_the_syncers(self, learner):
        theta = self.syncer.state.theta
        for fragment, version in learner.fragments.base_version.items():
            assert version == self.syncer.state.fragment_versions[fragment], (fragment, version)
            for name in learner.fragments.names(fragment):
                assert torch.equal(learner.fragments.base[name], theta[name]), name

    def close(self):
        for learner in self.learners:
            learner.close()
