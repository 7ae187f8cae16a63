"""A learner's checkpoint restores parameters, AdamW state, fragments and data position."""

import pytest
import torch

from diloco_cli.codec import CorruptPayload
from diloco_cli.core.fragments import fragments_of_model
from diloco_cli.data.learner import generator_state, restore_generator
from diloco_cli.models.gpt import byte_gpt
from diloco_cli.runtime.distributed import (
    ProcessGroup,
    full_optimizer_state,
    full_parameters,
    install_parameters,
    load_full_optimizer_state,
)
from diloco_cli.runtime.learner.checkpoints import decode_checkpoint, encode_checkpoint
from diloco_cli.runtime.learner.fragments import LearnerFragments
from diloco_cli.store.home import tokens_merged
from diloco_cli.store.region import SEQUENCE_PER_EPOCH
from diloco_cli.training.inner import inner_step, make_inner_optimizer

ONE_PROCESS = ProcessGroup()


def learner(seed):
    torch.manual_seed(seed)
    model = byte_gpt(num_layers=1, width=32, num_heads=2, context=16)
    fragments = LearnerFragments(fragments_of_model(model, 2), {name: p.shape for name, p in model.named_parameters()})
    return model, make_inner_optimizer(model, 1e-2, 0.1, (0.9, 0.95)), fragments


def checkpoint_of(model, optimizer, fragments, secret, meta):
    names = [name for name, _ in model.named_parameters()]
    parameters = full_parameters(model, names, ONE_PROCESS)
    return encode_checkpoint(parameters, full_optimizer_state(model, optimizer, ONE_PROCESS), fragments, secret, meta)


def test_a_restored_learner_continues_exactly_like_the_original(secret):
    model, optimizer, fragments = learner(0)
    generator = torch.Generator().manual_seed(5)
    for _ in range(3):
        tokens = torch.randint(0, 256, (4, 17), generator=generator)
        inner_step(model, optimizer, tokens[:, :-1], tokens[:, 1:], 1e-2)
        fragments.count_step(64)
    fragments.install(0, 7)
    fragments.residual["blocks.0.mlp.0.weight"].fill_(0.25)
    payload = checkpoint_of(model, optimizer, fragments, secret, {"step": 3, "data": generator_state(generator)})

    other_model, other_optimizer, other_fragments = learner(1)
    checkpoint = decode_checkpoint(payload, other_fragments, secret)
    names = [name for name, _ in other_model.named_parameters()]
    install_parameters(other_model, checkpoint.parameters, names, ONE_PROCESS)
    load_full_optimizer_state(other_model, other_optimizer, checkpoint.optimizer_state, ONE_PROCESS)
    meta = checkpoint.meta
    other_generator = torch.Generator()
    restore_generator(other_generator, meta["data"])
    assert meta["step"] == 3 and other_fragments.base_version == fragments.base_version
    assert other_fragments.c_steps == fragments.c_steps and other_fragments.c_tokens == fragments.c_tokens
    assert torch.equal(other_fragments.residual["blocks.0.mlp.0.weight"], fragments.residual["blocks.0.mlp.0.weight"])
    # one more step on each gives bit-identical parameters: AdamW state and data position came back
    for m, o, g in ((model, optimizer, generator), (other_model, other_optimizer, other_generator)):
        tokens = torch.randint(0, 256, (4, 17), generator=g)
        inner_step(m, o, tokens[:, :-1], tokens[:, 1:], 1e-2)
    for (name, a), (_, b) in zip(model.named_parameters(), other_model.named_parameters()):
        assert torch.equal(a, b), name


def test_a_damaged_checkpoint_is_refused(secret):
    model, optimizer, fragments = learner(0)
    payload = bytearray(checkpoint_of(model, optimizer, fragments, secret, {"step": 0, "data": ""}))
    payload[100] ^= 1
    with pytest.raises(CorruptPayload):
        decode_checkpoint(bytes(payload), learner(1)[2], secret)


def _scalar_fragments(keep_unsent):
    from diloco_cli.core.fragments import Fragment

    fragment = Fragment(index=0, parameter_names=("w",), num_bytes=4, mean_names=frozenset())
    return LearnerFragments((fragment,), {"w": torch.Size([1])}, keep_unsent=keep_unsent)


def _sent_delta(fragments, theta, secret):
    from diloco_cli.codec import CodecSpec, decode_payload

    payload = fragments.encode_delta(0, {"w": torch.tensor([theta])}, CodecSpec(codec="fp32", zstd_level=0), secret, {})
    return decode_payload(payload, secret).tensors["w"].item()


def test_keep_unsent_installs_carry_exactly_the_work_not_sent_yet(secret):
    """Hand-computed: base 0; train to 1 (2 steps) and send (delta -1); train to 3 (1 step);
    version 1 = 10 arrives: theta = 10 + (3 - 1) = 12 with 1 step unsent; version 2 = 20
    arrives before any send: theta = 20 + (12 - 10) = 22; the next send is the 2 unsent
    units (delta -2) with 1 step and 8 tokens; a checkpoint keeps the origin."""
    fragments = _scalar_fragments(keep_unsent=True)
    fragments.install(0, 0, {"w": torch.tensor([0.0])})
    for _ in range(2):
        fragments.count_step(8)
    assert _sent_delta(fragments, 1.0, secret) == -1.0
    fragments.count_step(8)
    assert fragments.install(0, 1, {"w": torch.tensor([10.0])}) is True
    theta = fragments.with_unsent(["w"], {"w": torch.tensor([3.0])})["w"].item()
    assert theta == 12.0 and (fragments.c_steps[0], fragments.c_tokens[0]) == (1, 8)
    assert fragments.install(0, 2, {"w": torch.tensor([20.0])}) is True
    theta = fragments.with_unsent(["w"], {"w": torch.tensor([theta])})["w"].item()
    assert theta == 22.0 and (fragments.c_steps[0], fragments.c_tokens[0]) == (1, 8)
    assert _sent_delta(fragments, theta, secret) == -2.0 and fragments.tokens_overwritten[0] == 0
    restored = _scalar_fragments(keep_unsent=True)
    restored.load_state(fragments.state_tensors(), fragments.state_meta())
    assert restored.origin["w"].item() == 22.0 and restored.sent_steps[0] == 1


def test_overwrite_installs_and_resyncs_drop_the_unsent_work_and_count_it(secret):
    for fragments, keep in ((_scalar_fragments(keep_unsent=False), None), (_scalar_fragments(keep_unsent=True), False)):
        fragments.install(0, 0, {"w": torch.tensor([0.0])})
        fragments.count_step(8)
        _sent_delta(fragments, 1.0, secret)
        fragments.count_step(8)
        assert fragments.install(0, 1, {"w": torch.tensor([10.0])}, keep_unsent=keep) is False
        assert (fragments.c_steps[0], fragments.c_tokens[0], fragments.tokens_overwritten[0]) == (0, 0, 8)
        assert _sent_delta(fragments, 10.0, secret) == 0.0  # theta is the base again


def test_a_learner_stopped_between_checkpoints_checkpoints_where_it_stands_and_resumes_there(tmp_path, secret):
    """``diloco down`` (SIGTERM's handler raises a flag) at step 13 of a learner that
    checkpoints every 10: the flag is taken in at the next step boundary, and the learner
    writes a checkpoint of step 14 (its weights, AdamW state, residuals and what it sent)
    before it exits; a restart resumes from exactly that."""
    from diloco_cli.runtime.learner.sync import EXIT_STOPPED
    from tests.support.harness import Harness

    harness = Harness(tmp_path, secret, checkpoint_every=10)
    restarted = None
    try:
        stopped = harness.learners[0]
        harness.train(stopped, 13)
        stopped.request_stop()
        assert not stopped.leaving  # a signal between two steps: taken in after the next one
        harness.train(stopped, 1)
        assert stopped.stop_requested and stopped.leaving
        assert stopped.finish() == EXIT_STOPPED
        keys = harness.bucket.checkpoint_keys("east-0")
        assert [key.rsplit("/", 1)[1] for key in keys] == ["0000000010.dlc", "0000000014.dlc"]
        restarted = harness.learner("east-0")
        assert restarted.step == 14
        for counter in ("base_version", "c_steps", "c_tokens", "sent_steps", "sent_tokens"):
            assert getattr(restarted.fragments, counter) == getattr(stopped.fragments, counter), counter
        for name, residual in stopped.fragments.residual.items():
            assert torch.equal(restarted.fragments.residual[name], residual), name
        for name, parameter in stopped.model.named_parameters():
            assert torch.equal(dict(restarted.model.named_parameters())[name], parameter), name
        before = full_optimizer_state(stopped.model, stopped.optimizer, ONE_PROCESS)
        after = full_optimizer_state(restarted.model, restarted.optimizer, ONE_PROCESS)
        for name, state in before.items():
            assert float(after[name]["step"]) == float(state["step"]) == 14
            assert torch.equal(after[name]["exp_avg"], state["exp_avg"]), name
    finally:
        if restarted is not None:
            restarted.close()
        harness.close()


def test_your_own_loop_stopped_by_sigterm_checkpoints_where_it_stands(tmp_path, secret):
    """``join``'s loop (the Hugging Face callback's too) stopped by a real SIGTERM at
    step 13: ``run.stop_requested`` turns true after step 14, leaving the block writes a
    checkpoint of step 14 and exits 143 (stopped)."""
    import os
    import signal

    from diloco_cli.runtime.learner.own_loop import JoinedRun
    from tests.support.harness import Harness

    harness = Harness(tmp_path, secret, checkpoint_every=10)
    try:
        harness.learners.pop().close()
        sync = harness.learner("east-1", start=False)
        harness.learners.append(sync)
        run = JoinedRun(sync, sync.optimizer, step_hook=False, handle_signals=True)
        with pytest.raises(SystemExit) as exit_code, run:
            for step in range(run.step, run.total_steps):
                sync.loop.train_step()  # the inner step and the learner's duties (its after_step)
                if step + 1 == 13:
                    os.kill(os.getpid(), signal.SIGTERM)
                if run.stop_requested:
                    break
        assert exit_code.value.code == 143 and sync.step == 14
        keys = harness.bucket.checkpoint_keys("east-1")
        assert [key.rsplit("/", 1)[1] for key in keys] == ["0000000010.dlc", "0000000014.dlc"]
    finally:
        harness.close()


def test_a_learner_killed_before_its_first_checkpoint_retrains_what_its_superseded_sends_held(harness):
    """east-0 sends both fragments from version 0 and is killed before any checkpoint.
    Restarted, it resumes at step 0 from the newest global (version 0 still: nothing was
    merged), on the same data, and its next sends from version 0 supersede the first
    start's: those held the same steps, trained again, so the merge loses nothing of
    what the learner now counts, and nothing is merged twice."""
    killed, other = harness.learners
    harness.train(killed, 10)
    first_sends = {key for key in harness.bucket.store.list_marked("payloads/east-0")}
    assert len(first_sends) == 2 and killed.step == 10
    killed.close()  # killed: its uploads stop, no checkpoint was ever written
    restarted = harness.learner("east-0")
    harness.learners[0] = restarted
    assert restarted.step == 0 and set(restarted.fragments.base_version.values()) == {0}
    assert restarted.sends.epoch > killed.sends.epoch
    harness.train(restarted, 10)
    harness.train(other, 10)
    harness.merge()
    history = harness.syncer.home.history()
    merged = [(commit.fragment, m) for commit in history for m in commit.merged if m.learner == "east-0"]
    assert sorted(fragment for fragment, _ in merged) == [0, 1]  # one send per fragment merged
    assert all(m.sequence // SEQUENCE_PER_EPOCH == restarted.sends.epoch for _, m in merged)  # the restart's
    restarted.heartbeats.beat(wait=10)
    beat = harness.bucket.read_heartbeat("east-0")
    assert beat.tokens == 10 * restarted.tokens_per_step  # the killed start's steps are not counted twice
    for fragment in (0, 1):
        accounted = tokens_merged(history, "east-0", fragment) + beat.tokens_overwritten.get(fragment, 0)
        unsent = restarted.fragments.c_tokens[fragment] - restarted.fragments.sent_tokens[fragment]
        assert accounted == beat.tokens - unsent, fragment
