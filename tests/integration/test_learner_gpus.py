"""Each learner its own GPUs, in the learners' real processes: two torchrun groups on one
host, given four GPUs by the region file, see two each (``CUDA_VISIBLE_DEVICES``), and
train to the end on this CPU machine (the pure share-out: tests/unit/test_devices.py)."""

from pathlib import Path

from tests.support.runs import (
    TINY_RECIPE,
    assert_bases_are_the_syncers,
    child_pid,
    diloco,
    wait_finished,
    wait_for,
    write_yaml,
)


def environment_of(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode().split("=", 1) for entry in entries if b"=" in entry)


def children_of(pid: int) -> list[int]:
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[1]) == pid:
                children.append(int(entry.name))
    return children


def test_two_torchrun_learners_on_one_host_see_disjoint_gpus(tmp_path):
    regions = write_yaml(
        tmp_path / "regions.yaml",
        {
            "regions": [
                {
                    "name": "east",
                    "bucket": f"file://{tmp_path}/buckets/east",
                    "hosts": [{"learners": 2, "processes_per_learner": 2, "gpus": [0, 1, 2, 3]}],
                }
            ]
        },
    )
    recipe = write_yaml(tmp_path / "recipe.yaml", TINY_RECIPE)
    runs_dir = tmp_path / "runs"
    shown = diloco("up", str(recipe), "--regions", str(regions), "--dry-run", "--runs-dir", str(runs_dir)).stdout
    assert "learner east-0 on local, shard 0, 2 processes (torchrun), GPUs 0,1" in shown
    assert "learner east-1 on local, shard 1, 2 processes (torchrun), GPUs 2,3" in shown

    diloco("up", str(recipe), "--regions", str(regions), "--name", "gpus", "--runs-dir", str(runs_dir))
    wait_for(runs_dir, "gpus", lambda status: all(row.step > 0 for row in status.learners), 180, "training")
    seen = {}
    for learner in ("east-0", "east-1"):
        launcher = child_pid(runs_dir, "gpus", learner)  # torchrun
        workers = children_of(launcher)
        assert len(workers) == 2, workers
        seen[learner] = {environment_of(pid)["CUDA_VISIBLE_DEVICES"] for pid in (launcher, *workers)}
    assert seen == {"east-0": {"0,1"}, "east-1": {"2,3"}}
    wait_finished(runs_dir, "gpus")
    assert_bases_are_the_syncers(runs_dir, "gpus")
