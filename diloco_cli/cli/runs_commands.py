"""Commands about runs: up, down, runs, logs."""

from __future__ import annotations

import time
from pathlib import Path

import typer

from diloco_cli.cli.errors import reported

RUNS_DIR = typer.Option(Path("runs"), "--runs-dir", help="Where local run records live.", envvar="DILOCO_RUNS_DIR")


@reported
def up(
    recipe: Path | None = typer.Argument(None, help="Recipe file (recipes/*.yaml); default: the built-in default recipe.", show_default=False),
    regions: Path | None = typer.Option(None, "--regions", "-r", help="Region file (regions/*.yaml); default: two local regions of two learners."),
    name: str | None = typer.Option(None, "--name", help="Run name (default: <recipe name>-<date>-<time>)."),
    overrides: list[str] = typer.Option([], "--set", help="Override a recipe key, e.g. --set training.inner_steps=200 (repeatable)."),
    watch: bool = typer.Option(False, "--watch", "-w", help="Stay attached with the live status view; Ctrl-C detaches, the run goes on."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Check everything and print the plan; start nothing."),
    runs_dir: Path = RUNS_DIR,
) -> None:
    """Start a run: the syncer and every learner, detached. With no arguments, the default job on this machine."""
    from diloco_cli.launch.up import launch
    from diloco_cli.views.plan import render_plan

    result = launch(recipe, regions, overrides, name, runs_dir, dry_run)
    if dry_run:
        typer.echo(render_plan(result.spec))
        return
    typer.echo(f"started run {result.spec.run}: syncer and {len(result.spec.learners)} learners")
    typer.echo(f"  watch it:   diloco status {result.spec.run} --watch")
    typer.echo(f"  its logs:   diloco logs {result.spec.run} [LEARNER] --follow")
    typer.echo(f"  stop it:    diloco down {result.spec.run}")
    if watch:
        from diloco_cli.views.status import watch_status

        watch_status(runs_dir, result.spec.run)


@reported
def down(
    run: str = typer.Argument(..., help="The run to stop."),
    timeout: float = typer.Option(30.0, help="Seconds to wait after SIGTERM before SIGKILL."),
    runs_dir: Path = RUNS_DIR,
) -> None:
    """Stop every learner and the syncer of a run (SIGTERM, then SIGKILL after a timeout)."""
    from diloco_cli.launch.local import stop_local
    from diloco_cli.launch.runs import load_run

    record = load_run(runs_dir, run)
    outcome = stop_local(record, timeout)
    for process, how in outcome.items():
        typer.echo(f"  {process:<16} {how}")
    typer.echo(f"run {record.name} is down")


@reported
def runs(
    output: str = typer.Option("text", "--output", "-o", help="text or json."),
    runs_dir: Path = RUNS_DIR,
) -> None:
    """List the runs started from this directory."""
    from diloco_cli.views.runs import render_runs

    typer.echo(render_runs(runs_dir, output))


@reported
def logs(
    run: str = typer.Argument(..., help="The run."),
    process: str | None = typer.Argument(None, help="A learner id or 'syncer' (default: all, one after another)."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines until Ctrl-C."),
    runs_dir: Path = RUNS_DIR,
) -> None:
    """Print a learner's or the syncer's log."""
    from diloco_cli.launch.runs import load_run

    record = load_run(runs_dir, run)
    names = [process] if process else ["syncer", *(learner.id for learner in record.spec.learners)]
    for name in names:
        path = record.log_path(name)
        if not path.exists():
            known = ", ".join(["syncer", *(learner.id for learner in record.spec.learners)])
            from diloco_cli.config.loading import ConfigError

            raise ConfigError(f"run {record.name} has no log for {name!r} (processes: {known})")
        if len(names) > 1:
            typer.echo(f"==> {name} <==")
        with open(path, "rb") as handle:
            typer.echo(handle.read().decode(errors="replace"), nl=False)
            while follow:
                line = handle.readline()
                if line:
                    typer.echo(line.decode(errors="replace"), nl=False)
                else:
                    try:
                        time.sleep(0.2)
                    except KeyboardInterrupt:
                        return


def register(app: typer.Typer) -> None:
    app.command()(up)
    app.command()(down)
    app.command()(runs)
    app.command()(logs)
