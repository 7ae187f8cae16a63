"""``diloco export`` and ``diloco sample`` on a run whose global weights are published
(the Hugging Face format: tests/unit/test_hf_models.py)."""

import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from diloco_cli.cli.app import app
from diloco_cli.config.recipe import Recipe
from diloco_cli.models.gpt import byte_gpt
from tests.support.runs_on_disk import published_run

runner = CliRunner()


def test_export_into_a_directory_writes_model_safetensors_in_it(tmp_path):
    runs_dir, _ = published_run(tmp_path)
    directory = tmp_path / "exported"
    directory.mkdir()
    result = runner.invoke(app, ["export", "made", "-o", str(directory), "--runs-dir", str(runs_dir)])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"wrote {directory / 'model.safetensors'}: global version 0 of run made")
    byte_gpt().load_state_dict(load_file(directory / "model.safetensors"))  # every key, loadable
    a_file = tmp_path / "weights.bin"
    a_file.write_bytes(b"x")
    refused = runner.invoke(app, ["export", "made", "--format", "hf", "-o", str(a_file), "--runs-dir", str(runs_dir)])
    assert refused.exit_code == 2 and refused.stderr.count("\n") == 1
    assert f"-o {a_file}: a file is there; --format hf writes a directory" in refused.stderr


def test_sample_uses_the_threads_a_learner_gets_here(tmp_path):
    """torch's default (every core) made ``sample -n 100`` 3-4x slower on a machine busy
    training; it takes a learner's share, and the recipe's ``threads_per_learner``."""
    recipe = Recipe.model_validate({"training": {"threads_per_learner": 3}})
    runs_dir, _ = published_run(tmp_path, recipe=recipe)
    try:
        torch.set_num_threads(1)
        result = runner.invoke(app, ["sample", "made", "-n", "3", "--prompt", "ROMEO:", "--runs-dir", str(runs_dir)])
        assert result.exit_code == 0 and result.stdout.startswith("ROMEO:"), result.output
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(1)  # as tests/conftest.py has it
