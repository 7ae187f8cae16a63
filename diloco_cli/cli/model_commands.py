"""Commands about the global model: export and sample."""

from __future__ import annotations

from enum import Enum
from pathlib import Path

import typer

from diloco_cli.cli.errors import reported
from diloco_cli.cli.numbers import MAX_SAMPLE_TOKENS, MAX_SEED, finite
from diloco_cli.cli.runs_commands import RUNS_DIR


class ExportFormat(str, Enum):
    SAFETENSORS = "safetensors"
    HF = "hf"


@reported
def export(
    run: str = typer.Argument(..., help="The run."),
    output: Path = typer.Option(
        ...,
        "--output",
        "-o",
        help="Where to write: a .safetensors file (or a directory, to write model.safetensors in it); "
        "a directory for --format hf.",
    ),
    export_format: ExportFormat = typer.Option(
        ExportFormat.SAFETENSORS,
        "--format",
        help="safetensors: the state_dict, loadable into the recipe's model; hf: a Hugging Face directory "
        "(config.json, model.safetensors and the dataset's tokenizer) for models of diloco_cli.models.hf.",
    ),
    region: str | None = typer.Option(None, help="Read the global weights from this region (default: the first)."),
    runs_dir: Path = RUNS_DIR,
) -> None:
    """Write the global weights, loadable into the recipe's model or with transformers."""
    from diloco_cli.launch.model import export_run
    from diloco_cli.launch.runs import load_run
    from diloco_cli.runtime.export import versions_label

    record = load_run(runs_dir, run)
    written, heads = export_run(record, output, export_format is ExportFormat.HF, region)
    typer.echo(
        f"wrote {written}: global {versions_label(heads)} of run {record.name} ({record.spec.recipe.model.factory})"
    )


@reported
def sample(
    run: str = typer.Argument(..., help="The run."),
    prompt: str = typer.Option("\n", "--prompt", "-p", help="Text to continue.", show_default="a new line"),
    length: int = typer.Option(
        300, "--length", "-n", min=1, max=MAX_SAMPLE_TOKENS, help="Tokens to generate (bytes, for a run on text)."
    ),
    temperature: float = typer.Option(
        0.8, parser=finite(minimum=0), help="Sampling temperature (0 picks the likeliest token)."
    ),
    top_k: int = typer.Option(40, "--top-k", min=0, help="Sample among the k likeliest tokens (0: among all)."),
    seed: int = typer.Option(0, min=0, max=MAX_SEED, help="Random seed."),
    past_end: bool = typer.Option(
        False,
        "--past-end",
        help="Go on past the end of the document (printing its end-of-document token) until --length tokens.",
    ),
    runs_dir: Path = RUNS_DIR,
) -> None:
    """Continue a prompt with the run's global model, to see what it has learned (a run on
    a token dataset encodes and decodes with the tokenizer its index names, and stops where
    the model ends the document, as the exported model's generate does)."""
    from diloco_cli.launch.model import sample_run
    from diloco_cli.launch.runs import load_run
    from diloco_cli.runtime.export import versions_label

    heads, sample = sample_run(load_run(runs_dir, run), prompt, length, temperature, top_k, seed, past_end)
    typer.echo(f"[global {versions_label(heads)}]", err=True)
    typer.echo(sample.text)
    if sample.ended:
        typer.echo(
            f"[end of document after {sample.new_tokens} tokens; --past-end goes on to --length {length}]", err=True
        )


def register(app: typer.Typer) -> None:
    app.command()(export)
    app.command()(sample)
