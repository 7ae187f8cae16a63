"""Whole runs under slow, failing and damaged storage: real learners and syncer
processes, real S3 (moto) behind the fault proxy, real file:// buckets damaged at rest.

Every run is checked the same way: the ledger (nothing merged twice, each learner's last
send merged), and every learner's bases in its final checkpoint equal, bit for bit, the
syncer's weights at those versions (the digests its commit records hold).
"""

import json
import os
import re
import signal
import time

import pytest

from diloco_cli.launch.runs import load_run
from testbed.fault_proxy import FaultRules, fault_proxy
from tests.support.runs import (
    TINY_RECIPE,
    assert_bases_are_the_syncers,
    assert_every_token_accounted,
    audit_ledger,
    child_pid,
    deep_update,
    diloco,
    final_checkpoint,
    heartbeats,
    logs_of,
    wait_finished,
    wait_for,
    wait_processes_gone,
    write_yaml,
)

pytestmark = pytest.mark.slow


def s3_regions(tmp_path, servers, proxies, learners=(1, 1)):
    regions = []
    for index, (server, proxy) in enumerate(zip(servers, proxies)):
        bucket = server.create_bucket(f"durable-{index}-{time.monotonic_ns()}")
        endpoint = proxy.url if proxy else server.endpoint_url
        regions.append(
            {
                "name": f"r{index}",
                "bucket": bucket,
                "storage_options": {"endpoint_url": endpoint},
                "hosts": [{"name": "local", "learners": learners[index]}],
            }
        )
    return write_yaml(tmp_path / "regions.yaml", {"regions": regions})


def test_slow_fetches_with_fast_steps_never_apply_an_update_twice(tmp_path, s3):
    """Every GET of a global object takes 1.2 s, a step a few milliseconds: polls finish
    long after the next one would be due.  Each install is checked against the head's
    digest by the learner, and the final bases against the syncer's commits by us."""
    runs_dir, name = tmp_path / "runs", "slow-fetches"
    slow = FaultRules(delay_seconds=1.2, delay_methods=frozenset({"GET"}), delay_path_contains="/global/")
    # no snapshots after the first: every install goes through the updates, on the base;
    # enough steps that several polls of many 1.2 s fetches finish while the learners train
    # (at 600 steps the two learners made 7, 7 and then 5 installs under CI's load)
    recipe = deep_update(
        TINY_RECIPE, {"training": {"inner_steps": 1000, "poll_seconds": 0.3}, "sync": {"snapshot_every": 1000}}
    )
    with fault_proxy(s3.endpoint_url, FaultRules()) as proxy:
        regions = s3_regions(tmp_path, [s3], [proxy], learners=(2,))
        diloco(
            "up",
            str(write_yaml(tmp_path / "tiny.yaml", recipe)),
            "--regions",
            str(regions),
            "--name",
            name,
            "--runs-dir",
            str(runs_dir),
        )
        proxy.set_rules(slow)
        wait_finished(runs_dir, name, timeout=240)
        assert proxy.stats.total("delayed") > 10
        proxy.set_rules(FaultRules())
        for learner, beat in heartbeats(runs_dir, name).items():
            assert beat.installs >= 2, (learner, beat.installs)
            assert "install" not in beat.refusals.counts, beat.refusals
        installs = [line for line in logs_of(runs_dir, name).splitlines() if "installed fragment" in line]
        assert len(installs) >= 6
        assert_bases_are_the_syncers(runs_dir, name)


def test_a_run_behind_a_failing_endpoint_finishes_and_accounts_for_every_token(tmp_path, s3):
    """One region's endpoint refuses, resets or stalls a share of all requests for the
    whole run, and refuses everything for 10 s in the middle (longer than the retry
    policy of this recipe tries: uploads fail for good and wait in the outbox).  Every token each
    learner trained is in a merged payload, was overwritten by an install, or was sent
    from a base the syncer could no longer anchor (the other learner may merge past the
    window meanwhile: refused, and counted in the ledger); status shows the retries and
    failures."""
    runs_dir, name = tmp_path / "runs", "failing-endpoint"
    changes = {
        "training": {"inner_steps": 1000},
        "sync": {"sync_interval": 25, "liveness_timeout_seconds": 60},
        "storage": {"attempts": 3, "max_backoff_seconds": 2},
    }
    recipe = deep_update(TINY_RECIPE, changes)
    flaky = FaultRules(refuse=0.15, reset=0.05, stall=0.05, stall_seconds=1.0)
    with fault_proxy(s3.endpoint_url, FaultRules(), seed=11) as proxy:
        regions = s3_regions(tmp_path, [s3, s3], [proxy, None])
        diloco(
            "up",
            str(write_yaml(tmp_path / "tiny.yaml", recipe)),
            "--regions",
            str(regions),
            "--name",
            name,
            "--runs-dir",
            str(runs_dir),
        )
        proxy.set_rules(flaky)
        # the outage must come while r0-0 trains (tiny learners take ~100 steps a second):
        # as soon as it has sent, not after a merge (which the faults may hold back)
        started = wait_for(runs_dir, name, lambda s: past_step(s, "r0-0", 20), 120, "r0-0 sending")
        assert training_below(started, "r0-0", 600), started.learners
        proxy.set_rules(FaultRules(outage=True))
        time.sleep(10)
        proxy.set_rules(flaky)
        wait_finished(runs_dir, name, timeout=300)
        faults = proxy.stats.total("refused") + proxy.stats.total("reset") + proxy.stats.total("stalled")
        proxy.set_rules(FaultRules())
        status = json.loads(diloco("status", name, "-o", "json", "--runs-dir", str(runs_dir)).stdout)
        beats = heartbeats(runs_dir, name)
        assert_bases_are_the_syncers(runs_dir, name)
    assert faults > 20
    region = {r["region"]: r for r in status["regions"]}
    assert region["r0"]["retries"] > 0 and region["r0"]["failures"] > 0
    # the faults are r0's; r1 shares the moto server, which under load once answered one of
    # r1's listings with a 500 (retried at once): a tenth of r0's retries at most, none failed
    assert region["r1"]["failures"] == 0 and region["r1"]["retries"] * 10 < region["r0"]["retries"], region
    assert "not delivered" in (runs_dir / name / "logs" / "r0-0.log").read_text()  # it waited in the outbox
    assert_every_token_accounted(runs_dir, name, beats)


def flip_every_global_object(bucket_dir):
    damaged = 0
    for path in sorted((bucket_dir / "global").rglob("*.dlc")):
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x40
        path.write_bytes(bytes(data))
        damaged += 1
    return damaged


def two_file_regions(tmp_path):
    return write_yaml(
        tmp_path / "regions.yaml",
        {
            "regions": [
                {
                    "name": "east",
                    "bucket": f"file://{tmp_path}/buckets/east",
                    "hosts": [{"name": "local", "learners": 1}],
                },
                {
                    "name": "west",
                    "bucket": f"file://{tmp_path}/buckets/west",
                    "hosts": [{"name": "local", "learners": 1}],
                },
            ]
        },
    )


# one snapshot (version 0): once damaged, only the syncer's repair can serve a newcomer
DAMAGE_RECIPE = deep_update(
    TINY_RECIPE, {"training": {"inner_steps": 600, "checkpoint_every_steps": 1000}, "sync": {"snapshot_every": 1000}}
)


def past_step(status, learner, step):
    """A wait_for predicate: ``learner`` has trained ``step`` steps (it has sent by then)."""
    return any(row.learner == learner and row.step >= step for row in status.learners)


def training_below(status, learner, step):
    """A wait_for predicate part: ``learner`` trains and is not past ``step`` yet."""
    return any(row.learner == learner and row.state == "training" and row.step < step for row in status.learners)


def settled_after(seconds):
    """A wait_for predicate: the global version has not changed for ``seconds``."""
    seen = {}

    def settled(status):
        if seen.get("version") != status.version:
            seen.update(version=status.version, since=time.monotonic())
        return time.monotonic() - seen["since"] >= seconds

    return settled


def final_loss(runs_dir, name):
    return json.loads(diloco("status", name, "-o", "json", "--runs-dir", str(runs_dir)).stdout)["heldout_loss"]


def test_damaged_updates_and_snapshots_in_one_region_are_repaired_and_cost_nothing(tmp_path):
    """Mid-run every update and snapshot of east is damaged at rest and its learner is
    killed before its first checkpoint (west is held still, so that nothing newer
    replaces the damage): east-0 must come back from the global weights without
    crash-looping, keep installing (the syncer rewrites what it refuses), and the run
    must end as well as one without damage."""
    recipe, regions = write_yaml(tmp_path / "tiny.yaml", DAMAGE_RECIPE), two_file_regions(tmp_path)
    runs_dir = tmp_path / "runs"
    diloco("up", str(recipe), "--regions", str(regions), "--name", "undamaged", "--runs-dir", str(runs_dir))
    wait_finished(runs_dir, "undamaged", timeout=240)
    diloco("up", str(recipe), "--regions", str(regions), "--name", "damaged", "--runs-dir", str(runs_dir))
    # east-0 still trains (it checkpoints only when it finishes): killed, it needs the global weights
    wait_for(runs_dir, "damaged", lambda s: s.version >= 6 and training_below(s, "east-0", 500), 120, "version 6")
    east, west = child_pid(runs_dir, "damaged", "east-0"), child_pid(runs_dir, "damaged", "west-0")
    os.kill(west, signal.SIGSTOP)
    os.kill(east, signal.SIGSTOP)
    settled = wait_for(runs_dir, "damaged", settled_after(3.0), 60, "the syncer merging what was sent")
    assert flip_every_global_object(tmp_path / "buckets" / "east" / "damaged") >= 3
    os.kill(east, signal.SIGKILL)  # before its first checkpoint: it needs a snapshot
    damaged_at = settled.version
    wait_for(
        runs_dir,
        "damaged",
        lambda s: s.learners[0].state == "training" and s.learners[0].restarts == 1,
        120,
        "east-0 back",
    )
    os.kill(west, signal.SIGCONT)
    wait_finished(runs_dir, "damaged", timeout=240)
    final = heartbeats(runs_dir, "damaged")["east-0"]
    assert final.state.value == "finished" and final.restarts == 1  # no crash loop
    assert final.refusals.counts.get("snapshot", 0) + final.refusals.counts.get("update", 0) >= 1, final.refusals
    syncer = json.loads(diloco("status", "damaged", "-o", "json", "--runs-dir", str(runs_dir)).stdout)["syncer"]
    assert syncer["repairs"] >= 1
    assert min(final.base_versions.values()) > damaged_at  # it kept installing after the damage
    assert_bases_are_the_syncers(runs_dir, "damaged")
    undamaged, damaged = final_loss(runs_dir, "undamaged"), final_loss(runs_dir, "damaged")
    assert abs(damaged - undamaged) < 0.1 * undamaged, (undamaged, damaged)


def kill_group(runs_dir, name, process):
    record = load_run(runs_dir, name)
    pid = next(p["pid"] for p in record.processes if p["name"] == process)
    os.killpg(pid, signal.SIGKILL)


def test_resume_restarts_a_syncer_that_is_down_and_status_says_so(tmp_path):
    runs_dir, name = tmp_path / "runs", "resumed"
    recipe = write_yaml(
        tmp_path / "tiny.yaml",
        deep_update(TINY_RECIPE, {"training": {"inner_steps": 120}}),
    )
    up = ("up", str(recipe), "--regions", str(two_file_regions(tmp_path)), "--name", name, "--runs-dir", str(runs_dir))
    diloco(*up, "--chaos", "keep-payloads")  # the audit reads every payload
    wait_for(runs_dir, name, lambda s: s.version >= 2, 120, "version 2")
    kill_group(runs_dir, name, "syncer")  # the supervisor and the syncer: nothing restarts it
    refused = diloco("rm", name, "--runs-dir", str(runs_dir), check=False)  # its learners still run
    assert (
        refused.returncode == 2
        and f"run {name} is running here; stop it first with `diloco down {name}`" in refused.stderr
    )
    status = json.loads(diloco("status", name, "-o", "json", "--runs-dir", str(runs_dir)).stdout)
    assert f"syncer is down (its supervisor is gone); `diloco resume {name}` restarts it" in status["problems"]
    text = diloco("status", name, "--runs-dir", str(runs_dir)).stdout
    assert f"! syncer is down (its supervisor is gone); `diloco resume {name}` restarts it" in text
    resumed = diloco("resume", name, "--runs-dir", str(runs_dir)).stdout
    assert "syncer" in resumed and "started again" in resumed and f"run {name} resumed" in resumed
    status = wait_finished(runs_dir, name, timeout=240)
    assert not status.problems and all(row.state == "finished" for row in status.learners)
    assert "nothing of run" in diloco("resume", name, "--runs-dir", str(runs_dir)).stdout
    from tests.support.runs import audit_ledger

    audit_ledger(runs_dir / name, load_run(runs_dir, name).secret())
    assert_bases_are_the_syncers(runs_dir, name)


def test_a_learner_gone_for_good_does_not_stall_the_run_and_resume_brings_it_back(tmp_path):
    runs_dir, name = tmp_path / "runs", "given-up"
    changes = {"training": {"inner_steps": 600}, "sync": {"liveness_timeout_seconds": 4, "give_up_seconds": 4}}
    recipe = write_yaml(tmp_path / "tiny.yaml", deep_update(TINY_RECIPE, changes))
    diloco("up", str(recipe), "--regions", str(two_file_regions(tmp_path)), "--name", name, "--runs-dir", str(runs_dir))
    # killed while it trains, not after it finished (tiny learners take ~100 steps a second)
    started = wait_for(runs_dir, name, lambda s: past_step(s, "east-0", 20), 120, "east-0 sending")
    assert training_below(started, "east-0", 400), started.learners
    kill_group(runs_dir, name, "east-0")
    wait_finished(runs_dir, name, timeout=240)
    status = json.loads(diloco("status", name, "-o", "json", "--runs-dir", str(runs_dir)).stdout)
    assert status["syncer"]["given_up"]["east-0"].startswith("silent for")
    assert f"east-0 is down (its supervisor is gone); `diloco resume {name}` restarts it" in status["problems"]
    assert any(problem.startswith("the run went on without east-0 (silent for") for problem in status["problems"])
    diloco("resume", name, "--runs-dir", str(runs_dir))  # east-0 from its checkpoint, and the syncer
    status = wait_for(
        runs_dir, name, lambda s: s.state == "finished" and not s.syncer.given_up, 240, "finishing with east-0"
    )
    assert {row.learner: row.state for row in status.learners} == {"east-0": "finished", "west-0": "finished"}
    assert_bases_are_the_syncers(runs_dir, name)


def test_down_then_resume_goes_on_from_where_each_learner_stood_and_trains_nothing_twice(tmp_path):
    """`diloco down` between two checkpoints: each learner checkpoints the step it stood
    at (weights, AdamW state, error feedback, what it sent) before it exits, `resume`
    goes on from there, and every token is merged once (nothing retrained and sent again)."""
    runs_dir, name = tmp_path / "runs", "downed"
    changes = {"training": {"inner_steps": 160, "checkpoint_every_steps": 50}}
    recipe = write_yaml(tmp_path / "tiny.yaml", deep_update(TINY_RECIPE, changes))
    up = ("up", str(recipe), "--regions", str(two_file_regions(tmp_path)), "--name", name, "--runs-dir", str(runs_dir))
    diloco(*up, "--chaos", "slow-learner=east-0:0.1,slow-learner=west-0:0.1,keep-payloads")
    learners = ("east-0", "west-0")
    wait_for(runs_dir, name, lambda s: all(past_step(s, learner, 55) for learner in learners), 120, "step 55")
    diloco("down", name, "--runs-dir", str(runs_dir))
    wait_processes_gone(runs_dir, name)
    record = load_run(runs_dir, name)
    secret = record.secret()
    stood_at = {}
    for learner in learners:
        log = (runs_dir / name / "logs" / f"{learner}.log").read_text()
        stood_at[learner] = int(re.search(r"stopped at step (\d+)", log)[1])
        checkpoint = final_checkpoint(record.spec.bucket(record.spec.learner(learner).region, secret), learner, secret)
        assert checkpoint.meta["step"] == stood_at[learner], (learner, checkpoint.meta["step"], stood_at[learner])
    assert any(step % 50 for step in stood_at.values()), stood_at  # stopped between two periodic checkpoints
    diloco("resume", name, "--runs-dir", str(runs_dir))
    wait_finished(runs_dir, name, timeout=240)
    for learner in learners:
        log = (runs_dir / name / "logs" / f"{learner}.log").read_text()
        assert f"resumed from checkpoint at step {stood_at[learner]}" in log
    audit_ledger(runs_dir / name, secret)
    assert_every_token_accounted(runs_dir, name, heartbeats(runs_dir, name))
    assert_bases_are_the_syncers(runs_dir, name)
