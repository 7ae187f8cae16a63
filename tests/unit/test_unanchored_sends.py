"""A send too stale to anchor (its base older than the window of W updates the syncer
keeps) is not merged: its learner is told to resync.  Its tokens are neither merged nor
overwritten by an install, so the ledger counts them as refused, and every token a
learner trained stays accounted for.  Driven step by step (tests/support/harness.py)."""

from diloco_cli.store.home import tokens_merged, tokens_unanchored


def test_a_send_too_stale_to_anchor_is_refused_counted_in_the_ledger_and_its_learner_resyncs(harness):
    stale, ahead = harness.learners
    harness.train(stale, 10)
    harness.train(ahead, 10)
    harness.merge()
    for learner in harness.learners:
        harness.poll(learner)
    window = harness.spec.recipe.sync.window_versions
    for _ in range(window + 1):  # every fragment's head moves past the stale learner's bases
        harness.train(ahead, 10)
        harness.merge()
        harness.poll(ahead)
    bases = dict(stale.fragments.base_version)
    harness.train(stale, 10)  # sends from bases W versions behind
    harness.merge()
    installed = harness.poll(stale)  # the resync: each fragment reinstalled, its unsent work overwritten
    assert set(installed) == set(bases) and not any(installed.values())
    harness.assert_bases_equal_the_syncers(stale)
    harness.train(stale, 10)  # and it goes on from the newest global, merged again
    harness.merge()
    history = harness.syncer.home.history()  # the commits after the refusal list it
    refused = [r for commit in history for r in commit.unanchored]
    assert {r.fragment for r in refused} == set(bases) and all(r.learner == stale.me.id for r in refused)
    assert all(r.base_version == bases[r.fragment] and r.c_tokens > 0 for r in refused)
    assert {r.key for r in refused} <= {r.key for commit in history for r in commit.retired}
    theirs = [(c.fragment, m.base_version) for c in history for m in c.merged if m.learner == stale.me.id]
    assert not any(base == bases[fragment] for fragment, base in theirs)  # nothing from the stale bases merged
    assert any(base > bases[fragment] for fragment, base in theirs)
    for learner in harness.learners:
        learner.heartbeats.beat(wait=10)
        beat = harness.bucket.read_heartbeat(learner.me.id)
        for fragment in bases:
            unsent = learner.fragments.c_tokens[fragment] - learner.fragments.sent_tokens[fragment]
            accounted = (
                tokens_merged(history, learner.me.id, fragment)
                + tokens_unanchored(history, learner.me.id, fragment)
                + beat.tokens_overwritten.get(fragment, 0)
            )
            assert accounted == beat.tokens - unsent, (learner.me.id, fragment)
    assert tokens_unanchored(history, stale.me.id, 0) == refused[0].c_tokens > 0
    assert tokens_unanchored(history, ahead.me.id, 0) == 0
