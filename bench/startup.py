"""Benchmark: how fast the commands that only read answer, against a bare interpreter.

``diloco --help``, ``diloco status RUN``, ``diloco runs`` and ``diloco logs RUN syncer``
on a run made for the purpose (its buckets on this machine, no process started), each
run as a fresh process as a user would, against ``python -c pass`` in the same
environment, alternating, medians of repeats: wall milliseconds and their ratio (the
targets: ``--help`` under 3x, the others under 5x, on an idle machine), and CPU
milliseconds (user + system) and their ratio, which a busy machine disturbs less.  Each
command's heavy imports are listed (torch, typer, pydantic, fsspec, the runtimes).
Reference rows show the floors: importing click (what every command needs), a click
command of one option, and click with what ``status`` reads a local run with (pydantic
for its documents, rich to draw; its buckets are folders, read without fsspec).  ``diloco
plan --step-seconds 1`` is timed too (target: 2 s): it imports torch, to build the model
and size the payloads with the real encoder, and trains nothing.

The package is byte-compiled first, as an install is: with ``PYTHONDONTWRITEBYTECODE`` set
every run would compile it again.

    python -m bench.startup            # 15 repeats
    python -m bench.startup --quick    # 5 repeats (the test suite)
"""

from __future__ import annotations

import compileall
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench._common import benchmark_parser, print_table, write_and_report

TARGETS = {"diloco --help": 3.0, "diloco status": 5.0, "diloco runs": 5.0, "diloco logs": 5.0}
"""Wall time over ``python -c pass``'s, on an idle machine (issue 32)."""
PLAN_TARGET_SECONDS = 2.0
PROBE = (
    "import atexit, sys; "
    "atexit.register(lambda: sys.stderr.write('HEAVY ' + ' '.join(sorted(m for m in sys.modules "
    "if m in ('torch', 'typer', 'pydantic', 'fsspec') or m.startswith('diloco_cli.runtime'))) + '\\n')); "
    "sys.argv = ['diloco', *sys.argv[1:]]; from diloco_cli.cli.entry import main; main()"
)
CLICK_COMMAND = (
    "import click\n"
    "@click.group()\n"
    "def app() -> None: pass\n"
    "@app.command()\n"
    "@click.option('--output', default='text')\n"
    "def runs(output: str) -> None: pass\n"
    "app(['runs'])\n"
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


def timed(command: list[str], cwd: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds: user + system) of ``command`` in a process of its own."""
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(command)} failed")
    return wall, usage.ru_utime + usage.ru_stime


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
    compileall.compile_dir(Path(__file__).resolve().parents[1] / "diloco_cli", quiet=1)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="diloco-startup-") as directory:
        cwd = Path(directory)
        run = make_run(cwd / "runs")
        commands = {
            "--help": ["--help"],
            "status": ["status", run],
            "runs": ["runs"],
            "logs": ["logs", run, "syncer"],
            "plan --step-seconds 1": ["plan", "--step-seconds", "1"],
        }
        references = {
            "python -c pass": "pass",
            "import click": "import click",
            "a click command of one option": CLICK_COMMAND,
            "import click, pydantic, rich.console, rich.table": "import click, pydantic, rich.console, rich.table",
        }
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in [*references, *commands]}
        for _ in range(repeats):  # alternating, so that load on the machine hits all alike
            for name, code in references.items():
                times[name].append(timed([sys.executable, "-c", code], cwd))
            for name, arguments in commands.items():
                times[name].append(timed([sys.executable, "-m", "diloco_cli", *arguments], cwd))
        wall = {name: statistics.median(w for w, _ in pairs) for name, pairs in times.items()}
        cpu = {name: statistics.median(c for _, c in pairs) for name, pairs in times.items()}
        rows = []
        for name in [*references, *commands]:
            command = name if name in references else f"diloco {name}"
            rows.append(
                {
                    "command": command,
                    "median_ms": 1000 * wall[name],
                    "ratio": wall[name] / wall["python -c pass"],
                    "cpu_ms": 1000 * cpu[name],
                    "cpu_ratio": cpu[name] / cpu["python -c pass"],
                    "heavy_imports": "" if name in references else heavy_imports(commands[name], cwd),
                }
            )
    targets = {
        row["command"]: {"target": f"< {TARGETS[row['command']]:g}x", "measured": row["ratio"]}
        for row in rows
        if row["command"] in TARGETS
    }
    for target in targets.values():
        target["met"] = target["measured"] < float(target["target"][2:-1])
    plan = next(row for row in rows if row["command"] == "diloco plan --step-seconds 1")
    targets[plan["command"]] = {
        "target": f"< {PLAN_TARGET_SECONDS:g} s",
        "measured": plan["median_ms"] / 1000,
        "met": plan["median_ms"] / 1000 < PLAN_TARGET_SECONDS,
    }
    load = {"before": load_before, "after": os.getloadavg()}
    results = {"rows": rows, "targets": targets, "load_average": load}
    print_table(rows, ["command", "median_ms", "ratio", "cpu_ms", "cpu_ratio", "heavy_imports"])
    settings = {"repeats": repeats, "cores": os.cpu_count(), "load_average_1min_before": round(load_before[0], 2)}
    write_and_report("startup", args, settings, results)
    return results


if __name__ == "__main__":
    main()
