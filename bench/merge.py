"""Benchmark 2: one full syncer merge round against a naive reference and a buffer copy.

A round (decode M int4 payloads, anchor on the drift since their base, token weights,
RDA, Nesterov, encode the int8 update, apply it) runs through the syncer's own
``merge_round`` on ``--threads`` threads (default: the recipe's ``sync.merge_threads``,
0 = every core this process may use; torch gets as many) with the syncer's reusable
workspace, in a fresh process per configuration, with the payloads read from disk one
at a time as from a bucket.  Reported per fragment size and M: round time (median of 3
rounds, the first of which allocates the workspace, momentum and carries), merge
throughput (fp32 bytes of arrivals merged per second) against ``dst.copy_(src)`` of a
fragment on one thread in the same process (median of 5, its pages already touched),
and the round's peak memory above the loaded parameters, next to a naive reference that
stacks M fp32 copies and takes their mean.

    python -m bench.merge               # 1 MB .. 1 GB fragments, M in {2, 4, 8, 16}
    python -m bench.merge --quick       # 8 MB fragments, M of 2 and 16 (the test suite)
    python -m bench.merge --threads 1   # the round on one thread
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from bench._common import benchmark_parser, copy_seconds, median, print_table, seconds, write_and_report

TENSORS_PER_FRAGMENT = 4
ROUNDS = 3
COPY_REPEATS = 5
TARGET_THROUGHPUT_VS_COPY = {2: 0.15, 4: 0.3}
"""Merged bytes per second against a copy's, at M = 2 and at M >= 4, every fragment size."""
TARGET_MEMORY_GROWTH = 0.10


def throughput_target(learners: int) -> float:
    return TARGET_THROUGHPUT_VS_COPY[2] if learners < 4 else TARGET_THROUGHPUT_VS_COPY[4]


def fragment_shapes(megabytes: int) -> dict[str, tuple[int, ...]]:
    per_tensor = megabytes * (1 << 20) // 4 // TENSORS_PER_FRAGMENT
    return {f"layer{i}.weight": (per_tensor // 256, 256) for i in range(TENSORS_PER_FRAGMENT)}


def base_version_of(learner: int, version: int) -> int:
    """Even learners send from the newest version, odd ones lag one version behind, so
    half of the arrivals are anchored on a non-zero drift."""
    return max(0, version - 1 - learner % 2)


def write_payloads(
    directory: Path, megabytes: int, count: int, secret_hex: str, fragment: int = 0, rounds: int = ROUNDS
) -> None:
    """Payload ``{m}-{version}.dlc`` of learner m for the round publishing ``version``
    (1 to ``rounds``) of fragment ``fragment``."""
    from diloco_cli.codec import Codec, CodecSpec, RunSecret, encode_payload

    secret = RunSecret.from_hex(secret_hex)
    generator = torch.Generator().manual_seed(megabytes + 1000 * fragment)
    for m in range(count):
        delta = {
            name: torch.randn(shape, generator=generator) * 1e-3 for name, shape in fragment_shapes(megabytes).items()
        }
        for version in range(1, rounds + 1):
            meta = {"learner": f"learner-{m}", "fragment": fragment, "base_version": base_version_of(m, version)}
            payload = encode_payload(delta.items(), CodecSpec(codec=Codec.INT4), secret, meta)
            (directory / f"{m}-{version}.dlc").write_bytes(payload)
        del delta


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def reset_peak_resident() -> None:
    """Make the kernel forget the peak so far (Linux: writing 5 to clear_refs resets
    VmHWM), so the peak read after the round is the round's own."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def peak_resident_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def child(directory: Path, megabytes: int, learners: int, secret_hex: str, naive: bool, threads: int) -> dict:
    """Runs in a fresh process: load Theta, then time rounds and record the peak memory."""
    from diloco_cli.codec import Codec, CodecSpec, RunSecret, decode_payload
    from diloco_cli.codec.exact import ExactPublisher
    from diloco_cli.core.anchor import UpdateWindow
    from diloco_cli.core.outer import NesterovOuterOptimizer
    from diloco_cli.core.types import FragmentIndex, LearnerId, Version
    from diloco_cli.runtime.syncer.merge_round import RoundInput, merge_round
    from diloco_cli.runtime.workspace import MergeWorkspace

    torch.set_num_threads(1)  # the reference is one core's copy
    secret = RunSecret.from_hex(secret_hex)
    shapes = fragment_shapes(megabytes)
    parameters = {name: torch.randn(shape) for name, shape in shapes.items()}
    source = torch.randn(sum(t.numel() for t in parameters.values()))
    destination = torch.empty_like(source).copy_(source)  # its pages faulted in before timing
    copy_times = [copy_seconds(source, destination) for _ in range(COPY_REPEATS)]
    del source, destination
    torch.set_num_threads(threads)
    baseline = resident_bytes()
    reset_peak_resident()
    times = []
    if naive:
        momentum = None
        for _ in range(ROUNDS):

            def naive_round():
                nonlocal momentum
                files = [directory / f"{m}-1.dlc" for m in range(learners)]
                stacked = {
                    name: torch.stack([decode_payload(f.read_bytes(), secret).tensors[name] for f in files])
                    for name in shapes
                }
                mean = {name: stacked[name].mean(0) for name in shapes}
                momentum = mean if momentum is None else {n: momentum[n].mul_(0.9).add_(mean[n]) for n in shapes}
                for name in shapes:
                    parameters[name].sub_(0.7 * (mean[name] + 0.9 * momentum[name]))

            times.append(seconds(naive_round))
    else:
        window, optimizer = UpdateWindow(8), NesterovOuterOptimizer(0.7, 0.9)
        publisher = ExactPublisher(CodecSpec(codec=Codec.INT8), secret)
        workspace = MergeWorkspace(threads)  # as the syncer keeps one for all its rounds
        for version in range(1, ROUNDS + 1):
            arrivals = [
                RoundInput(
                    LearnerId(f"learner-{m}"),
                    Version(base_version_of(m, version)),
                    50,
                    50 * 2048,
                    (directory / f"{m}-{version}.dlc").read_bytes,
                )
                for m in range(learners)
            ]
            times.append(
                seconds(
                    lambda version=version, arrivals=arrivals: merge_round(
                        FragmentIndex(0),
                        Version(version),
                        arrivals,
                        parameters,
                        window,
                        optimizer,
                        publisher,
                        secret,
                        workspace=workspace,
                    )
                )
            )
    peak = peak_resident_bytes()
    fragment_bytes = megabytes * (1 << 20)
    return {
        "round_seconds": median(times),
        "throughput_MBps": learners * fragment_bytes / median(times) / 1e6,
        "copy_MBps": fragment_bytes / median(copy_times) / 1e6,
        "peak_extra_MB": max(0, peak - baseline) / 1e6,
    }


def measure(sizes: list[int], learner_counts: list[int], naive_limit_mb: int, threads: int) -> list[dict]:
    from diloco_cli.codec import RunSecret

    secret_hex = RunSecret.generate().to_hex()
    rows = []
    for megabytes in sizes:
        with tempfile.TemporaryDirectory(prefix="diloco-bench-merge-") as directory:
            write_payloads(Path(directory), megabytes, max(learner_counts), secret_hex)
            for learners in learner_counts:
                for naive in (False, True):
                    if naive and learners * megabytes > naive_limit_mb:
                        continue
                    command = [
                        sys.executable,
                        "-m",
                        "bench.merge",
                        "--child",
                        directory,
                        str(megabytes),
                        str(learners),
                        secret_hex,
                        str(threads),
                    ]
                    if naive:
                        command.append("--naive")
                    output = subprocess.run(
                        command, capture_output=True, text=True, check=True, cwd=Path(__file__).parent.parent
                    )
                    result = json.loads(output.stdout.strip().splitlines()[-1])
                    result.update(
                        fragment_MB=megabytes, M=learners, method="naive stack+mean" if naive else "diloco round"
                    )
                    result["throughput_vs_copy"] = result["throughput_MBps"] / result["copy_MBps"]
                    rows.append(result)
                    print(
                        f"  {megabytes} MB, M={learners}, {result['method']}: {result['round_seconds']:.3f} s",
                        flush=True,
                    )
    return rows


def verdicts(rows: list[dict]) -> dict:
    ours = [r for r in rows if r["method"] == "diloco round"]
    growth = {}
    for megabytes in sorted({r["fragment_MB"] for r in ours}):
        by_m = {r["M"]: r["peak_extra_MB"] for r in ours if r["fragment_MB"] == megabytes}
        if 2 in by_m and 16 in by_m:
            growth[megabytes] = by_m[16] / by_m[2] - 1
    worst_growth = max(growth.values())
    throughput = {}
    for name, selected in (("M=2", [r for r in ours if r["M"] < 4]), ("M>=4", [r for r in ours if r["M"] >= 4])):
        if not selected:
            continue
        target = throughput_target(selected[0]["M"])
        slowest = min(selected, key=lambda r: r["throughput_vs_copy"])
        throughput[name] = {
            "target": target,
            "measured_min": slowest["throughput_vs_copy"],
            "at": {"fragment_MB": slowest["fragment_MB"], "M": slowest["M"]},
            "met": slowest["throughput_vs_copy"] >= target,
        }
    return {
        "memory_growth_M16_vs_M2": {
            "target": f"<= {TARGET_MEMORY_GROWTH}",
            "measured": growth,
            "met": worst_growth <= TARGET_MEMORY_GROWTH,
        },
        "throughput_vs_copy": throughput,
    }


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        directory, megabytes, learners, secret_hex, threads = argv[1:6]
        naive = "--naive" in argv
        print(json.dumps(child(Path(directory), int(megabytes), int(learners), secret_hex, naive, int(threads))))
        return None
    from diloco_cli.codec.parallel import resolve_threads
    from diloco_cli.config.recipe import SyncConfig

    parser = benchmark_parser(__doc__, "a small run for the test suite: 8 MB fragments, M of 2 and 16 (~10 s)")
    parser.add_argument(
        "--threads",
        type=int,
        default=SyncConfig().merge_threads,
        help="threads of the round, as the recipe's sync.merge_threads (default: its default, 0 = every core)",
    )
    args = parser.parse_args(argv)
    threads = resolve_threads(args.threads)
    sizes = [8] if args.quick else [1, 16, 256, 1024]
    learner_counts = [2, 16] if args.quick else [2, 4, 8, 16]  # each a process of its own (~2 s to start)
    naive_limit = 128 if args.quick else 4096
    rows = measure(sizes, learner_counts, naive_limit, threads)
    results = {"rows": rows, "targets": verdicts(rows)}
    settings = {
        "fragment_MB": sizes,
        "M": learner_counts,
        "rounds": ROUNDS,
        "learner_codec": "int4",
        "update_codec": "int8",
        "tensors_per_fragment": TENSORS_PER_FRAGMENT,
        "threads": threads,
        "naive_limit_MB": naive_limit,
    }
    print_table(
        rows, ["fragment_MB", "M", "method", "round_seconds", "throughput_MBps", "throughput_vs_copy", "peak_extra_MB"]
    )
    for name, verdict in results["targets"].items():
        print(f"{name}: {verdict} ")
    write_and_report("merge", args, settings, results)
    return results


if __name__ == "__main__":
    main()
