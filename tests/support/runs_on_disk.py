"""Runs on disk that nothing executes: a run's record, secret and manifests, and the
documents (heartbeats, the syncer's status) a running run would write into its buckets.
What the views (``runs``, ``status``, ``export``) are tested on without starting anything."""

import time

from diloco_cli.config.recipe import Recipe
from diloco_cli.config.regions import RegionsFile
from diloco_cli.launch.resolve import create_run_directory, resolve_run, write_manifests
from diloco_cli.store.documents import Evaluation, Head, Heartbeat, LastMerge, SyncerStatus
from diloco_cli.store.metering import StorageCounters, Traffic


def made_run(tmp_path):
    """A run on disk that nothing executes (record, secret, manifests)."""
    runs_dir = tmp_path / "runs"
    spec = resolve_run(Recipe(), RegionsFile(), "made", runs_dir)
    run_dir, _ = create_run_directory(runs_dir, spec, launcher="local")
    write_manifests(spec)
    return runs_dir, run_dir


def make_run(tmp_path, name="viewed"):
    runs_dir = tmp_path / "runs"
    spec = resolve_run(Recipe(), RegionsFile(), name, runs_dir)
    _, SECRETS[spec.run] = create_run_directory(runs_dir, spec, launcher="local")
    write_manifests(spec)
    return runs_dir, spec


def beat(spec, learner, step, state="training", loss=2.5, secret=None):
    region = spec.learner(learner).region
    bucket = spec.bucket(region, secret or run_secret(spec))
    bucket.write_heartbeat(
        Heartbeat(
            learner=learner,
            region=region,
            host="local",
            pid=1,
            state=state,
            step=step,
            total_steps=400,
            tokens=step * 2048,
            loss=loss,
            step_seconds=0.5,
            base_versions={0: 3, 1: 4},
            restarts=1 if learner == "local-b-1" else 0,
            epoch=1,
            storage=StorageCounters(
                kinds={
                    "payload": Traffic(bytes_up=1_500_000, bytes_down=300_000, raw_bytes=12_000_000),
                    "checkpoint": Traffic(bytes_up=9_000_000),
                },
                retries=2,
            ),
            started_at=0.0,
            time=time.time(),
        )
    )


SECRETS = {}


def run_secret(spec):
    return SECRETS[spec.run]


def syncer_status(spec, state="running", reason="grace window: 1.8 s left for 2 more learners (2 arrived)"):
    now = time.time()
    status = SyncerStatus(
        state=state,
        run=spec.run,
        version=7,
        fragment_versions={0: 6, 1: 7},
        snapshot_version=0,
        merges=7,
        merges_per_minute=3,
        last_merge=LastMerge(fragment=1, version=7, learners=["local-a-0", "local-b-0"], seconds=0.2, time=now - 3),
        quorum=4,
        effective_quorum=3,
        grace_seconds=1.8,
        live_learners=["local-a-0", "local-a-1", "local-b-0"],
        reasons={0: reason, 1: "1 of K=3 arrived; waiting"},
        evaluations=[
            Evaluation(version=0, loss=5.5, tokens=0, time=now),
            Evaluation(version=6, loss=2.71, tokens=400000, time=now),
        ],
        parameters=842_496,
        place=spec.syncer_shards[0].place,  # where a run's syncer says it is (the default job: local-a)
        storage={
            "local-a": StorageCounters(
                kinds={
                    "update": Traffic(bytes_up=2_000_000, raw_bytes=8_000_000),
                    "payload": Traffic(bytes_down=900_000),
                }
            ),
            "local-b": StorageCounters(
                kinds={
                    "update": Traffic(bytes_up=2_000_000, raw_bytes=8_000_000),
                    "payload": Traffic(bytes_down=800_000),
                },
                retries=5,
            ),
        },
        started_at=now - 100,
        time=now,
    )
    for bucket in spec.buckets(run_secret(spec)):
        bucket.write_syncer_status(status)
        bucket.write_head(Head(version=7, fragment_versions={0: 6, 1: 7}, snapshot_version=0, recent=(), recent_from=0))


def published_run(tmp_path, name="made", recipe=None, finished=False):
    """A run on disk whose global weights (version 0) are published in every region, as
    its syncer leaves them when it starts (and, ``finished``, its status says it
    finished); nothing runs.  What ``export`` and ``sample`` read."""
    from diloco_cli.launch.runs import load_run
    from diloco_cli.runtime.syncer.loop import Syncer
    from diloco_cli.store.documents import SyncerPhase

    runs_dir = tmp_path / "runs"
    spec = resolve_run(recipe or Recipe(), RegionsFile(), name, runs_dir)
    create_run_directory(runs_dir, spec, launcher="local")
    write_manifests(spec)
    record = load_run(runs_dir, name)
    syncer = Syncer(record.spec, record.secret())
    syncer.start()
    if finished:
        syncer.write_status(SyncerPhase.FINISHED)
    return runs_dir, record.directory
