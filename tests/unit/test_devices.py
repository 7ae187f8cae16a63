"""Each learner its own GPUs: a host's GPUs (its ``gpus`` list, else what ``nvidia-smi``
shows) shared out among its learners, refused when they need more, shown by the dry run
(the learners' environment: tests/integration/test_learner_gpus.py)."""

import os
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

from diloco_cli.cli.app import app
from diloco_cli.config.errors import ConfigError
from diloco_cli.config.loading import load_model
from diloco_cli.config.recipe import Recipe
from diloco_cli.config.regions import HostConfig, RegionsFile
from diloco_cli.launch.devices import device_environment, with_devices
from diloco_cli.launch.resolve import resolve_run
from tests.support.runs import write_yaml

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def two_cloud(tmp_path, gpus_per_host: int = 8):
    regions = load_model(RegionsFile, ROOT / "regions" / "two-cloud.yaml")
    recipe = Recipe.model_validate({"training": {"num_learners": regions.num_learners}})
    spec = resolve_run(recipe, regions, "gpus", tmp_path)
    found = {host.name: tuple(range(gpus_per_host)) for host in regions.remote_hosts()}
    return spec, regions, found


def test_the_two_cloud_host_gives_its_two_torchrun_groups_disjoint_gpus(tmp_path):
    """gpu-c runs 2 learners of 4 processes: GPUs 0-3 and 4-7, not 0-3 twice."""
    spec, regions, found = two_cloud(tmp_path)
    placed = {learner.id: learner.devices for learner in with_devices(spec, regions, found).learners}
    assert placed == {
        "aws-use1-0": (0, 1, 2, 3, 4, 5, 6, 7),
        "aws-use1-1": (0, 1, 2, 3, 4, 5, 6, 7),
        "gcp-euw4-0": (0, 1, 2, 3),
        "gcp-euw4-1": (4, 5, 6, 7),
    }
    learner = with_devices(spec, regions, found).learner("gcp-euw4-1")
    assert device_environment(learner) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}


def test_a_host_whose_learners_need_more_gpus_than_it_has_is_refused_in_one_line(tmp_path):
    spec, regions, found = two_cloud(tmp_path, gpus_per_host=4)
    with pytest.raises(ConfigError) as refused:
        with_devices(spec, regions, found)
    message = str(refused.value)
    assert message.startswith("host gpu-a: its 1 learner needs 8 GPUs, one per process; it has 4 (0, 1, 2, 3)")
    assert "lower learners or processes_per_learner there" in message and "\n" not in message


def test_single_process_learners_on_one_host_each_take_their_own_gpu_and_cpu_runs_take_none(tmp_path):
    regions = RegionsFile()  # 4 single-process learners on this machine
    spec = resolve_run(Recipe(), regions, "gpus", tmp_path)
    placed = with_devices(spec, regions, {"local": (0, 1, 2, 3, 4)})
    assert [learner.devices for learner in placed.learners] == [(0,), (1,), (2,), (3,)]
    assert all(learner.devices == () for learner in with_devices(spec, regions, {}).learners)  # no GPU here
    on_cpu = resolve_run(Recipe.model_validate({"training": {"device": "cpu"}}), regions, "cpu", tmp_path)
    assert all(learner.devices == () for learner in with_devices(on_cpu, regions, {"local": (0, 1)}).learners)


def test_a_gpus_list_names_gpus_the_host_has_and_cuda_visible_devices_is_not_set_by_hand():
    regions = RegionsFile.model_validate(
        {"regions": [{"name": "a", "bucket": "file:///tmp/a", "hosts": [{"learners": 1, "gpus": [2, 9]}]}]}
    )
    spec = resolve_run(Recipe.model_validate({"training": {"num_learners": 1}}), regions, "gpus", Path("/tmp"))
    with pytest.raises(ConfigError, match=r"host local: gpus lists 9, which nvidia-smi does not show there"):
        with_devices(spec, regions, {"local": (0, 1, 2, 3)})
    assert with_devices(spec, regions, {}).learners[0].devices == (2,)  # no nvidia-smi: the list is believed
    with pytest.raises(ValueError, match="sets CUDA_VISIBLE_DEVICES: diloco gives each learner its own GPUs"):
        HostConfig(name="gpu", address="10.0.0.1", env={"CUDA_VISIBLE_DEVICES": "0"})
    with pytest.raises(ValueError, match="gpus of host 'gpu' lists 0 more than once"):
        HostConfig(name="gpu", address="10.0.0.1", gpus=(0, 1, 0))


def fake_nvidia_smi(directory: Path, gpus: int) -> dict[str, str]:
    """A ``nvidia-smi`` that lists ``gpus`` GPUs, first on PATH."""
    directory.mkdir(exist_ok=True)
    script = directory / "nvidia-smi"
    script.write_text("#!/bin/sh\n" + "".join(f"echo {index}\n" for index in range(gpus)))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{directory}{os.pathsep}{os.environ['PATH']}"}


def test_dry_run_shows_each_learners_gpus_and_refuses_oversubscription(tmp_path, monkeypatch):
    runs_dir = tmp_path / "runs"
    for variable, value in fake_nvidia_smi(tmp_path / "bin", 4).items():
        monkeypatch.setenv(variable, value)
    shown = runner.invoke(app, ["up", "--dry-run", "--name", "plan", "--runs-dir", str(runs_dir)])
    assert shown.exit_code == 0, shown.output
    for learner, gpu in (("local-a-0", 0), ("local-a-1", 1), ("local-b-0", 2), ("local-b-1", 3)):
        assert f"learner {learner} on local, shard {gpu}, GPU {gpu}\n" in shown.output

    monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path / "bin2", 2)["PATH"])
    refused = runner.invoke(app, ["up", "--dry-run", "--name", "plan", "--runs-dir", str(runs_dir)])
    assert refused.exit_code == 2
    assert refused.output.strip() == (
        "error: host local: its 4 learners need 4 GPUs, one per process; it has 2 (0, 1); lower learners or "
        "processes_per_learner there, or list more GPUs in gpus:"
    )
    listed = write_yaml(
        tmp_path / "regions.yaml",
        {
            "regions": [
                {
                    "name": name,
                    "bucket": f"file://{tmp_path}/{name}",
                    "hosts": [{"learners": 2, "processes_per_learner": 2, "gpus": [1, 0]}],
                }
                for name in ("a", "b")
            ]
        },
    )
    monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path / "bin3", 0)["PATH"])
    refused = runner.invoke(app, ["up", "--regions", str(listed), "--dry-run", "--runs-dir", str(runs_dir)])
    assert refused.exit_code == 2 and "host local: its 4 learners need 8 GPUs, one per process; it has 2 (1, 0)" in (
        refused.output
    )
    assert not runs_dir.exists()
