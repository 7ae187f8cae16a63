"""The two files a user writes, a recipe and a region file, each read with errors that
tell one from the other."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from diloco_cli.config.loading import load_model
from diloco_cli.config.recipe import Recipe
from diloco_cli.config.regions import RegionsFile


def load_recipe(path: Path | None, overrides: Sequence[str] = ()) -> Recipe:
    """The recipe at ``path`` (the default recipe when None) with ``--set`` overrides."""
    return load_model(
        Recipe,
        path,
        overrides,
        default_name="the default recipe",
        look_alikes={RegionsFile: "a region file, not a recipe: give it with --regions"},
    )


def load_regions(path: Path | None) -> RegionsFile:
    """The region file at ``path`` (the default regions, two local ones, when None)."""
    return load_model(
        RegionsFile,
        path,
        default_name="the default regions",
        look_alikes={Recipe: "a recipe, not a region file: give it as the recipe (diloco up RECIPE)"},
    )
