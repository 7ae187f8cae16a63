"""What ``diloco up`` checks before it starts anything, and ``up --dry-run`` the same:
the run's name, the files given, the buckets."""

from typer.testing import CliRunner

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
