"""Benchmark: one full sync round of a 1B-parameter model on one syncer shard and on two.

The model is 4 GB of fp32 parameters in 8 fragments of 512 MB; M = 8 learners each
sent every fragment as an int4 payload (written once to disk, read as from a bucket).
A shard is a fresh process that holds the fragments it owns (``p % N == s``, as
``sync.shards`` splits them) and merges each through the syncer's own ``merge_round``
with one reusable workspace: a first round allocates the workspace, momentum and carries,
the second is timed (half of its arrivals anchored on the first update, as lagging
learners are).  The two shards of the sharded setting start their timed rounds together
(a barrier), and the round lasts until the later one ends.  Three settings:

- 1 shard on 1 thread, the reference;
- 2 shards on 1 thread each, as two syncer hosts would run them (here: the two cores);
- 1 shard on every core (``sync.merge_threads: 0``), what threads alone give.

The projection for a 16-core syncer host is written beside the measurements and
labelled as one: Amdahl's law, with the serial share of a round taken from the speed-up
that every core here gives over one (it ignores the memory bandwidth a bigger host shares).

    python -m bench.shards           # 1B parameters, M = 8 (~6 minutes, 12 GB of memory)
    python -m bench.shards --quick   # 64 MB in 4 fragments, M = 2 (the test suite)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench._common import benchmark_parser, print_table, write_and_report
from bench.merge import (
    base_version_of,
    fragment_shapes,
    peak_resident_bytes,
    reset_peak_resident,
    resident_bytes,
    write_payloads,
)

TARGET_TWO_SHARDS_SPEEDUP = 1.7
PROJECTED_CORES = 16
ROUNDS = 2
"""A first round that allocates, a second that is timed."""


def shard_child(directory: Path, fragments: list[int], megabytes: int, learners: int, secret_hex: str, threads: int):
    """In a fresh process: merge ``fragments`` for round 1, wait at the barrier, time round 2.
    Memory is the peak above the process's resident set before its parameters were made."""
    from diloco_cli.codec import Codec, CodecSpec, RunSecret
    from diloco_cli.codec.exact import ExactPublisher
    from diloco_cli.core.anchor import UpdateWindow
    from diloco_cli.core.outer import NesterovOuterOptimizer
    from diloco_cli.core.types import FragmentIndex, LearnerId, Version
    from diloco_cli.runtime.syncer.merge_round import RoundInput, merge_round
    from diloco_cli.runtime.workspace import MergeWorkspace

    torch.set_num_threads(threads)
    secret = RunSecret.from_hex(secret_hex)
    baseline = resident_bytes()
    reset_peak_resident()
    parameters = {
        p: {name: torch.full(shape, 0.01) for name, shape in fragment_shapes(megabytes).items()} for p in fragments
    }
    windows = {p: UpdateWindow(8) for p in fragments}
    optimizer = NesterovOuterOptimizer(0.7, 0.9)
    publisher = ExactPublisher(CodecSpec(codec=Codec.INT8), secret)
    workspace = MergeWorkspace(threads)  # one per syncer shard, for all of its fragments' rounds

    def one_round(version: int) -> None:
        for p in fragments:
            arrivals = [
                RoundInput(
                    LearnerId(f"learner-{m}"),
                    Version(base_version_of(m, version)),
                    50,
                    50 * 2048,
                    (directory / f"fragment-{p}" / f"{m}-{version}.dlc").read_bytes,
                )
                for m in range(learners)
            ]
            result = merge_round(
                FragmentIndex(p),
                Version(version),
                arrivals,
                parameters[p],
                windows[p],
                optimizer,
                publisher,
                secret,
                workspace=workspace,
            )
            if len(result.merged) != learners:
                raise SystemExit(f"fragment {p}: merged {len(result.merged)} of {learners} payloads")

    one_round(1)
    (directory / f"ready-{fragments[0]}").touch()
    while not (directory / "go").exists():
        time.sleep(0.01)
    started = time.time()
    one_round(2)
    return {"started": started, "ended": time.time(), "peak_MB": (peak_resident_bytes() - baseline) / 1e6}


def run_setting(directory: Path, shards: int, threads: int, fragments: int, megabytes: int, learners: int, secret):
    """The round's wall time (first start to last end) of ``shards`` concurrent shard processes."""
    (directory / "go").unlink(missing_ok=True)
    owned = [[p for p in range(fragments) if p % shards == s] for s in range(shards)]
    for path in directory.glob("ready-*"):
        path.unlink()
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "bench.shards", "--child", str(directory), ",".join(map(str, mine))]
            + [str(megabytes), str(learners), secret, str(threads)],
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).parent.parent,
        )
        for mine in owned
    ]
    while len(list(directory.glob("ready-*"))) < shards:
        if any(process.poll() not in (None, 0) for process in processes):
            raise SystemExit("a shard failed before its timed round")
        time.sleep(0.05)
    (directory / "go").touch()
    reports = []
    for process in processes:
        output, _ = process.communicate()
        if process.returncode != 0:
            raise SystemExit(f"a shard failed (exit {process.returncode})")
        reports.append(json.loads(output.strip().splitlines()[-1]))
    seconds = max(r["ended"] for r in reports) - min(r["started"] for r in reports)
    return {"round_seconds": seconds, "peak_extra_MB_per_shard": max(r["peak_MB"] for r in reports)}


def projection(one_thread_seconds: float, all_cores_seconds: float, cores: int) -> dict:
    """One shard on a ``PROJECTED_CORES``-core host by Amdahl's law: the serial share f
    of a round from the speed-up measured here with ``cores`` threads, s = 1 / (f + (1 -
    f) / cores), then t(16) = t(1) x (f + (1 - f) / 16).  Two shards on two such hosts
    each do half the fragments."""
    speedup = one_thread_seconds / all_cores_seconds
    serial = min(1.0, max(0.0, (1 / speedup - 1 / cores) / (1 - 1 / cores))) if cores > 1 else 1.0
    projected = one_thread_seconds * (serial + (1 - serial) / PROJECTED_CORES)
    return {
        "what": f"a projection, not a measurement: one shard on a {PROJECTED_CORES}-core host",
        "formula": f"Amdahl: t(1) x (f + (1 - f) / {PROJECTED_CORES}), f from the speed-up of {cores} threads here",
        "threads_speedup": speedup,
        "serial_share": serial,
        "one_shard_round_seconds": projected,
        "two_shards_round_seconds": projected / 2,
    }


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        directory, fragments, megabytes, learners, secret_hex, threads = argv[1:7]
        owned = [int(p) for p in fragments.split(",")]
        report = shard_child(Path(directory), owned, int(megabytes), int(learners), secret_hex, int(threads))
        print(json.dumps(report))
        return None
    from diloco_cli.codec import RunSecret

    parser = benchmark_parser(__doc__, "64 MB in 4 fragments, M = 2 (~20 s)")
    args = parser.parse_args(argv)
    fragments, megabytes, learners = (4, 16, 2) if args.quick else (8, 512, 8)
    cores = len(os.sched_getaffinity(0))
    secret = RunSecret.generate().to_hex()
    rows = []
    with tempfile.TemporaryDirectory(prefix="diloco-bench-shards-") as name:
        directory = Path(name)
        for p in range(fragments):
            (directory / f"fragment-{p}").mkdir()
            write_payloads(directory / f"fragment-{p}", megabytes, learners, secret, fragment=p, rounds=ROUNDS)
        for shards, threads in ((1, 1), (2, 1), (1, cores)):
            row = {"shards": shards, "threads_per_shard": threads}
            row |= run_setting(directory, shards, threads, fragments, megabytes, learners, secret)
            print(f"  {shards} shard(s), {threads} thread(s) each: {row['round_seconds']:.2f} s", flush=True)
            rows.append(row)
    reference, sharded, threaded = rows
    speedup = reference["round_seconds"] / sharded["round_seconds"]
    results = {
        "rows": rows,
        "two_shards_speedup": {
            "target": TARGET_TWO_SHARDS_SPEEDUP,
            "measured": speedup,
            "met": speedup >= TARGET_TWO_SHARDS_SPEEDUP,
        },
        "projection": projection(reference["round_seconds"], threaded["round_seconds"], cores),
    }
    settings = {
        "parameters": fragments * megabytes * (1 << 20) // 4,
        "fragments": fragments,
        "fragment_MB": megabytes,
        "M": learners,
        "learner_codec": "int4",
        "update_codec": "int8",
        "cores": cores,
    }
    print_table(rows, ["shards", "threads_per_shard", "round_seconds", "peak_extra_MB_per_shard"])
    print(f"2 shards against 1 (1 thread each): {speedup:.2f}x (target {TARGET_TWO_SHARDS_SPEEDUP}x)")
    projected = results["projection"]["one_shard_round_seconds"]
    print(f"projected for a {PROJECTED_CORES}-core host: {projected:.1f} s per round on 1 shard (Amdahl)")
    write_and_report("shards", args, settings, results)
    return results


if __name__ == "__main__":
    main()
