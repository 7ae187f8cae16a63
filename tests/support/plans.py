"""``diloco plan`` as the plan tests call it: through the CLI, as JSON and as text."""

import json

from click.testing import CliRunner

from diloco_cli.cli.app import app

ARGS = ["plan", "--step-seconds", "1", "--link-mbit", "10", "--latency-ms", "40"]
"""A 1-s inner step on 10 Mbit/s links with 40 ms of one-way latency."""


def plan_of(args: list[str]) -> tuple[dict, str]:
    """``diloco plan`` with ``args``, as JSON and as text."""
    runner = CliRunner()
    as_json = runner.invoke(app, [*args, "--output", "json"])
    assert as_json.exit_code == 0, as_json.output
    as_text = runner.invoke(app, args)
    assert as_text.exit_code == 0, as_text.output
    return json.loads(as_json.output), as_text.output
