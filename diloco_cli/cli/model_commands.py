"""Commands about the global model: export and sample."""

from __future__ import annotations

from pathlib import Path

import typer

from diloco_cli.cli.errors import reported
from diloco_cli.cli.runs_commands import RUNS_DIR


@reported
def export(
    run: str = typer.Argument(..., help="The run."),
    output: Path = typer.Option(..., "--output", "-o", help="Where to write the .safetensors file."),
    region: str | None = typer.Option(None, help="Read the global weights from this region (default: the first)."),
    runs_dir: Path = RUNS_DIR,
) -> None:
    """Write the global weights as safetensors, loadable into the recipe's model."""
    from diloco_cli.launch.runs import load_run
    from diloco_cli.runtime.export import export_safetensors

    record = load_run(runs_dir, run)
    head = export_safetensors(record.spec, record.secret(), output, region)
    typer.echo(f"wrote {output}: global version {head.version} of run {record.name} ({record.spec.recipe.model.factory})")


@reported
def sample(
    run: str = typer.Argument(..., help="The run."),
    prompt: str = typer.Option("\n", "--prompt", "-p", help="Text to continue.", show_default="a new line"),
    length: int = typer.Option(300, "--length", "-n", help="Bytes to generate."),
    temperature: float = typer.Option(0.8, help="Sampling temperature (0 picks the likeliest byte)."),
    top_k: int = typer.Option(40, "--top-k", help="Sample among the k likeliest bytes."),
    seed: int = typer.Option(0, help="Random seed."),
    runs_dir: Path = RUNS_DIR,
) -> None:
    """Continue a prompt with the run's global model, to see what it has learned."""
    from diloco_cli.launch.runs import load_run
    from diloco_cli.runtime.export import global_model, sample_text

    record = load_run(runs_dir, run)
    model, head = global_model(record.spec, record.secret())
    typer.echo(f"[global version {head.version}]", err=True)
    typer.echo(sample_text(model, prompt, length, temperature, top_k, seed))


def register(app: typer.Typer) -> None:
    app.command()(export)
    app.command()(sample)
