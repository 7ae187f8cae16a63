"""Changing a running run: ``diloco scale`` (learners added or drained) and ``diloco
chaos`` (faults injected on purpose)."""

from __future__ import annotations

from pathlib import Path

import click

from diloco_cli.cli.errors import reported
from diloco_cli.cli.numbers import finite
from diloco_cli.cli.parameters import Real, argument, command, option, runs_dir_option


@command()
@argument("run", help="The running run to scale.")
@option("--region", required=True, help="The region whose learners change.")
@option(
    "--learners",
    required=True,
    metavar="+N|-N",
    help="+N starts N more learners on the region's hosts; -N drains N of them (the newest first).",
)
@option(
    "--wait/--no-wait",
    default=True,
    help="After -N, wait until the drained learners stopped and everything they trained is merged.",
)
@option(
    "--timeout", metavar="SECONDS", type=Real(finite(minimum=0)), default=900.0, help="How long to wait for a drain."
)
@runs_dir_option()
@reported
def scale(run: str, region: str, learners: str, wait: bool, timeout: float, runs_dir: Path) -> None:
    """Change how many learners a running run has. New learners start from the newest global weights; drained ones
    send what they trained before they stop. The syncer's M follows, the data is shared out anew, and the run's
    record keeps each change."""
    from diloco_cli.launch.runs import load_run
    from diloco_cli.launch.scale import parse_change, scale_run, wait_for_drain
    from diloco_cli.views.scale import render_change, render_drained, render_unfinished

    change = parse_change(learners)
    record = load_run(runs_dir, run)
    spec = scale_run(record, region, change, emit=click.echo)
    last = spec.scaling[-1]
    click.echo(render_change(record.name, last, spec.recipe.quorum))
    if last.drained and wait:
        click.echo(
            f"waiting (up to {timeout:.0f} s) for the drained learners to stop with their work merged; "
            "Ctrl-C stops waiting, not the drain"
        )
        outcomes = wait_for_drain(record, last.drained, timeout, lambda outcome: click.echo(render_drained(outcome)))
        unfinished = [outcome for outcome in outcomes if not outcome.done]
        if unfinished:
            click.echo(render_unfinished(record.name, unfinished, timeout), err=True)
            raise click.exceptions.Exit(1)


@command()
@argument("run", help="The running run.")
@argument(
    "plan",
    metavar="SPEC",
    help=(
        "What to inject, e.g. 'seed=1,kill-learner=0.5/min,outage=local-b@30s+20s,slow-learner=local-b-0:0.6' "
        "(times count from now; docs/resilience.md)."
    ),
)
@runs_dir_option()
@reported
def chaos(run: str, plan: str, runs_dir: Path) -> None:
    """Inject faults into a running run from now on, as `up --chaos` does from the start: kill and pause learners
    and the syncer, take a region's storage down for a while, slow learners down. The new plan replaces the run's
    earlier one (a learner it does not slow runs at full speed again); `status` shows every event."""
    from diloco_cli.launch.chaos import chaos_run
    from diloco_cli.launch.runs import load_run

    record = load_run(runs_dir, run)
    given = chaos_run(record, plan, emit=click.echo)
    outages = ", ".join(
        f"{o.region} from {o.start_seconds:.0f} s for {o.duration_seconds:.0f} s" for o in given.outages
    )
    click.echo(
        f"run {record.name}: chaos plan given"
        + (f"; outages: {outages} from now" if outages else "")
        + f"; `diloco status {record.name}` shows the events"
    )


def register(app: click.Group) -> None:
    app.add_command(scale)
    app.add_command(chaos)
