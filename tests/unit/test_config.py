"""Recipes and region files: the shipped files, and every mistake reported clearly."""

from pathlib import Path

import pytest
from click.testing import CliRunner

from diloco_cli.cli.app import app
from diloco_cli.config.loading import ConfigError, load_model
from diloco_cli.config.recipe import Recipe
from diloco_cli.config.regions import RegionsFile
from tests.support.runs import write_yaml

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def test_shipped_default_files_spell_out_the_built_in_defaults():
    assert load_model(Recipe, ROOT / "recipes" / "default.yaml") == Recipe()
    assert load_model(RegionsFile, ROOT / "regions" / "local.yaml") == RegionsFile()


def test_the_default_recipe_spells_out_every_field_of_the_recipe_model():
    """recipes/default.yaml "spells out every key": each field of the recipe model, at
    every depth, whatever the fields become (issue 32, 3)."""
    import yaml
    from pydantic import BaseModel

    def missing(model: type[BaseModel], written: dict, where: str) -> list[str]:
        found = []
        for name, field in model.model_fields.items():
            if name not in written:
                found.append(f"{where}{name}")
            elif isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                found += missing(field.annotation, written[name], f"{where}{name}.")
        return found

    written = yaml.safe_load((ROOT / "recipes" / "default.yaml").read_text())
    assert missing(Recipe, written, "") == []


def test_every_shipped_recipe_and_region_file_is_valid():
    for path in (ROOT / "recipes").glob("*.yaml"):
        load_model(Recipe, path)
    for path in (ROOT / "regions").glob("*.yaml"):
        load_model(RegionsFile, path)


def test_defaults_describe_the_default_job():
    recipe, regions = Recipe(), RegionsFile()
    assert recipe.training.num_learners == regions.num_learners == 4
    assert [r.name for r in regions.regions] == ["local-a", "local-b"]
    assert recipe.quorum == 4 and recipe.outer_learning_rate == 1.0
    assert Recipe.model_validate({"sync": {"quorum": 1}}).outer_learning_rate == 0.5  # auto = sqrt(K/M)
    assert Recipe.model_validate({"sync": {"quorum": 2}, "training": {"num_learners": 8}}).outer_learning_rate == 0.5


def test_overrides_take_precedence_and_are_validated(tmp_path):
    path = write_yaml(tmp_path / "r.yaml", {"training": {"inner_steps": 50}})
    recipe = load_model(Recipe, path, ["training.inner_steps=70", "sync.quorum=2"])
    assert recipe.training.inner_steps == 70 and recipe.quorum == 2
    with pytest.raises(ConfigError, match="r.yaml with --set sync.quorum=9: .*cannot exceed training.num_learners M=4"):
        load_model(Recipe, path, ["sync.quorum=9"])
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_model(Recipe, path, ["training.inner_steps"])


def up_fails(tmp_path, *arguments):
    runs_dir = tmp_path / "runs"
    result = runner.invoke(app, ["up", *arguments, "--runs-dir", str(runs_dir)])
    assert result.exit_code == 2, result.output
    assert not runs_dir.exists() or not any(runs_dir.iterdir()), "something was created"
    return result.output


def test_unknown_key_names_file_key_and_what_is_allowed(tmp_path):
    path = write_yaml(tmp_path / "bad.yaml", {"trainig": {"inner_steps": 10}})
    output = up_fails(tmp_path, str(path))
    assert (
        f"error: {path}: unknown key 'trainig' (allowed here: data, model, name, storage, sync, training); "
        "did you mean 'training'?" in output
    )


def test_nested_unknown_key_and_wrong_type_are_both_reported(tmp_path):
    path = write_yaml(tmp_path / "bad.yaml", {"training": {"inner_step": 10, "batch_size": "big"}})
    output = up_fails(tmp_path, str(path))
    assert "training.batch_size: Input should be a valid integer" in output and "(got 'big')" in output
    assert "unknown key 'training.inner_step' (allowed here:" in output and "inner_steps" in output


def test_unknown_keys_inside_lists_list_what_is_allowed_and_the_close_match(tmp_path):
    regions = write_yaml(
        tmp_path / "regions.yaml",
        {"regions": [{"name": "east", "bucket": f"file://{tmp_path}/b", "hosts": [{"learnerz": 4}]}]},
    )
    output = " ".join(up_fails(tmp_path, "--regions", str(regions)).split())
    assert f"{regions}: unknown key 'regions.0.hosts.0.learnerz' (allowed here: address, env," in output
    assert "did you mean 'learners'?" in output


def test_a_yaml_syntax_error_names_the_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("name: x\ntraining:\n  inner_steps: [1\n")
    output = up_fails(tmp_path, str(path))
    assert output == (  # one line, with where the mistake is
        f"error: {path}: not valid YAML at line 4, column 1: expected ',' or ']', but got '<stream end>' "
        "(parsing a flow sequence from line 3)\n"
    )


def test_missing_data_file_is_named(tmp_path):
    path = write_yaml(tmp_path / "bad.yaml", {"data": {"source": f"file://{tmp_path}/corpus.txt"}})
    output = up_fails(tmp_path, str(path))
    assert f"{path}: data.source 'file://{tmp_path}/corpus.txt': no such file" in output


def test_a_bucket_that_cannot_be_written_is_named_before_anything_starts(tmp_path):
    regions = write_yaml(
        tmp_path / "regions.yaml",
        {
            "regions": [
                {"name": "good", "bucket": f"file://{tmp_path}/good", "hosts": [{"learners": 2}]},
                {"name": "broken", "bucket": "file:///proc/diloco-cannot-write-here", "hosts": [{"learners": 2}]},
            ]
        },
    )
    output = up_fails(tmp_path, "--regions", str(regions))
    assert f"{regions}: region 'broken' bucket: bucket file:///proc/diloco-cannot-write-here" in output
    assert "cannot be written, read and deleted" in output


def test_learner_count_mismatch_names_both_files(tmp_path):
    regions = write_yaml(
        tmp_path / "regions.yaml",
        {"regions": [{"name": "only", "bucket": f"file://{tmp_path}/b", "hosts": [{"learners": 3}]}]},
    )
    output = up_fails(tmp_path, "--regions", str(regions))
    assert "the regions place 3 learners" in output and "the default recipe sets training.num_learners: 4" in output


def test_credentials_may_not_be_written_into_a_region_file(tmp_path):
    regions = write_yaml(
        tmp_path / "regions.yaml",
        {
            "regions": [
                {
                    "name": "s3",
                    "bucket": "s3://b",
                    "storage_options": {"key": "AKIA...", "secret": "xyz"},
                    "hosts": [{"learners": 4}],
                }
            ]
        },
    )
    output = up_fails(tmp_path, "--regions", str(regions))
    assert "hold credentials (key, secret)" in output and "environment" in output
    assert "AKIA" not in output.replace("'AKIA...'", "")


def test_dry_run_prints_the_plan_and_starts_nothing(tmp_path):
    runs_dir = tmp_path / "runs"
    result = runner.invoke(app, ["up", "--dry-run", "--name", "plan", "--runs-dir", str(runs_dir)])
    assert result.exit_code == 0, result.output
    assert "run plan (dry run: nothing started)" in result.output
    assert "learner local-b-1 on local, shard 3" in result.output
    assert "inner_steps: 300" in result.output
    assert not runs_dir.exists()


def test_secrets_in_host_environment_or_data_options_are_refused(tmp_path):
    from diloco_cli.config.regions import HostConfig

    with pytest.raises(ValueError, match="env of host 'gpu' sets AWS_SECRET_ACCESS_KEY: secrets stay on the host"):
        HostConfig(name="gpu", address="10.0.0.1", env={"AWS_SECRET_ACCESS_KEY": "x", "AWS_PROFILE": "ok"})
    assert HostConfig(name="gpu", address="10.0.0.1", env={"AWS_SHARED_CREDENTIALS_FILE": "/etc/aws"}).env
    with pytest.raises(ValueError, match=r"data.storage_options hold credentials \(secret\)"):
        Recipe.model_validate({"data": {"storage_options": {"secret": "x"}}})
    path = write_yaml(
        tmp_path / "regions.yaml",
        {
            "regions": [
                {"name": "a", "bucket": "gs://b", "storage_options": {"token": "anon"}, "hosts": [{"learners": 4}]}
            ]
        },
    )
    assert load_model(RegionsFile, path).regions[0].storage_options == {"token": "anon"}  # a mode, not a credential


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        (
            {
                "factory": "diloco_cli.models.hf:causal_lm",
                "kwargs": {"config": {"model_type": "gpt2", "n_positions": 64}},
            },
            "data.sequence_length 128 exceeds the model's 64 positions (n_positions of model.kwargs.config)",
        ),
        (
            {
                "factory": "diloco_cli.models.hf:causal_lm",
                "kwargs": {"config": "builtin:tiny-llama", "max_position_embeddings": 64},
            },
            "data.sequence_length 128 exceeds the model's 64 positions (max_position_embeddings of model.kwargs)",
        ),
        (
            {"factory": "diloco_cli.models.gpt:byte_gpt", "kwargs": {"num_layers": 2}},
            "data.sequence_length 256 exceeds the model's 128 positions (model.kwargs.context (the built-in GPT's",
        ),
    ],
    ids=["gpt2-n_positions", "llama-rope", "built-in-default"],
)
def test_a_sequence_longer_than_the_models_context_is_refused_at_dry_run(tmp_path, model, expected):
    """GPT-2 would crash the syncer at its first evaluation, a Llama would train silently on
    positions it was not made for: both are refused before anything starts."""
    length = 256 if model["factory"].endswith("byte_gpt") else 128
    recipe = write_yaml(tmp_path / "recipe.yaml", {"model": model, "data": {"sequence_length": length}})
    output = up_fails(tmp_path, str(recipe), "--dry-run")
    assert f"{recipe}: {expected}" in output and "lower data.sequence_length to" in output
    assert output.strip().count("\n") == 0


def test_nan_and_infinity_are_refused_in_one_line_per_key(tmp_path):
    """A recipe's numbers are finite: a learning rate of inf trained garbage; a value that
    fits none of a key's kinds (a number or 'auto') is one line, not one per kind."""
    output = up_fails(
        tmp_path, "--dry-run", "--set", "training.learning_rate=inf", "--set", "sync.outer_learning_rate=nan"
    )
    lines = output.strip().splitlines()
    assert len(lines) == 2, output
    assert lines[0].endswith("training.learning_rate: Input should be a finite number (got 'inf')")
    assert lines[1].endswith("sync.outer_learning_rate: Input should be a finite number or 'auto' (got 'nan')")
