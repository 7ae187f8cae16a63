"""A real syncer and real learners in the test's own process over a file:// bucket,
advanced step by step, so a test can tamper with the bucket (or the storage calls)
between their steps.  Tests get one through the ``harness`` fixture (tests/conftest.py).
The region's reducer stands between them (``harness.reducer``), as in every run: under
the harness's K=1 of 2 it relays each send, under ``quorum=2`` it forwards aggregates.  With
``shards=N`` the run has N syncer shards (``harness.syncers``, and the region's reducer of
each, ``harness.reducers``); ``harness.syncer`` is shard 0.  ``chaos`` gives the run a chaos plan
(``--chaos`` text: ``slow-learner=east-0:0.5``, ``keep-payloads``).
"""

import time

import torch

from diloco_cli.config.chaos import parse_chaos
from diloco_cli.config.recipe import Recipe
from diloco_cli.config.regions import RegionsFile
from diloco_cli.launch.resolve import resolve_run, with_chaos
from diloco_cli.runtime.learner.loop import Learner
from diloco_cli.runtime.reducer.loop import Reducer
from diloco_cli.runtime.syncer.loop import Syncer
from tests.support.runs import TINY_RECIPE, deep_update


class Harness:
    """A syncer and two learners of one region, advanced by hand."""

    def __init__(
        self,
        tmp_path,
        secret,
        checkpoint_every=1000,
        bucket=None,
        storage_options=None,
        shards=1,
        chaos=None,
        started=("east-0", "east-1"),
        **sync,
    ):
        """``bucket`` (a URL, file:// in ``tmp_path`` by default) and its storage options;
        ``chaos`` the run's chaos plan (``--chaos`` text); ``started`` the learners made
        and started at once (``harness.learners``); ``sync`` changes the recipe's sync
        section."""
        changes = {
            "training": {"num_learners": 2, "checkpoint_every_steps": checkpoint_every},
            "sync": {
                "quorum": 1,
                "snapshot_every": 3,
                "window_versions": 8,
                "evaluate_every": 2,
                "shards": shards,
                "forward_window_seconds": 0.0,
                "pace": "steps",  # sends at fixed steps: the tests install by hand, when they say
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
        if chaos is not None:
            self.spec = with_chaos(self.spec, parse_chaos(chaos))
        self.secret = secret
        self.syncers = [Syncer(self.spec, secret, syncer_shard=shard) for shard in range(shards)]
        for syncer in self.syncers:
            syncer.start()
        self.reducers = [Reducer(self.spec, "east", secret, syncer_shard=shard) for shard in range(shards)]
        for reducer in self.reducers:
            reducer.start()
            reducer.turn()  # version 0 of the region, built from the seed
        self.bucket = self.spec.bucket("east", secret)
        self.learners = [self.learner(name) for name in started]

    def learner(self, name, start=True):
        """A learner's sync side, with the built-in loop behind it as ``.loop``; it polls
        only when a test says so (:meth:`poll`)."""
        loop = Learner(self.spec, name, self.secret)
        loop.setup()
        loop.sync.loop = loop
        loop.sync.poller.poll_seconds = loop.sync.poller.awaiting_seconds = float("inf")
        if start:
            loop.sync.start()
        return loop.sync

    def train(self, learner, steps):
        """Inner steps with the sends that fall due, delivered."""
        for _ in range(steps):
            learner.loop.train_step()
        assert learner.sends.outbox.wait_empty(10)

    @property
    def syncer(self):
        """The syncer (shard 0 of several)."""
        return self.syncers[0]

    @property
    def reducer(self):
        """The region's reducer (of shard 0)."""
        return self.reducers[0]

    @reducer.setter
    def reducer(self, reducer):
        self.reducers[0] = reducer

    def merge(self):
        """Turns (the reducers', then the syncers') until nothing is left to merge, each
        when a syncer asks to be woken (a grace window may be running)."""
        for _ in range(20):
            for reducer in self.reducers:
                reducer.turn(read_heartbeats=True)
            wake = min(syncer.turn() for syncer in self.syncers)
            for reducer in self.reducers:
                reducer.turn()  # takes in what was merged (deletes it, or forwards it again)
            rounds = [r for syncer in self.syncers for r in syncer.decisions.rounds.values()]
            holding = any(reducer.waiting or reducer.in_flight for reducer in self.reducers)
            observed = [key for syncer in self.syncers for key in syncer.observer.observed]
            if not observed and not any(r.pending or r.merging for r in rounds) and not holding:
                return
            time.sleep(min(1.0, max(0.0, wake - self.syncer.clock())))
        raise AssertionError(f"the syncers did not merge everything they observed: {sorted(observed)}")

    def syncer_of(self, fragment):
        """The syncer (shard) that syncs ``fragment``."""
        return self.syncers[fragment % len(self.syncers)]

    def poll(self, learner):
        """One poll, installed: the fragments installed."""
        return learner.poll_now()

    def assert_bases_equal_the_syncers(self, learner):
        for fragment, version in learner.fragments.base_version.items():
            state = self.syncer_of(fragment).state
            assert version == state.fragment_versions[fragment], (fragment, version)
            for name in learner.fragments.names(fragment):
                assert torch.equal(learner.fragments.base[name], state.theta[name]), name

    def close(self):
        for learner in self.learners:
            learner.close()
