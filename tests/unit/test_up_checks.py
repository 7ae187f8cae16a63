"""What ``diloco up`` checks before it starts anything, and ``up --dry-run`` the same:
the run's name, the files given, the buckets."""

import json
import re

import pytest
from click.testing import CliRunner

from diloco_cli.cli.app import app
from tests.support.runs import write_yaml
from tests.support.runs_on_disk import made_run

runner = CliRunner()
ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def one_line_error(result) -> str:
    assert result.exit_code == 2 and result.stdout == "", result.output
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: "), result.stderr
    return result.stderr


def test_a_dry_run_refuses_a_name_the_real_one_refuses(tmp_path):
    runs_dir, _ = made_run(tmp_path)
    for dry_run in (["--dry-run"], []):
        refused = runner.invoke(app, ["up", "--name", "made", *dry_run, "--runs-dir", str(runs_dir)])
        assert "run made already exists in" in one_line_error(refused)


def test_a_dry_run_probes_the_buckets_and_leaves_nothing_behind(tmp_path):
    runs_dir = tmp_path / "runs"
    planned = runner.invoke(app, ["up", "--name", "fresh", "--dry-run", "--runs-dir", str(runs_dir)])
    assert planned.exit_code == 0 and planned.stdout.startswith("run fresh (dry run: nothing started)")
    assert not runs_dir.exists()  # its buckets were probed, and the folders the probes made removed
    (tmp_path / "a-file").write_text("not a folder")  # (a read-only folder would not stop root)
    regions = {"regions": [{"name": "east", "bucket": f"file://{tmp_path}/a-file/east", "hosts": [{"learners": 4}]}]}
    unwritable = write_yaml(tmp_path / "regions.yaml", regions)
    refused = runner.invoke(app, ["up", "--regions", str(unwritable), "--dry-run", "--runs-dir", str(runs_dir)])
    assert "region 'east' bucket: bucket file://" in one_line_error(refused)


def test_a_region_file_given_as_the_recipe_is_named_so_in_one_line(tmp_path):
    error = one_line_error(runner.invoke(app, ["up", str(ROOT / "regions/local.yaml"), "--dry-run"]))
    assert error.endswith(
        "(keys: regions, syncer, ssh) looks like a region file, not a recipe: give it with --regions\n"
    )
    error = one_line_error(runner.invoke(app, ["plan", "--regions", str(ROOT / "recipes/default.yaml")]))
    assert "looks like a recipe, not a region file" in error


def test_a_local_data_source_is_read_from_where_up_was_started_and_its_index_checked(tmp_path, monkeypatch):
    """The URL ``prepare`` prints, and the relative forms a user may type, reach the run's
    processes (which start in runs/<run>/) as absolute ones; and ``up`` reads the index as
    they do, so that what passes its checks runs."""
    from diloco_cli.data.learner import open_learner_data
    from diloco_cli.launch.up import resolve
    from tests.support.corpora import make_documents, write_text_corpus

    monkeypatch.chdir(tmp_path)
    write_text_corpus(tmp_path / "corpus.txt", make_documents(200))
    regions = str(ROOT / "regions/local.yaml")
    prepared = runner.invoke(app, ["prepare", "corpus.txt", "--regions", regions, "--vocab-size", "300"])
    assert prepared.exit_code == 0, prepared.output
    printed = re.search(r"--set data\.source=(\S+)", prepared.stdout).group(1)
    assert printed == f"file://{tmp_path}/runs/datasets/buckets/local-a/corpus/index.json"
    (tmp_path / "elsewhere").mkdir()
    relative = "runs/datasets/buckets/local-a/corpus/index.json"
    for given in (printed, f"file://{relative}", relative):
        monkeypatch.chdir(tmp_path)
        overrides = [f"data.source={given}", "model.kwargs.vocabulary_size=300"]
        spec, _, _ = resolve(None, None, overrides, "own", tmp_path / "runs")
        monkeypatch.chdir(tmp_path / "elsewhere")  # where a process starts
        data = open_learner_data(spec, spec.learners[0], rank=0, world_size=1)
        assert data.batch(0, 2)[0].shape == (2, 128), given
        data.close()

    monkeypatch.chdir(tmp_path)
    (tmp_path / "not-an-index.json").write_text('{"format": "diloco-tokens/2"}')
    for source in ("not-an-index.json", "runs/nothing/index.json"):
        refused = runner.invoke(app, ["up", "--set", f"data.source={source}", "--dry-run"])
        assert "error: the default recipe: data.source: " in one_line_error(refused)
    assert f"no dataset index at {tmp_path}/runs/nothing/index.json" in refused.stderr


def test_a_token_dataset_beyond_the_models_vocabulary_is_refused_before_anything_starts(tmp_path):
    """Token ids past the model's embedding failed in every learner's first step, after
    ``up`` had passed the run."""
    from tests.support.corpora import make_documents, write_text_corpus

    corpus = write_text_corpus(tmp_path / "corpus.txt", make_documents(200))
    assert (
        runner.invoke(app, ["prepare", str(corpus), "-o", str(tmp_path / "tokens"), "--vocab-size", "300"]).exit_code
        == 0
    )
    source = ["--set", f"data.source={tmp_path}/tokens/index.json", "--runs-dir", str(tmp_path / "runs"), "--dry-run"]
    refused = one_line_error(runner.invoke(app, ["up", *source]))
    assert refused == (
        "error: the default recipe: data.source: "
        f"the token dataset {tmp_path}/tokens/index.json has a vocabulary of 300 tokens, "
        "but the model embeds 256 (model.kwargs.vocabulary_size); set it to 300 or more, or prepare the dataset "
        "with a smaller --vocab-size\n"
    )
    llama = [
        "--set",
        "model.factory=diloco_cli.models.hf:causal_lm",
        "--set",
        "model.kwargs={config: 'builtin:tiny-llama'}",
    ]
    refused = one_line_error(runner.invoke(app, ["up", *source, *llama, "--set", "model.kwargs.vocab_size=299"]))
    assert "but the model embeds 299 (vocab_size of model.kwargs); set it to 300 or more" in refused
    for fitting in (["--set", "model.kwargs.vocabulary_size=300"], [*llama, "--set", "model.kwargs.vocab_size=300"]):
        planned = runner.invoke(app, ["up", *source, *fitting])
        assert planned.exit_code == 0, planned.output


def test_a_regions_own_copy_of_the_data_is_checked_as_its_learners_read_it(tmp_path, monkeypatch):
    from tests.support.corpora import make_documents, write_text_corpus

    monkeypatch.chdir(tmp_path)
    corpus = write_text_corpus(tmp_path / "corpus.txt", make_documents(200))
    assert runner.invoke(app, ["prepare", str(corpus), "-o", "tokens", "--vocab-size", "300"]).exit_code == 0
    regions = {
        "regions": [
            {"name": "east", "bucket": f"file://{tmp_path}/east", "hosts": [{"learners": 2}], "data_source": source}
            for source in ("tokens/index.json", "west-copy/index.json")
        ]
    }
    regions["regions"][1]["name"] = "west"
    arguments = ["up", "--regions", str(write_yaml(tmp_path / "regions.yaml", regions)), "--dry-run"]
    tokens = ["--set", "data.source=tokens/index.json", "--set", "model.kwargs.vocabulary_size=300"]
    refused = one_line_error(runner.invoke(app, [*arguments, *tokens, "--set", "training.num_learners=4"]))
    assert refused.startswith(f"error: {tmp_path}/regions.yaml: region 'west' data_source: no dataset index at ")
    assert f"{tmp_path}/west-copy/index.json" in refused


def test_a_ctrl_c_that_pydantic_wraps_while_the_run_spec_is_written_is_a_ctrl_c_again(tmp_path, monkeypatch):
    """pydantic turns a KeyboardInterrupt raised inside its serializer into a
    PydanticSerializationError (CI once saw `up` print that traceback when Ctrl-C came as
    the run's folder appeared); ``RunSpec.to_json`` gives the Ctrl-C back, so that `up`
    says "interrupted" and leaves nothing half-made."""
    from pydantic_core import PydanticSerializationError

    from diloco_cli.config.recipe import Recipe
    from diloco_cli.config.regions import RegionsFile
    from diloco_cli.launch.resolve import resolve_run
    from diloco_cli.store.run_spec import RunSpec
    from tests.support.interrupts import pydantic_wrapped_interrupt, raise_wrapped_interrupt

    error = pydantic_wrapped_interrupt()  # what pydantic does
    assert isinstance(error, PydanticSerializationError) and "KeyboardInterrupt" in str(error)
    spec = resolve_run(Recipe(), RegionsFile(), "interrupted", tmp_path)
    assert json.loads(spec.to_json())["run"] == "interrupted"
    monkeypatch.setattr(RunSpec, "model_dump_json", raise_wrapped_interrupt)
    with pytest.raises(KeyboardInterrupt):
        spec.to_json()
