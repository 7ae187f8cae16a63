"""Whole runs through the real CLI, processes and buckets: file://, S3, GCS and mixed."""

import json
from contextlib import ExitStack

import pytest
import torch
from safetensors.torch import load_file

from diloco_cli.launch.runs import load_run
from diloco_cli.models.gpt import byte_gpt
from testbed.servers import fake_gcs_server, moto_s3_server
from tests.support.runs import (
    TINY_RECIPE,
    assert_bases_are_the_syncers,
    assert_every_token_accounted,
    deep_update,
    diloco,
    heartbeats,
    wait_finished,
    wait_processes_gone,
    write_yaml,
)

pytestmark = pytest.mark.slow


def finished_status(runs_dir, run):
    status = json.loads(diloco("status", run, "--output", "json", "--runs-dir", str(runs_dir)).stdout)
    assert status["state"] == "finished"
    assert status["version"] >= 4
    assert all(learner["state"] == "finished" for learner in status["learners"])
    losses = [evaluation["loss"] for evaluation in status["evaluations"]]
    assert losses[-1] < losses[0] - 1.0, losses  # the global model learned (from ~5.5 nats)
    return status


def test_local_file_run_with_a_two_process_learner(tmp_path):
    runs_dir = tmp_path / "runs"
    recipe = write_yaml(tmp_path / "tiny.yaml", TINY_RECIPE)
    regions = write_yaml(
        tmp_path / "regions.yaml",
        {
            "regions": [
                {
                    "name": "east",
                    "bucket": f"file://{tmp_path}/buckets/east",
                    "hosts": [{"name": "local", "learners": 1, "processes_per_learner": 2}],
                },
                {
                    "name": "west",
                    "bucket": f"file://{tmp_path}/buckets/west",
                    "hosts": [{"name": "local", "learners": 1}],
                },
            ]
        },
    )
    started = diloco("up", str(recipe), "--regions", str(regions), "--name", "e2e-file", "--runs-dir", str(runs_dir))
    assert "started run e2e-file" in started.stdout and "diloco down e2e-file" in started.stdout
    wait_finished(runs_dir, "e2e-file")
    status = finished_status(runs_dir, "e2e-file")
    assert {learner["learner"]: learner["region"] for learner in status["learners"]} == {
        "east-0": "east",
        "west-0": "west",
    }
    assert all(region["learners_up"] > 0 and region["syncer_up"] > 0 for region in status["regions"])
    # the two-process learner trained with torch.distributed: both ranks logged, rank 0 sent
    log = (runs_dir / "e2e-file" / "logs" / "east-0.log").read_text()
    assert "torch.distributed.run" in log and "finished at step 40" in log
    # the global weights export and load into the recipe's model, from either region
    for region in ("east", "west"):
        output = tmp_path / f"model-{region}.safetensors"
        diloco("export", "e2e-file", "-o", str(output), "--region", region, "--runs-dir", str(runs_dir))
        model = byte_gpt(num_layers=2, width=64, num_heads=2, context=64)
        model.load_state_dict(load_file(str(output)))
    east, west = (
        load_file(str(tmp_path / "model-east.safetensors")),
        load_file(str(tmp_path / "model-west.safetensors")),
    )
    assert all(torch.equal(east[name], west[name]) for name in east)  # every region holds the same weights, bit for bit
    sample = diloco("sample", "e2e-file", "--prompt", "ROMEO:", "-n", "40", "--runs-dir", str(runs_dir))
    assert sample.stdout.startswith("ROMEO:") and len(sample.stdout) > 40
    listing = diloco("runs", "--runs-dir", str(runs_dir))
    assert "e2e-file" in listing.stdout
    stopped = diloco("down", "e2e-file", "--runs-dir", str(runs_dir))
    assert "run e2e-file is finished: nothing of it was running" in stopped.stdout  # as `runs` says it
    wait_processes_gone(runs_dir, "e2e-file")
    # a finished learner keeps one checkpoint; `rm` removes the run everywhere
    record = load_run(runs_dir, "e2e-file")
    assert len(record.spec.bucket("east", record.secret()).checkpoint_keys("east-0")) == 1
    planned = diloco("rm", "--older-than", "0", "--dry-run", "--runs-dir", str(runs_dir)).stdout
    assert f"would remove run e2e-file: {runs_dir / 'e2e-file'}; file://{tmp_path}/buckets/east/e2e-file" in planned
    assert (tmp_path / "buckets" / "east" / "e2e-file").exists()
    removed = diloco("rm", "e2e-file", "--runs-dir", str(runs_dir)).stdout
    assert "removed run e2e-file" in removed and "left alone" not in removed
    assert not (tmp_path / "buckets" / "east" / "e2e-file").exists() and not (runs_dir / "e2e-file").exists()
    assert "no runs in" in diloco("runs", "--runs-dir", str(runs_dir)).stdout


BACKENDS = {"s3": moto_s3_server, "gcs": fake_gcs_server}


def test_a_sharded_learner_with_gradient_accumulation_keeps_the_ledger_exact(tmp_path):
    """A learner of two FSDP2 processes (gloo) that accumulates gradients over
    micro-batches, beside a one-process learner: every token is accounted for and its
    final bases are the syncer's weights bit for bit (sends gather the shards, installs
    scatter them back)."""
    runs_dir = tmp_path / "runs"
    recipe = write_yaml(
        tmp_path / "fsdp.yaml", deep_update(TINY_RECIPE, {"training": {"parallelism": "fsdp", "micro_batch_size": 2}})
    )
    regions = write_yaml(
        tmp_path / "regions.yaml",
        {
            "regions": [
                {
                    "name": "east",
                    "bucket": f"file://{tmp_path}/buckets/east",
                    "hosts": [{"name": "local", "learners": 1, "processes_per_learner": 2}],
                },
                {
                    "name": "west",
                    "bucket": f"file://{tmp_path}/buckets/west",
                    "hosts": [{"name": "local", "learners": 1}],
                },
            ]
        },
    )
    diloco("up", str(recipe), "--regions", str(regions), "--name", "e2e-fsdp", "--runs-dir", str(runs_dir))
    wait_finished(runs_dir, "e2e-fsdp")
    finished_status(runs_dir, "e2e-fsdp")
    assert_every_token_accounted(runs_dir, "e2e-fsdp", heartbeats(runs_dir, "e2e-fsdp"))
    assert_bases_are_the_syncers(runs_dir, "e2e-fsdp")


def test_run_over_real_object_stores(tmp_path, monkeypatch):
    """One region's bucket in S3 (moto), the other's in GCS (fake-gcs-server): both
    backends in one run, each with its own credentials."""
    backends = ("s3", "gcs")
    runs_dir = tmp_path / "runs"
    with ExitStack() as stack:
        servers = {kind: stack.enter_context(BACKENDS[kind]()) for kind in set(backends)}
        env = {}
        for server in servers.values():
            env.update(server.env)
        for variable, value in env.items():  # credentials reach this process as they reach learners
            monkeypatch.setenv(variable, value)
        regions = []
        for index, kind in enumerate(backends):
            server = servers[kind]
            bucket = server.create_bucket(f"diloco-region-{index}")
            options = {key: value for key, value in server.storage_options.items() if key not in ("key", "secret")}
            regions.append(
                {
                    "name": f"r{index}",
                    "bucket": bucket,
                    "storage_options": options,
                    "hosts": [{"name": "local", "learners": 1}],
                }
            )
        regions_file = write_yaml(tmp_path / "regions.yaml", {"regions": regions})
        recipe = write_yaml(tmp_path / "tiny.yaml", deep_update(TINY_RECIPE, {"training": {"inner_steps": 30}}))
        name = "e2e-" + "-".join(backends)
        diloco("up", str(recipe), "--regions", str(regions_file), "--name", name, "--runs-dir", str(runs_dir), env=env)
        wait_finished(runs_dir, name)
        status = json.loads(diloco("status", name, "-o", "json", "--runs-dir", str(runs_dir), env=env).stdout)
        assert status["state"] == "finished" and status["version"] >= 3
        # the objects really are in the object stores: each region's bucket holds its learner's traffic
        spec = load_run(runs_dir, name).spec
        for region, kind in zip(spec.regions, backends):
            assert region.root.startswith(f"{kind if kind == 's3' else 'gs'}://")
            files = servers[kind].filesystem().find(region.root.split("://", 1)[1])
            assert any("/global/snapshots/" in path for path in files)
            assert any("/heartbeats/" in path for path in files)
        output = tmp_path / "model.safetensors"
        diloco("export", name, "-o", str(output), "--runs-dir", str(runs_dir), env=env)
        byte_gpt(num_layers=2, width=64, num_heads=2, context=64).load_state_dict(load_file(str(output)))
        wait_processes_gone(runs_dir, name)
