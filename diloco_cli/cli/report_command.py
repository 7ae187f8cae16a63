"""``diloco report``: where a run's bytes went."""

from __future__ import annotations

from pathlib import Path

import click

from diloco_cli.cli.errors import reported
from diloco_cli.cli.parameters import OUTPUT, PATH, argument, command, option, runs_dir_option

REPORT_JSON_HELP = """JSON: run, state, elapsed_seconds, tokens, total_bytes, wan_bytes,
wan_bytes_per_token, cost_dollars; links[] (source, bucket, wan, requests, bytes_up,
bytes_down, seconds, megabytes_per_second, share, cost_dollars, kinds (bytes both ways by
kind), history of [time, up, down]); learners[]; kinds[] (with cost_dollars);
compression[] (kind, bytes, raw_fp32_bytes, ratio);
data_parallel at equal tokens (parameters, workers, steps, bytes_per_worker_step,
wan_bytes and wan_ratio of a flat ring, regions, hierarchical_wan_bytes and
hierarchical_wan_ratio, formula, hierarchical_formula); evaluations[]."""


@command()
@argument("run", required=False, help="The run (default: the newest one here).")
@option("--output", "-o", type=OUTPUT, default="text", help="Tables (plain text when piped), or " + REPORT_JSON_HELP)
@option("--html", type=PATH, help="Also write one self-contained HTML page with the tables and plots to this file.")
@option("--prices", type=PATH, help="A YAML price table replacing the built-in list prices (see docs/bandwidth.md).")
@option(
    "--manifest",
    help="Read the run from a bucket's manifest.json URL instead of ./runs (documents shown unverified).",
)
@runs_dir_option()
@reported
def report(
    run: str | None, output: str, html: Path | None, prices: Path | None, manifest: str | None, runs_dir: Path
) -> None:
    """Where a run's bytes went: per link (WAN or in-region), per learner and per kind; compression; what synchronous
    data-parallel would have moved; estimated cost. Works on a running run too."""
    from diloco_cli.bandwidth.prices import load_prices
    from diloco_cli.views.report import collect_report, show_report

    table = load_prices(prices)
    if manifest:
        from diloco_cli.store.run_spec import read_run_spec

        spec, secret = read_run_spec(manifest), None
    else:
        from diloco_cli.launch.runs import load_run

        record = load_run(runs_dir, run)
        spec, secret = record.spec, record.secret()
    show_report(collect_report(spec, secret, table), output, html)


def register(app: click.Group) -> None:
    app.add_command(report)
