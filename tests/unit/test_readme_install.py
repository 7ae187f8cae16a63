"""The README shows the install and test commands that CI runs (every command it shows runs,
as written: tests/integration/test_readme.py)."""

from tests.support.readme import README, code_blocks, diloco_commands


def test_readme_shows_the_install_and_test_commands_that_ci_runs():
    blocks = "\n".join(code_blocks("bash"))
    ci = (README.parent / ".ci" / "run").read_text()
    assert (
        'pip install "torch==2.13.*" -e ".[test]"' in blocks
        and 'pip install --quiet "torch==2.13.*" -e ".[test]"' in ci
    )
    assert "python -m pytest" in blocks and "\npython -m pytest\n" in ci
    assert diloco_commands()[0] == "diloco up"
