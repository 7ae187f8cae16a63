"""Every path of the repository that the help texts, the README and the docs name exists:
a pointer to ``docs/chaos.md`` that is not there sends a reader nowhere."""

import re
from pathlib import Path

import click
from click.testing import CliRunner

from diloco_cli.cli.app import app

ROOT = Path(__file__).resolve().parents[2]
NAMED = re.compile(r"(?<![\w./-])((?:docs|recipes|regions|bench|tests|diloco_cli|examples|\.ci)/[\w./*-]*[\w*])")
"""A path of the repository as the texts name it (``docs/resilience.md``, ``bench/wan.py``,
``recipes/*.yaml``: a pattern that must match something)."""
LINK = re.compile(r"\]\(([^)\s]+)\)")
"""A markdown link's target."""
PLACEHOLDERS = ("<", "NAME", "RUN", "{")


def help_texts() -> dict[str, str]:
    """``diloco [COMMAND...] --help`` of every command a user can type."""
    runner = CliRunner()
    texts = {}

    def add(group: click.Group, path: list[str]) -> None:
        texts[" ".join(["diloco", *path])] = runner.invoke(app, [*path, "--help"]).output
        for name, command in group.commands.items():
            if command.hidden:
                continue
            if isinstance(command, click.Group):
                add(command, [*path, name])
            else:
                texts[" ".join(["diloco", *path, name])] = runner.invoke(app, [*path, name, "--help"]).output

    add(app, [])
    return texts


def missing_paths(text: str, relative_to: Path) -> list[str]:
    """Paths named in ``text`` (from the repository's root) and links (from
    ``relative_to``) that are not in the repository."""
    missing = []
    joined = " ".join(text.split("\n"))  # help texts wrap lines; a path never holds a space
    for path in NAMED.findall(joined):
        if not any(mark in path for mark in PLACEHOLDERS) and not any(ROOT.glob(path)):
            missing.append(path)
    for target in LINK.findall(text):
        target = target.split("#", 1)[0]
        if target and "://" not in target and not target.startswith("mailto:"):
            if not (relative_to / target).exists():
                missing.append(target)
    return missing


def test_the_help_texts_name_only_paths_that_exist():
    missing = {command: paths for command, text in help_texts().items() if (paths := missing_paths(text, ROOT))}
    assert not missing, missing


def test_the_readme_and_the_docs_name_only_paths_that_exist():
    documents = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(ROOT.glob("*/**/README.md"))]
    missing = {
        str(document.relative_to(ROOT)): paths
        for document in documents
        if (paths := missing_paths(document.read_text(), document.parent))
    }
    assert not missing, missing


def test_the_check_sees_a_missing_path_a_missing_link_and_an_empty_pattern():
    text = "see docs/none.md, [this](nope.md#part), recipes/*.yaml, bench/*.nothing and docs/<name>.md"
    assert missing_paths(text, ROOT / "docs") == ["docs/none.md", "bench/*.nothing", "nope.md"]
