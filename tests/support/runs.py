"""Helpers for tests that start real runs: the CLI as a subprocess, tiny recipes, waiting,
and the audits every run ends with (the ledger, the bases, every token)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from diloco_cli.codec import decode_payload
from diloco_cli.codec.exact import fragment_digest
from diloco_cli.config.loading import deep_merged
from diloco_cli.core.fragments import fragments_of_model
from diloco_cli.launch.processes import group_members
from diloco_cli.launch.runs import load_run
from diloco_cli.store.home import tokens_merged, tokens_unanchored
from diloco_cli.store.region import PAYLOAD_KEY
from diloco_cli.views.run_state import RunStatus, collect_status

TINY_RECIPE: dict[str, Any] = {
    "name": "tiny",
    "model": {"kwargs": {"num_layers": 2, "width": 64, "num_heads": 2, "context": 64}},
    "data": {"sequence_length": 64},
    "training": {
        "num_learners": 2,
        "batch_size": 8,
        "inner_steps": 40,
        "warmup_steps": 5,
        "heartbeat_seconds": 0.5,
        "poll_seconds": 0.3,
        "checkpoint_every_steps": 15,
    },
    "sync": {
        "sync_interval": 10,
        "num_fragments": 2,
        "snapshot_every": 3,
        "evaluate_every": 2,
        "evaluation_batches": 2,
        "poll_seconds": 0.2,
        "liveness_timeout_seconds": 20,
    },
}


deep_update = deep_merged
"""A recipe or region document with some of its keys changed (nested dicts merged)."""


def write_yaml(path: Path, document: dict) -> Path:
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def diloco(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 180, check: bool = True
) -> subprocess.CompletedProcess:
    """Run the CLI as a user would, in its own process."""
    result = subprocess.run(
        [sys.executable, "-m", "diloco_cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        timeout=timeout,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"diloco {' '.join(args)} exited {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
        )
    return result


def logs_of(runs_dir: Path, run: str) -> str:
    record = load_run(runs_dir, run)
    parts = []
    for path in sorted((record.directory / "logs").glob("*.log")):
        parts.append(f"===== {path.name}\n{path.read_text()[-4000:]}")
    return "\n".join(parts)


def wait_for(runs_dir: Path, run: str, predicate, timeout: float, what: str) -> RunStatus:
    spec = load_run(runs_dir, run).spec
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = collect_status(spec)
        if predicate(status):
            return status
        time.sleep(0.5)
    raise AssertionError(f"run {run}: {what} did not happen within {timeout:.0f} s\n{logs_of(runs_dir, run)}")


def wait_finished(runs_dir: Path, run: str, timeout: float = 300) -> RunStatus:
    return wait_for(runs_dir, run, lambda s: s.state == "finished", timeout, "finishing")


def run_processes_gone(runs_dir: Path, run: str) -> list[int]:
    """Pids still alive in any process group of the run (should be empty)."""
    record = load_run(runs_dir, run)
    return [pid for process in record.processes for pid in group_members(process["pid"])]


def wait_processes_gone(runs_dir: Path, run: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not run_processes_gone(runs_dir, run):
            return
        time.sleep(0.2)
    raise AssertionError(f"processes of {run} still alive: {run_processes_gone(runs_dir, run)}")


def child_pid(runs_dir: Path, run: str, process: str) -> int:
    """The pid of the supervised child (the learner or syncer itself)."""
    state = load_run(runs_dir, run).process_state(process) or {}
    return int(state["child_pid"])


def interrupted_output(arguments: list[str], cwd: Path, timeout: float = 120) -> str:
    """Run ``diloco ARGUMENTS`` that runs until Ctrl-C (``logs --follow``): once it has
    printed its first line (so it is past start-up), send SIGINT; return all it printed.
    It must stop by itself after the interrupt."""
    # as from a terminal: a shell starts background jobs (CI under ``&``) with SIGINT
    # ignored, which Python would inherit and keep
    restore_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    process = subprocess.Popen(
        [sys.executable, "-m", "diloco_cli", *arguments],
        cwd=cwd,
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=restore_sigint,
    )
    try:
        # wait for output without reading it: communicate() reads the pipe itself
        ready, _, _ = select.select([process.stdout], [], [], timeout)
        assert ready, f"diloco {' '.join(arguments)} printed nothing in {timeout} s"
        time.sleep(2)  # a follow loop turn or two
        process.send_signal(signal.SIGINT)
        return process.communicate(timeout=30)[0]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def final_checkpoint(bucket, learner, secret):
    keys = bucket.checkpoint_keys(learner)
    return decode_payload(bucket.read_checkpoint(keys[-1]), secret)


def histories(spec, secret):
    """Every syncer shard's commit records (one list with a single syncer), in shard order."""
    return [home.history() for home in spec.homes(secret)]


def assert_bases_are_the_syncers(runs_dir, name, learners=None):
    """Each learner's (of ``learners``, default every one) final bases equal the committed
    weights, at those versions, of the syncer (shard) that syncs each fragment."""
    record = load_run(runs_dir, name)
    secret = record.secret()
    homes = record.spec.homes(secret)
    history = [{r.version: r for r in home.history()} for home in homes]
    fragments = fragments_of_model(record.spec.recipe.model.build(), record.spec.recipe.sync.num_fragments)
    initial = decode_payload(homes[0].read_initial(), secret).tensors
    for learner in record.spec.learners:
        if learners is not None and learner.id not in learners:
            continue
        checkpoint = final_checkpoint(record.spec.bucket(learner.region, secret), learner.id, secret)
        bases = {name.removeprefix("base/"): t for name, t in checkpoint.tensors.items() if name.startswith("base/")}
        for fragment, version in checkpoint.meta["fragments"]["base_version"].items():
            names = fragments[int(fragment)].parameter_names
            commits = history[int(fragment) % len(homes)]
            if int(version) == 0:
                expected = fragment_digest(initial, names)
            else:
                assert commits[int(version)].fragment == int(fragment)
                expected = commits[int(version)].digest
            assert fragment_digest(bases, names) == expected, (learner.id, fragment, version)


def heartbeats(runs_dir, name):
    record = load_run(runs_dir, name)
    return {
        learner.id: record.spec.bucket(learner.region, record.secret()).read_heartbeat(learner.id)
        for learner in record.spec.learners
    }


def assert_every_token_accounted(runs_dir: Path, name: str, beats: dict) -> None:
    """Every token each (finished) learner trained is in a merged payload, in a send
    refused because its base could not be anchored (the ledger counts both) or was overwritten by an install
    (counted in its heartbeat), per fragment."""
    record = load_run(runs_dir, name)
    history = [commit for shard in histories(record.spec, record.secret()) for commit in shard]
    for learner, beat in beats.items():
        assert beat.state.value == "finished" and beat.unsent == 0
        for fragment in range(record.spec.recipe.sync.num_fragments):
            accounted = (
                tokens_merged(history, learner, fragment)
                + tokens_unanchored(history, learner, fragment)
                + beat.tokens_overwritten.get(fragment, 0)
            )
            assert accounted == beat.tokens, (learner, fragment, accounted, beat.tokens)


def audit_ledger(run_dir: Path, secret):
    """Every arrival merged at most once; every payload sent merged or superseded by a
    newer merged one of the same learner and fragment; each learner's last send merged."""
    record = load_run(run_dir.parent, run_dir.name)
    shards = histories(record.spec, secret)
    for shard in shards:  # each syncer shard numbers its own versions
        assert [c.version for c in shard] == list(range(1, len(shard) + 1))
    commits = [commit for shard in shards for commit in shard]
    merged = [m.key for c in commits for m in c.merged]
    retired = [r.key for c in commits for r in c.retired]
    assert len(merged) == len(set(merged)), "an arrival was merged twice"
    assert not set(merged) & set(retired)
    assert len(retired) == len(set(retired))
    newest_merged: dict[tuple[str, int], int] = {}
    for key in merged:
        match = PAYLOAD_KEY.match(key.split(":", 1)[1])
        slot = (match["learner"], int(match["fragment"]))
        newest_merged[slot] = max(newest_merged.get(slot, -1), int(match["sequence"]))
    sent: dict[tuple[str, int], list[int]] = {}
    for bucket in record.spec.buckets(secret):
        for key in bucket.payload_keys():  # nothing was deleted: the run keeps its payloads (--chaos keep-payloads)
            match = PAYLOAD_KEY.match(key)
            sent.setdefault((match["learner"], int(match["fragment"])), []).append(int(match["sequence"]))
    assert sent, "no payloads were sent"
    for slot, sequences in sent.items():
        assert slot in newest_merged, f"nothing of {slot} was ever merged"
        assert max(sequences) == newest_merged[slot], f"the last send of {slot} was lost"
        for sequence in sequences:
            assert sequence <= newest_merged[slot]
    return commits, merged
