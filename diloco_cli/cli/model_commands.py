"""Commands about the global model: export and sample."""

from __future__ import annotations

from pathlib import Path

import click

from diloco_cli.cli.errors import reported
from diloco_cli.cli.numbers import MAX_SAMPLE_TOKENS, MAX_SEED, finite
from diloco_cli.cli.parameters import PATH, Real, Whole, argument, command, option, runs_dir_option


@command()
@argument("run", help="The run.")
@option(
    "--output",
    "-o",
    type=PATH,
    required=True,
    help="Where to write: a .safetensors file (or a directory, to write model.safetensors in it); "
    "a directory for --format hf.",
)
@option(
    "--format",
    "export_format",
    type=click.Choice(["safetensors", "hf"]),
    default="safetensors",
    help="safetensors: the state_dict, loadable into the recipe's model; hf: a Hugging Face directory "
    "(config.json, model.safetensors and the dataset's tokenizer) for models of diloco_cli.models.hf.",
)
@option("--region", help="Read the global weights from this region (default: the first).")
@runs_dir_option()
@reported
def export(run: str, output: Path, export_format: str, region: str | None, runs_dir: Path) -> None:
    """Write the global weights, loadable into the recipe's model or with transformers."""
    from diloco_cli.launch.model import export_run
    from diloco_cli.launch.runs import load_run
    from diloco_cli.runtime.export import versions_label

    record = load_run(runs_dir, run)
    written, heads = export_run(record, output, export_format == "hf", region)
    click.echo(
        f"wrote {written}: global {versions_label(heads)} of run {record.name} ({record.spec.recipe.model.factory})"
    )


@command()
@argument("run", help="The run.")
@option("--prompt", "-p", default="\n", help="Text to continue.", show_default="a new line")
@option(
    "--length",
    "-n",
    type=Whole(1, MAX_SAMPLE_TOKENS),
    default=300,
    help="Tokens to generate (bytes, for a run on text).",
)
@option(
    "--temperature",
    type=Real(finite(minimum=0)),
    default=0.8,
    help="Sampling temperature (0 picks the likeliest token).",
)
@option("--top-k", type=Whole(0), default=40, help="Sample among the k likeliest tokens (0: among all).")
@option("--seed", type=Whole(0, MAX_SEED), default=0, help="Random seed.")
@option(
    "--past-end",
    is_flag=True,
    help="Go on past the end of the document (printing its end-of-document token) until --length tokens.",
)
@runs_dir_option()
@reported
def sample(
    run: str,
    prompt: str,
    length: int,
    temperature: float,
    top_k: int,
    seed: int,
    past_end: bool,
    runs_dir: Path,
) -> None:
    """Continue a prompt with the run's global model, to see what it has learned (a run on
    a token dataset encodes and decodes with the tokenizer its index names, and stops where
    the model ends the document, as the exported model's generate does)."""
    from diloco_cli.launch.model import sample_run
    from diloco_cli.launch.runs import load_run
    from diloco_cli.runtime.export import versions_label

    heads, sample = sample_run(load_run(runs_dir, run), prompt, length, temperature, top_k, seed, past_end)
    click.echo(f"[global {versions_label(heads)}]", err=True)
    click.echo(sample.text)
    if sample.ended:
        click.echo(
            f"[end of document after {sample.new_tokens} tokens; --past-end goes on to --length {length}]", err=True
        )


def register(app: click.Group) -> None:
    app.add_command(export)
    app.add_command(sample)
