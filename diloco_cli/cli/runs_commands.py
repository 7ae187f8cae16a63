"""Commands about runs: up, down, runs, logs."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from diloco_cli.cli.errors import reported
from diloco_cli.cli.numbers import finite
from diloco_cli.cli.parameters import OUTPUT, PATH, Real, argument, command, option, runs_dir_option


@command()
@argument(
    "recipe", type=PATH, required=False, help="Recipe file (recipes/*.yaml); default: the built-in default recipe."
)
@option("--regions", "-r", type=PATH, help="Region file (regions/*.yaml); default: two local regions of two learners.")
@option("--name", help="Run name (default: <recipe name>-<date>-<time>).")
@option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a recipe key, e.g. --set training.inner_steps=200 (repeatable).",
)
@option(
    "--watch", "-w", is_flag=True, help="Stay attached with the live status view; Ctrl-C detaches, the run goes on."
)
@option("--dry-run", is_flag=True, help="Run preflight and print the resolved plan; start nothing.")
@option(
    "--accept-new-host-keys",
    is_flag=True,
    help="Add unknown SSH host keys to known_hosts (OpenSSH's accept-new); changed keys are still refused.",
)
@option(
    "--chaos",
    metavar="SPEC",
    help=(
        "Inject faults reproducibly, "
        "e.g. 'seed=1,kill-learner=0.5/min,stop-learner=1/min:10s,outage=local-b@60s+30s'; "
        "'slow-learner=local-b-0:0.6' runs a learner at 0.6 of full speed (mixed hardware, repeatable), "
        "'keep-payloads' keeps merged payloads for an audit (docs/resilience.md)."
    ),
)
@runs_dir_option()
@reported
def up(
    recipe: Path | None,
    regions: Path | None,
    name: str | None,
    overrides: list[str],
    watch: bool,
    dry_run: bool,
    accept_new_host_keys: bool,
    chaos: str | None,
    runs_dir: Path,
) -> None:
    """Start a run (syncer, reducers, learners), detached. With no arguments, the default job on this machine.
    Ctrl-C before a process starts leaves nothing; after, the start is finished and said, and the run goes on."""
    from diloco_cli.launch.interrupts import NOTHING_STARTED, Interrupted, held_back

    with held_back("") as loading:  # a module cut off half-way through its import breaks what follows
        from diloco_cli.launch.up import launch
        from diloco_cli.views.dry_run import render_dry_run
        from diloco_cli.views.preflight import render_preflight
        from diloco_cli.views.runs import render_started
    if loading.happened:
        click.echo(NOTHING_STARTED, err=True)
        raise click.exceptions.Exit(130)
    show_preflight = lambda reports: click.echo(render_preflight(reports))  # noqa: E731
    try:
        result = launch(
            recipe,
            regions,
            overrides,
            name,
            runs_dir,
            dry_run,
            accept_new_host_keys,
            emit=click.echo,
            show_preflight=show_preflight,
            chaos=chaos,
            announce=lambda spec: click.echo(render_started(spec)),
        )
    except Interrupted as interrupted:
        click.echo(str(interrupted), err=True)
        raise click.exceptions.Exit(130) from None
    if dry_run:
        click.echo(render_dry_run(result.spec))
        return
    if result.interrupted:  # said when it came; the run is started and named
        raise click.exceptions.Exit(130)
    if watch:
        _show_status(runs_dir, result.spec.run, "text", watch=True, manifest=None, probe=False)


@command()
@argument("run", help="The run to stop.")
@option("--timeout", type=Real(finite(minimum=0)), default=30.0, help="Seconds to wait after SIGTERM before SIGKILL.")
@runs_dir_option()
@reported
def down(run: str, timeout: float, runs_dir: Path) -> None:
    """Stop every learner and the syncer of a run (SIGTERM, then SIGKILL after a timeout)."""
    from diloco_cli.launch.operations import stop_run
    from diloco_cli.launch.runs import load_run, summarize_run
    from diloco_cli.views.runs import render_stopped

    record = load_run(runs_dir, run)
    outcome = stop_run(record, timeout)
    click.echo(render_stopped(record.name, outcome, summarize_run(record).state))


@command()
@argument("run", help="The run to resume.")
@runs_dir_option()
@reported
def resume(run: str, runs_dir: Path) -> None:
    """Start again whatever of a run is down (a process whose supervisor gave up or is gone), here and on SSH hosts,
    from the run's durable state: learners from their checkpoints, the syncer from its commits."""
    from diloco_cli.launch.operations import resume_run
    from diloco_cli.launch.runs import load_run

    record = load_run(runs_dir, run)
    started = resume_run(record, emit=click.echo)
    if started:
        click.echo(
            f"run {record.name} resumed: {', '.join(started)} started again; "
            f"`diloco status {record.name} --watch` follows it"
        )
    else:
        click.echo(f"nothing of run {record.name} is down: every process is running or finished")


@command()
@argument("names", nargs=-1, help="The runs to remove.")
@option(
    "--older-than",
    metavar="DAYS",
    type=Real(finite(minimum=0)),
    help="Also remove every finished or stopped run created more than DAYS days ago.",
)
@option("--dry-run", is_flag=True, help="Say what would be removed; remove nothing.")
@runs_dir_option()
@reported
def rm(names: list[str], older_than: float | None, dry_run: bool, runs_dir: Path) -> None:
    """Remove runs for good: their record and logs here, their objects in every region's bucket, the syncer's home,
    their folders on SSH hosts. A running run is refused."""
    from diloco_cli.config.errors import ConfigError
    from diloco_cli.launch.removal import plan_removal, remove_run, runs_to_prune
    from diloco_cli.launch.runs import load_run

    if not names and older_than is None:
        raise ConfigError("name the runs to remove, or give --older-than DAYS (`diloco runs` lists them)")
    records = [load_run(runs_dir, name) for name in names or []]
    records += [
        r
        for r in (runs_to_prune(runs_dir.resolve(), older_than) if older_than is not None else [])
        if r.name not in (names or [])
    ]
    if not records:  # a cron job's usual day
        click.echo(
            f"nothing to remove: no finished or stopped run in {runs_dir.resolve()} is older than {older_than:g} days"
        )
    for record in records:
        removal = plan_removal(record)
        if not dry_run:
            remove_run(record, removal)
        verb = "would remove" if dry_run else "removed"
        click.echo(f"{verb} run {record.name}: {'; '.join(removal.places)}")
        for skipped in removal.skipped:
            click.echo(f"  left alone: {skipped}")


@command()
@option("--output", "-o", type=OUTPUT, default="text", help="Plain text, or JSON.")
@runs_dir_option()
@reported
def runs(output: str, runs_dir: Path) -> None:
    """List the runs started from this directory: finished, running, stopped, failed or down."""
    from diloco_cli.launch.runs import list_runs, summarize_run
    from diloco_cli.views.runs import render_runs

    click.echo(render_runs([summarize_run(record) for record in list_runs(runs_dir.resolve())], runs_dir, output))


@command()
@argument("run", help="The run.")
@argument(
    "process",
    required=False,
    help="A learner id, 'syncer' (a syncer shard's 'syncer-N' with sync.shards), or a region's 'reducer-REGION' "
    "(default: all, one after another).",
)
@option("--follow", "-f", is_flag=True, help="Keep printing new lines until the process is done (or Ctrl-C).")
@runs_dir_option()
@reported
def logs(run: str, process: str | None, follow: bool, runs_dir: Path) -> None:
    """Print a learner's or the syncer's log, here or over SSH."""
    from diloco_cli.launch.logs import log_text, process_names
    from diloco_cli.launch.runs import load_run

    record = load_run(runs_dir, run)
    try:
        for text in log_text(record, process_names(record, process), follow):
            sys.stdout.write(text)
            sys.stdout.flush()
    except KeyboardInterrupt:
        pass


STATUS_JSON_HELP = """Print JSON: run, state (starting, running, finished, stopped, syncer not reporting,
syncer down), version (versions published, by every syncer shard together), tokens,
heldout_loss, heldout_version (the version it was measured at), elapsed_seconds,
problems[] (what is down and what to run);
learners[] with learner, region, host, state, step, total_steps, tokens, loss,
steps_per_second, base_version, staleness, last_seen_seconds, restarts (as its supervisor
counts them, when known), bytes_up,
bytes_down, unsent, retries, refusals; syncer with state, last_report_seconds, last_merge,
last_merge_seconds_ago, merges, merges_per_minute, quorum, effective_quorum,
grace_seconds, live_learners, reasons (per fragment, why it is not merging now), repairs,
leftovers_removed, given_up (with sync.shards, the shards' sum, and syncer_shards[] each with
its name, version and the same); regions[] with learners_up, learners_down, checkpoints_up, syncer_up,
syncer_down, retries, failures, refusals (by kind), latest_refusal; evaluations[];
bandwidth (one line: bytes across links and in regions; `diloco report` has the rest)."""


@command()
@argument("run", required=False, help="The run (default: the newest one here).")
@option("--watch", "-w", is_flag=True, help="Keep the view up until the run ends; Ctrl-C detaches.")
@option("--output", "-o", type=OUTPUT, default="text", help="Plain text, or JSON. " + STATUS_JSON_HELP)
@option(
    "--manifest",
    help=(
        "Read the run from a bucket's manifest.json URL instead of ./runs "
        "(any machine that can read the buckets; documents are then shown unverified)."
    ),
)
@option(
    "--probe",
    is_flag=True,
    help="Also ask every host over SSH whether it answers and what each supervisor is doing (adds probe[] to JSON).",
)
@runs_dir_option()
@reported
def status(run: str | None, watch: bool, output: str, manifest: str | None, probe: bool, runs_dir: Path) -> None:
    """Show a run: global version, loss, every learner, the syncer, storage per region, and what is down."""
    _show_status(runs_dir, run, output, watch, manifest, probe)


def _show_status(runs_dir: Path, run: str | None, output: str, watch: bool, manifest: str | None, probe: bool) -> None:
    from diloco_cli.views.status import show_status

    if manifest:
        from diloco_cli.store.run_spec import read_run_spec

        show_status(read_run_spec(manifest), output, watch)
        return
    from diloco_cli.launch.operations import probe_run
    from diloco_cli.launch.runs import load_run, newest_run
    from diloco_cli.views.runs import no_runs

    record = load_run(runs_dir, run) if run is not None else newest_run(runs_dir)
    if record is None:  # as `diloco runs` says it: nothing to show is no mistake
        click.echo("null" if output == "json" else no_runs(runs_dir))
        if output == "json":
            click.echo(no_runs(runs_dir), err=True)
        return
    supervisors = lambda: probe_run(record, remote=probe)  # noqa: E731 - asked again at every refresh
    show_status(record.spec, output, watch, secret=record.secret(), processes=supervisors, probed=probe)


def register(app: click.Group) -> None:
    for each in (up, status, runs, logs, down, resume, rm):
        app.add_command(each)
