"""The README shows the install and test commands that CI runs (every command it shows runs,
as written: tests/integration/test_readme.py)."""

from tests.support.readme import README, code_blocks, diloco_commands


def test_readme_shows_the_install_and_test_commands_that_ci_runs():
    blocks = "\n".join(code_blocks("bash"))
    ci = (README.parent / ".ci" / "run").read_text()
    assert (
        'pip install "torch==2.13.*" -e ".[test]"\npython -m pytest' in blocks
        and 'pip install --quiet "torch==2.13.*" -e ".[test]"' in ci
    )
    assert "python -m pytest" in blocks and "\npython -m pytest\n" in ci
    assert diloco_commands()[0] == "diloco up"


def test_a_user_installs_the_tool_without_the_test_extras():
    """The quick start's install is the tool alone (pytest, moto, selenium and the rest are for
    running the tests); the test extras come with the test command."""
    first = next(line for line in "\n".join(code_blocks("bash")).splitlines() if line.startswith("pip install"))
    assert first == 'pip install "torch==2.13.*" -e .'


def test_the_readme_is_a_front_door_that_links_to_the_docs():
    """At most 250 lines, like its anchors' (torchtitan, nanochat, SkyPilot): the sections a
    newcomer needs, and the benchmarks as one summary table whose every row says whether
    its target was met, with the full tables in docs/benchmarks.md."""
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    sections = [line[3:] for line in text.splitlines() if line.startswith("## ")]
    for kept in ("Quick start", "Multi-region", "Your data", "Concepts", "Commands", "When things fail", "Benchmarks"):
        assert any(section.startswith(kept) for section in sections), kept
    benchmarks = text.split("## Benchmarks\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in benchmarks.splitlines() if line.startswith("| ") and not line.startswith("| benchmark")]
    assert len(rows) >= 10 and "[docs/benchmarks.md](docs/benchmarks.md)" in benchmarks
    assert all(("met" in row.split("|")[4]) or ("missed" in row.split("|")[4]) for row in rows), rows
    full = (README.parent / "docs" / "benchmarks.md").read_text()
    for table in ("| codec | zstd | ratio (real) |", "| fragment | M | round |", "| commits | since checkpoint |"):
        assert table in full and table not in text  # the full tables moved
