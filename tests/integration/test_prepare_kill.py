"""``diloco prepare`` killed at random points (SIGKILL, SIGTERM) and run again: every shard
the killed run had finished and recorded is kept, never tokenized twice, and the dataset
that comes out is the corpus, document by document."""

import random
import signal
import subprocess
import sys
import time

import pytest

from diloco_cli.data.tokens.shards import read_progress
from tests.support.corpora import check_dataset, make_documents, write_text_corpus

KEPT = "(kept from an earlier run)"


def start(command: list[str], log) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "diloco_cli", *command], stdout=subprocess.DEVNULL, stderr=log, stdin=subprocess.DEVNULL
    )


def recorded_shards(output) -> list[str]:
    try:
        record = read_progress(output)
    except Exception:  # being replaced this instant: look again
        return []
    return [] if record is None else [shard.name for shard in record.train]


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_prepare_killed_at_random_points_keeps_every_finished_shard(tmp_path, signum):
    rng = random.Random(int(signum))
    documents = make_documents(12000, seed=5)
    corpus = write_text_corpus(tmp_path / "corpus.txt", documents)
    output = tmp_path / "out"
    command = ["prepare", str(corpus), "-o", str(output), "--vocab-size", "300", "--shard-tokens", "1000"]
    finished_at_kill: list[str] = []
    for attempt in range(3):
        log_path = tmp_path / f"attempt-{attempt}.log"
        with open(log_path, "wb") as log:
            process = start(command, log)
            target = len(finished_at_kill) + rng.randint(2, 6)
            deadline = time.monotonic() + 120
            while len(recorded_shards(output)) < target:
                assert process.poll() is None, log_path.read_text()
                assert time.monotonic() < deadline, "prepare made no shard in two minutes"
                time.sleep(0.005)
            time.sleep(rng.uniform(0, 0.05))  # somewhere inside the next shard
            process.send_signal(signum)
            process.wait()
        kept = log_path.read_text().count(KEPT)
        assert kept == len(finished_at_kill), f"attempt {attempt} kept {kept} of {len(finished_at_kill)} shards"
        finished_at_kill = recorded_shards(output)
        assert not (output / "index.json").exists()

    result = subprocess.run(
        [sys.executable, "-m", "diloco_cli", *command], capture_output=True, text=True, timeout=300, check=True
    )
    assert f"{len(finished_at_kill)} kept from an earlier run" in result.stdout, result.stdout
    assert result.stderr.count(KEPT) == len(finished_at_kill)
    check_dataset(output, documents)
