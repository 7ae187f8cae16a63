"""Benchmark: the syncer's restart time stays flat as its history grows.

A syncer's home store is grown commit by commit through the syncer's own path (a merge
round of one real int4 payload, its commit record, ledger checkpoints every 50 versions)
for a small model in 2 fragments, M=4 learners taking turns.  After 100, 1,000 and
10,000 commits (quick: 100, 300 and 1,000), and 49 commits after each (the most
records a restart replays after the newest ledger checkpoint), the syncer's state is
restored from the home store, 9 times; the median time and the storage requests of one
restore are reported, with each one's ratio to the first.

    python -m bench.ledger            # 100, 1,000, 10,000 commits
    python -m bench.ledger --quick    # 100, 300, 1,000 (the test suite)
"""

from __future__ import annotations

import statistics
import tempfile
import time

import torch

from bench._common import benchmark_parser, print_table, write_and_report
from diloco_cli.codec import Codec, CodecSpec, RunSecret, encode_payload
from diloco_cli.codec.exact import ExactPublisher
from diloco_cli.core.fragments import fragments_of_model
from diloco_cli.core.outer import NesterovOuterOptimizer
from diloco_cli.core.types import FragmentIndex, LearnerId, Version
from diloco_cli.models.gpt import byte_gpt
from diloco_cli.runtime.syncer.merge_round import RoundInput, merge_round
from diloco_cli.runtime.syncer.state import SyncerState, commit_merge, restore_state
from diloco_cli.store.documents import Evaluation
from diloco_cli.store.home import CommitRecord, MergedPayload, SyncerHome

LEARNERS = 4
WINDOW = 32
SNAPSHOT_EVERY = 20
EVALUATE_EVERY = 4
DELTA_SPEC = CodecSpec(codec=Codec.INT4)


class GrowingHome:
    """A syncer home store and the state it holds, grown one real commit at a time."""

    def __init__(self, root: str, secret: RunSecret, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.root, self.secret = root, secret
        self.model = byte_gpt(num_layers=1, width=32, num_heads=2, context=16)
        self.fragments = fragments_of_model(self.model, 2)
        self.generator = torch.Generator().manual_seed(seed)
        self.state = self.restore()[0]

    def restore(self) -> tuple[SyncerState, SyncerHome]:
        home = SyncerHome(self.root, None, self.secret)
        initial = {name: p.detach() for name, p in self.model.named_parameters()}
        state = restore_state(
            home,
            self.secret,
            self.fragments,
            initial,
            NesterovOuterOptimizer(1.0, 0.0),
            ExactPublisher(CodecSpec(codec=Codec.INT8), self.secret),
            WINDOW,
            lambda theta, version: Evaluation(version=version, loss=5.5, tokens=0, time=0.0),
        )
        return state, home

    def grow(self, commits: int) -> None:
        """Add ``commits`` versions, each one learner's delta merged into one fragment."""
        home = SyncerHome(self.root, None, self.secret)
        state = self.state
        for _ in range(commits):
            version = Version(state.version + 1)
            fragment = FragmentIndex(version % len(self.fragments))
            learner = LearnerId(f"m{version % LEARNERS}")
            base = state.fragment_versions[fragment]
            names = self.fragments[fragment].parameter_names
            delta = [(name, 1e-3 * torch.randn(state.theta[name].shape, generator=self.generator)) for name in names]
            payload = encode_payload(
                delta, DELTA_SPEC, self.secret, {"learner": learner, "fragment": fragment, "base_version": base}
            )
            arrival = RoundInput(learner, base, 10, 10_000, lambda p=payload: p)
            meta = {"previous_version": base}
            result = merge_round(
                fragment,
                version,
                [arrival],
                state.fragment_theta(fragment),
                state.windows[fragment],
                state.optimizer,
                state.publisher,
                self.secret,
                meta=meta,
            )
            if version - state.snapshot_version >= SNAPSHOT_EVERY:
                state.snapshot_version = version
            key = f"region:payloads/{learner}/{fragment:03d}-{version:012d}.dlc"
            record = CommitRecord(
                version=version,
                fragment=fragment,
                previous_version=base,
                merged=(
                    MergedPayload(
                        key=key, learner=learner, sequence=version, base_version=base, c_steps=10, c_tokens=10_000
                    ),
                ),
                retired=(),
                digest=state.digest(fragment),
                time=time.time(),
                seconds=0.0,
                merges=state.merges + 1,
                snapshot_version=state.snapshot_version,
                quorum_seconds=None,
                sync_seconds=None,
                evaluation=Evaluation(version=version, loss=2.0, tokens=version, time=0.0)
                if version % EVALUATE_EVERY == 0
                else None,
            )
            keep_after = Version(max(0, state.snapshot_version - SNAPSHOT_EVERY))
            commit_merge(home, state, self.secret, record, result.payload, keep_after)


def measure_restart(history: GrowingHome, repeats: int) -> dict:
    times, requests = [], 0
    for _ in range(repeats):
        started = time.perf_counter()
        _, home = history.restore()
        times.append(time.perf_counter() - started)
        requests = home.store.meter.snapshot().requests
    return {"restart_seconds": statistics.median(times), "requests": requests}


def main(argv: list[str] | None = None) -> dict:
    parser = benchmark_parser(__doc__, "100, 300 and 1,000 commits")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    bases = (100, 300, 1000) if args.quick else (100, 1000, 10_000)
    sizes = [size + extra for size in bases for extra in (0, 49)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="diloco-ledger-") as directory:
        history = GrowingHome(f"file://{directory}/home", RunSecret(bytes(range(32))))
        grown = 0
        for size in sizes:
            started = time.perf_counter()
            history.grow(size - grown)
            grown = size
            extra = size % 50
            row = {
                "commits": size,
                "since_checkpoint": extra,
                "grow_seconds": time.perf_counter() - started,
                **measure_restart(history, args.repeats),
            }
            rows.append(row)
            print(
                f"  {size} commits: restart {row['restart_seconds'] * 1000:.1f} ms, {row['requests']} requests",
                flush=True,
            )
    for row in rows:  # against the smallest history at the same place between checkpoints
        first = next(r for r in rows if r["since_checkpoint"] == row["since_checkpoint"])
        row["ratio_to_smallest"] = row["restart_seconds"] / first["restart_seconds"]
    largest = max(row["ratio_to_smallest"] for row in rows)
    same_requests = all(
        row["requests"] == next(r for r in rows if r["since_checkpoint"] == row["since_checkpoint"])["requests"]
        for row in rows
    )
    results = {
        "rows": rows,
        "largest_time_ratio": largest,
        "requests_independent_of_history": same_requests,
        "target": "the same requests at every size, time within 2x (milliseconds on a shared machine)",
        "met": same_requests and largest <= 2.0,
    }
    settings = {
        "sizes": list(sizes),
        "repeats": args.repeats,
        "learners": LEARNERS,
        "fragments": 2,
        "window": WINDOW,
        "snapshot_every": SNAPSHOT_EVERY,
    }
    print_table(rows, ["commits", "since_checkpoint", "restart_seconds", "requests", "ratio_to_smallest"])
    write_and_report("ledger", args, settings, results)
    return results


if __name__ == "__main__":
    main()
