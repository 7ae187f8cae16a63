"""Benchmark: how fast the commands that only read answer, against a bare interpreter.

``diloco --help``, ``diloco status RUN``, ``diloco runs`` and ``diloco logs RUN syncer``
on a run made for the purpose (its buckets on this machine, no process started), each
run as a fresh process as a user would, against ``python -c pass`` in the same
environment, alternating, medians of repeats.  Each command is also checked to import
neither torch nor the runtimes.  Two reference rows show the floor of any typer command
here: importing typer (what ``--help`` needs) and typer with pydantic (typer 0.29 parses
every parameter through pydantic).

    python -m bench.startup            # 15 repeats
    python -m bench.startup --quick    # 5 repeats (the test suite)
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench._common import benchmark_parser, print_table, write_and_report

TARGET_RATIO = 3.0
PROBE = (
    "import atexit, sys; "
    "atexit.register(lambda: sys.stderr.write('HEAVY ' + ' '.join(sorted(m for m in sys.modules "
    "if m == 'torch' or m.startswith('diloco_cli.runtime'))) + '\\n')); "
    "sys.argv = ['diloco', *sys.argv[1:]]; from diloco_cli.cli.app import main; main()"
)


def make_run(runs_dir: Path) -> str:
    """A run on disk (record, secret, manifests, an empty log) that nothing executes."""
    from diloco_cli.config.recipe import Recipe
    from diloco_cli.config.regions import RegionsFile
    from diloco_cli.launch.resolve import create_run_directory, resolve_run, write_manifests

    spec = resolve_run(Recipe(), RegionsFile(), "startup", runs_dir)
    run_dir, _ = create_run_directory(runs_dir, spec, launcher="local")
    write_manifests(spec)
    (run_dir / "logs" / "syncer.log").write_text("a line of log\n")
    return spec.run


def seconds(command: list[str], cwd: Path) -> float:
    started = time.perf_counter()
    subprocess.run(command, cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


def heavy_imports(arguments: list[str], cwd: Path) -> str:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, *arguments], cwd=cwd, capture_output=True, text=True, check=True
    )
    return next(line for line in result.stderr.splitlines() if line.startswith("HEAVY")).removeprefix("HEAVY").strip()


def main(argv: list[str] | None = None) -> dict:
    parser = benchmark_parser(__doc__, "5 repeats")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    repeats = 5 if args.quick else args.repeats
    with tempfile.TemporaryDirectory(prefix="diloco-startup-") as directory:
        cwd = Path(directory)
        run = make_run(cwd / "runs")
        commands = {"--help": ["--help"], "status": ["status", run], "runs": ["runs"], "logs": ["logs", run, "syncer"]}
        references = {
            "python -c pass": "pass",
            "import typer": "import typer",
            "import typer, pydantic": "import typer, pydantic",
        }
        times: dict[str, list[float]] = {name: [] for name in [*references, *commands]}
        for _ in range(repeats):  # alternating, so that load on the machine hits all alike
            for name, code in references.items():
                times[name].append(seconds([sys.executable, "-c", code], cwd))
            for name, arguments in commands.items():
                times[name].append(seconds([sys.executable, "-m", "diloco_cli", *arguments], cwd))
        baseline = statistics.median(times["python -c pass"])
        rows = [
            {"command": name, "median_seconds": statistics.median(times[name]), "heavy_imports": ""}
            for name in references
        ]
        for row in rows:
            row["ratio"] = row["median_seconds"] / baseline
        for name, arguments in commands.items():
            median = statistics.median(times[name])
            rows.append(
                {
                    "command": f"diloco {name}",
                    "median_seconds": median,
                    "ratio": median / baseline,
                    "heavy_imports": heavy_imports(arguments, cwd),
                }
            )
    targets = {
        row["command"]: {"target": f"< {TARGET_RATIO}x", "measured": row["ratio"], "met": row["ratio"] < TARGET_RATIO}
        for row in rows
        if row["command"].startswith("diloco")
    }
    results = {"rows": rows, "targets": targets}
    print_table(rows, ["command", "median_seconds", "ratio", "heavy_imports"])
    write_and_report("startup", args, {"repeats": repeats}, results)
    return results


if __name__ == "__main__":
    main()
