"""Regions over SSH: real sshd, real host keys, real installs, real network separation."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
from safetensors.torch import load_file

from diloco_cli.launch.runs import load_run
from diloco_cli.models.gpt import byte_gpt
from testbed.netns import namespaces
from testbed.servers import moto_s3_server
from tests.support.hosts import BASE_PYTHON
from tests.support.runs import (
    TINY_RECIPE,
    assert_bases_are_the_syncers,
    assert_every_token_accounted,
    audit_ledger,
    deep_update,
    diloco,
    heartbeats,
    interrupted_output,
    wait_finished,
    wait_for,
    write_yaml,
)
from tests.support.sshd import sshd_server

pytestmark = pytest.mark.slow

# The test hosts share this machine's cores while each reports all of them: one thread
# per learner (left to itself, each would take every core, and they would thrash).
SSH_RECIPE = deep_update(TINY_RECIPE, {"training": {"inner_steps": 60, "threads_per_learner": 1}})


def host_entry(server, name, venv, tmp_path, learners=1, **extra):
    return {
        "name": name,
        "address": server.host,
        "port": server.port,
        "user": server.user,
        "key_file": str(server.client_key_path),
        "python": BASE_PYTHON,
        "venv": venv,
        "install": ["torch==2.13.*"],
        "work_dir": str(tmp_path / f"work-{name}"),
        "learners": learners,
        **extra,
    }


def sshd(tmp_path, name, **options):
    """sshd_server in a directory of its own (made here)."""
    directory = tmp_path / name
    directory.mkdir()
    return sshd_server(directory, **options)


def regions_file(tmp_path, regions, known_hosts, timeout=10, **extra):
    return write_yaml(
        tmp_path / "regions.yaml",
        {"regions": regions, "ssh": {"known_hosts": str(known_hosts), "connect_timeout": timeout}, **extra},
    )


def known_hosts_of(tmp_path, *servers):
    path = tmp_path / "known_hosts"
    path.write_text("".join(server.known_hosts_line() + "\n" for server in servers))
    return path


def processes_of(run_dir_fragment: str) -> list[int]:
    """Pids on this machine whose command line mentions a path of the run."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if run_dir_fragment.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue
    return found


def remote_state(tmp_path, host, run, process):
    return json.loads((tmp_path / f"work-{host}" / run / "processes" / f"{process}.json").read_text())


def test_up_on_two_ssh_hosts_installs_supervises_restarts_and_stops(tmp_path, host_venv):
    runs_dir = tmp_path / "runs"
    with ExitStack() as stack:
        one = stack.enter_context(sshd(tmp_path, "sshd-one"))
        two = stack.enter_context(sshd(tmp_path, "sshd-two"))
        known_hosts = known_hosts_of(tmp_path, one, two)
        regions = regions_file(
            tmp_path,
            [
                {
                    "name": "east",
                    "bucket": f"file://{tmp_path}/buckets/east",
                    "hosts": [host_entry(one, "one", host_venv, tmp_path, learners=2)],
                },
                {
                    "name": "west",
                    "bucket": f"file://{tmp_path}/buckets/west",
                    "hosts": [host_entry(two, "two", host_venv, tmp_path, learners=2)],
                },
            ],
            known_hosts,
        )
        # the default recipe (4 learners), shortened, with a narrower GPT of 2 layers
        shorter = [
            "--set",
            "training.inner_steps=24",
            "--set",
            "sync.sync_interval=6",
            "--set",
            "training.heartbeat_seconds=0.5",
            "--set",
            "model.kwargs.num_layers=2",
            "--set",
            "model.kwargs.width=64",
            "--set",
            "model.kwargs.num_heads=2",
        ]
        started = diloco(
            "up", "--regions", str(regions), "--name", "ssh-run", "--runs-dir", str(runs_dir), *shorter, timeout=900
        )
        assert "preflight" in started.stdout and "first problem" in started.stdout
        assert (
            re.search(r"one: diloco (installed|up to date)", started.stdout) and "started run ssh-run" in started.stdout
        )
        # the secret reached the hosts over SSH only, readable by its owner alone
        secret_file = tmp_path / "work-one" / "ssh-run" / "secret"
        assert oct(secret_file.stat().st_mode & 0o777) == "0o600"
        secret = secret_file.read_text()
        assert secret not in "".join(p.read_text(errors="replace") for p in (tmp_path / "buckets").rglob("*.json"))
        # kill a learner on its host: its supervisor restarts it and it rejoins
        wait_for(runs_dir, "ssh-run", lambda s: s.learners[0].step >= 3, 300, "east-0 training")
        os.kill(remote_state(tmp_path, "one", "ssh-run", "east-0")["child_pid"], signal.SIGKILL)
        # west-1's supervisor dies with it (a host's processes killed): resume restarts it over SSH
        killed = remote_state(tmp_path, "two", "ssh-run", "west-1")["supervisor_pid"]
        os.killpg(killed, signal.SIGKILL)
        resumed = diloco("resume", "ssh-run", "--runs-dir", str(runs_dir), timeout=300).stdout
        assert re.search(r"west-1\s+two\s+started again", resumed) and "east-0" not in resumed, resumed
        status = wait_finished(runs_dir, "ssh-run", timeout=300)
        rows = {row.learner: row for row in status.learners}
        assert rows["east-0"].restarts == 1 and rows["east-0"].state == "finished" and rows["east-0"].host == "one"
        deadline = time.monotonic() + 120
        while remote_state(tmp_path, "two", "ssh-run", "west-1")["state"] != "finished" and time.monotonic() < deadline:
            time.sleep(0.5)
        resumed_state = remote_state(tmp_path, "two", "ssh-run", "west-1")
        assert resumed_state["supervisor_pid"] != killed and resumed_state["state"] == "finished"
        assert rows["west-1"].state == "finished"
        assert [rows[m].host for m in ("east-1", "west-0", "west-1")] == ["one", "two", "two"]
        # learners never wait for merges, so a fast one may finish before the first; the
        # syncer still merges everyone's sends, the restarted learner's included
        assert all(row.state == "finished" for row in rows.values()) and status.version >= 2
        assert secret not in diloco("status", "ssh-run", "-o", "json", "--runs-dir", str(runs_dir)).stdout
        probed = json.loads(diloco("status", "ssh-run", "--probe", "-o", "json", "--runs-dir", str(runs_dir)).stdout)[
            "probe"
        ]
        assert {
            row["process"]: (row["host"], row["ssh"], row["supervisor"]) for row in probed if row["host"] != "local"
        } == {
            "syncer": ("one", "ok", "finished"),  # by default on the first region's host
            "reducer-east": ("one", "ok", "finished"),
            "reducer-west": ("two", "ok", "finished"),
            "east-0": ("one", "ok", "finished"),
            "east-1": ("one", "ok", "finished"),
            "west-0": ("two", "ok", "finished"),
            "west-1": ("two", "ok", "finished"),
        }
        log = diloco("logs", "ssh-run", "east-0", "--runs-dir", str(runs_dir)).stdout
        assert "exit -9: restarting" in log and "finished at step 24" in log and "resumed from checkpoint" not in log
        output = tmp_path / "model.safetensors"
        diloco("export", "ssh-run", "-o", str(output), "--runs-dir", str(runs_dir))
        byte_gpt(num_layers=2, width=64, num_heads=2).load_state_dict(load_file(str(output)))
        stopped = diloco("down", "ssh-run", "--runs-dir", str(runs_dir)).stdout
        assert "east-0" in stopped and "one" in stopped and "run ssh-run is finished" in stopped
        assert processes_of(str(tmp_path / "work-one")) == [] and processes_of(str(tmp_path / "work-two")) == []
        # the README's multi-region commands, as written, on these hosts: a second up
        # finds both hosts up to date (no copy, no install)
        (tmp_path / "my-regions.yaml").write_text(regions.read_text())
        run_name, paused = None, []
        for command in readme_multi_region_commands():
            arguments = command.split()[1:]
            if run_name:
                arguments = [run_name if a == "RUN" else a for a in arguments]
            if "--follow" in arguments:
                assert "starting (restart 0)" in interrupted_output(arguments, tmp_path)
                continue
            if arguments[0] == "down":
                for pid in paused:
                    os.kill(pid, signal.SIGCONT)
            result = diloco(*arguments, cwd=tmp_path, timeout=600)
            if "--dry-run" in arguments:
                assert "(dry run: nothing started)" in result.stdout and "learner west-1 on two" in result.stdout
            elif arguments[0] == "up":
                assert "one: diloco up to date" in result.stdout and "two: diloco up to date" in result.stdout
                run_name = re.search(r"started run (\S+):", result.stdout).group(1)
                # the default job's four learners would hold both cores of this machine while
                # the commands below run; they are held still until `down` (their supervisors
                # and the syncer run on)
                paused = held_still(tmp_path, run_name, {"one": ["east-0", "east-1"], "two": ["west-0", "west-1"]})
            elif "--probe" in arguments:
                assert "processes (probed)" in result.stdout and "one" in result.stdout and "ok" in result.stdout
            elif arguments[0] == "resume":
                assert f"nothing of run {run_name} is down" in result.stdout
            elif arguments[0] == "scale":  # started over SSH on west's host, from the host's rewritten manifest
                assert re.search(r"west-2\s+two\s+added", result.stdout) and "M is now 5" in result.stdout, (
                    result.stdout
                )
                log = tmp_path / "work-two" / run_name / "logs" / "west-2.log"
                deadline = time.monotonic() + 180
                while not (
                    log.exists() and "installed fragment" in log.read_text()
                ):  # it joined from the global weights
                    assert time.monotonic() < deadline, (
                        f"west-2 did not join on host two: {log.read_text()[-2000:] if log.exists() else 'no log'}"
                    )
                    time.sleep(1)
            elif arguments[0] == "down":
                assert f"run {run_name} is stopped now" in result.stdout
        assert run_name is not None
        assert processes_of(str(tmp_path / "work-one")) == [] and processes_of(str(tmp_path / "work-two")) == []


def held_still(tmp_path, run, learners_by_host) -> list[int]:
    """SIGSTOP the learners of ``run`` (each once its supervisor has started it); their pids."""
    pids = []
    deadline = time.monotonic() + 60
    for host, learners in learners_by_host.items():
        for learner in learners:
            while (pid := child_of(tmp_path, host, run, learner)) is None:
                assert time.monotonic() < deadline, f"{learner} did not start on {host}"
                time.sleep(0.2)
            os.kill(pid, signal.SIGSTOP)
            pids.append(pid)
    return pids


def child_of(tmp_path, host, run, process):
    try:
        return remote_state(tmp_path, host, run, process).get("child_pid")
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def readme_multi_region_commands() -> list[str]:
    """The README's multi-region block (the ``sh`` one; the quick start's are ``bash``)."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    (block,) = re.findall(r"```sh\n(.*?)```", readme, flags=re.S)
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.startswith("diloco ")]


def namespaced_regions(stack, tmp_path, host_venv, monkeypatch):
    """Two regions, east and west, each a network namespace with its own sshd (its host)
    and S3 endpoint (its bucket), which only its own namespace (and this machine) reaches;
    returns the namespaces, the regions' entries, each region's S3 server and the
    known_hosts file."""
    credentials = tmp_path / "aws-credentials"
    credentials.write_text("[default]\naws_access_key_id = testing\naws_secret_access_key = testing\n")
    aws_env = {"AWS_SHARED_CREDENTIALS_FILE": str(credentials), "AWS_DEFAULT_REGION": "us-east-1"}
    for name, value in aws_env.items():  # the syncer (here) reads credentials the same way
        monkeypatch.setenv(name, value)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    spaces = stack.enter_context(namespaces(["east", "west"]))
    regions, servers, stores = [], [], {}
    for label, space in spaces.items():
        server = stack.enter_context(
            sshd(tmp_path, f"sshd-{label}", host=space.address, command_prefix=space.exec_prefix())
        )
        store = stack.enter_context(moto_s3_server(host=space.address, command_prefix=space.exec_prefix()))
        bucket = store.create_bucket(f"diloco-{label}")
        servers.append(server)
        stores[label] = store
        regions.append(
            {
                "name": label,
                "bucket": bucket,
                "storage_options": {"endpoint_url": store.endpoint_url},
                "hosts": [host_entry(server, f"host-{label}", host_venv, tmp_path, env=aws_env)],
            }
        )
    return spaces, regions, stores, known_hosts_of(tmp_path, *servers)


def test_namespaces_as_regions_each_with_its_own_sshd_and_s3(tmp_path, host_venv, monkeypatch):
    runs_dir = tmp_path / "runs"
    with ExitStack() as stack:
        spaces, regions, stores, known_hosts = namespaced_regions(stack, tmp_path, host_venv, monkeypatch)
        recipe = write_yaml(tmp_path / "recipe.yaml", deep_update(SSH_RECIPE, {"training": {"inner_steps": 40}}))
        diloco(
            "up",
            str(recipe),
            "--regions",
            # a region's namespace reaches only its own endpoint; the syncer, which reads
            # both buckets, runs here (its default, the first region's host, could not)
            str(regions_file(tmp_path, regions, known_hosts, syncer={"host": "local"})),
            "--name",
            "netns-run",
            "--runs-dir",
            str(runs_dir),
            timeout=900,
        )
        wait_finished(runs_dir, "netns-run", timeout=300)
        # each region's endpoint holds only its own learner's traffic
        for label in spaces:
            keys = stores[label].filesystem().find(f"diloco-{label}")
            assert any(f"heartbeats/{label}-0.json" in key for key in keys)
            other = "west" if label == "east" else "east"
            assert not any(f"{other}-0" in key for key in keys)
        # and a learner's namespace cannot reach the other region's endpoint at all
        probe = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2)"
        west = stores["west"].endpoint_url.split("//")[1].split(":")
        blocked = spaces["east"].run([sys.executable, "-c", probe, west[0], west[1]], capture_output=True)
        assert blocked.returncode != 0
        output = tmp_path / "model.safetensors"
        diloco("export", "netns-run", "-o", str(output), "--runs-dir", str(runs_dir))
        byte_gpt(num_layers=2, width=64, num_heads=2, context=64).load_state_dict(load_file(str(output)))
        diloco("down", "netns-run", "--runs-dir", str(runs_dir))


def test_two_syncer_shards_over_ssh_hosts_in_namespaces_finish_exactly(tmp_path, host_venv, monkeypatch):
    """``sync.shards: 2`` with learners and reducers on SSH hosts in two namespaces, the
    shards here (a namespace reaches only its own bucket): the run finishes, nothing
    merged twice or lost, every learner's base each shard's bit for bit, every token
    accounted for; each shard published only its fragments, under its own prefix."""
    runs_dir, name = tmp_path / "runs", "netns-shards"
    with ExitStack() as stack:
        spaces, regions, stores, known_hosts = namespaced_regions(stack, tmp_path, host_venv, monkeypatch)
        changes = {
            "training": {"inner_steps": 40},
            "sync": {"shards": 2, "num_fragments": 4},
        }
        recipe = write_yaml(tmp_path / "recipe.yaml", deep_update(SSH_RECIPE, changes))
        syncer = {"host": "local", "shard_hosts": ["local", "local"]}
        diloco(
            "up",
            str(recipe),
            "--regions",
            str(regions_file(tmp_path, regions, known_hosts, syncer=syncer)),
            "--name",
            name,
            "--runs-dir",
            str(runs_dir),
            "--chaos",
            "keep-payloads",  # the audit reads every payload
            timeout=900,
        )
        status = wait_finished(runs_dir, name, timeout=400)
        assert [shard.name for shard in status.syncer_shards] == ["syncer-0", "syncer-1"]
        assert all(shard.state == "finished" and shard.version > 0 for shard in status.syncer_shards)
        audit_ledger(runs_dir / name, load_run(runs_dir, name).secret())
        assert_bases_are_the_syncers(runs_dir, name)
        assert_every_token_accounted(runs_dir, name, heartbeats(runs_dir, name))
        for label in spaces:
            keys = stores[label].filesystem().find(f"diloco-{label}")
            published = [key.split(f"/{name}/", 1)[1] for key in keys if "/global/" in key]
            assert published and all(key.startswith(("global/shard-0/", "global/shard-1/")) for key in published)
            for shard in (0, 1):
                fragments = {
                    int(key[-7:-4])
                    for key in published
                    if key.startswith(f"global/shard-{shard}/updates/") and key.endswith(".dlc")
                }
                assert fragments == {p for p in range(4) if p % 2 == shard}, (label, shard, fragments)
        diloco("down", name, "--runs-dir", str(runs_dir))


def dry_run(tmp_path, regions, *extra):
    return diloco(
        "up",
        str(write_yaml(tmp_path / "recipe.yaml", SSH_RECIPE)),
        "--regions",
        str(regions),
        "--dry-run",
        "--runs-dir",
        str(tmp_path / "runs"),
        *extra,
        check=False,
        timeout=300,
    )


def test_unknown_host_keys_are_refused_with_their_fingerprint_and_changed_keys_always(tmp_path, host_venv):
    with sshd(tmp_path, "sshd") as server:
        empty = tmp_path / "known_hosts"
        empty.write_text("")
        regions = regions_file(
            tmp_path,
            [
                {
                    "name": "east",
                    "bucket": f"file://{tmp_path}/b",
                    "hosts": [host_entry(server, "one", host_venv, tmp_path, learners=2)],
                }
            ],
            empty,
        )
        refused = dry_run(tmp_path, regions)
        assert refused.returncode == 2
        fingerprint = subprocess.run(
            ["ssh-keygen", "-lf", "-"], input=server.known_hosts_line(), capture_output=True, text=True
        ).stdout.split()[1]
        assert f"offered an unknown ssh-ed25519 key {fingerprint}" in refused.stdout + refused.stderr
        assert "--accept-new-host-keys" in refused.stdout + refused.stderr
        accepted = dry_run(tmp_path, regions, "--accept-new-host-keys")
        assert accepted.returncode == 0, accepted.stderr
        assert f"[{server.host}]:{server.port} ssh-ed25519" in empty.read_text()
        # a changed key is refused, even with --accept-new-host-keys
        with sshd(tmp_path, "impostor") as impostor:
            line = impostor.known_hosts_line().replace(
                f"[{impostor.host}]:{impostor.port}", f"[{server.host}]:{server.port}"
            )
            empty.write_text(line + "\n")
            changed = dry_run(tmp_path, regions, "--accept-new-host-keys")
            assert changed.returncode == 2
            assert "the host key CHANGED" in changed.stdout + changed.stderr


def test_unreachable_hosts_and_hosts_without_torch_fail_preflight_by_name(tmp_path, host_venv):
    with sshd(tmp_path, "sshd") as server:
        known_hosts = known_hosts_of(tmp_path, server)
        gone = dict(host_entry(server, "gone", host_venv, tmp_path), port=1)  # nothing listens on port 1
        bare = dict(host_entry(server, "bare", str(tmp_path / "bare-venv"), tmp_path), install=[])
        regions = regions_file(
            tmp_path,
            [
                {"name": "east", "bucket": f"file://{tmp_path}/b", "hosts": [gone]},
                {"name": "west", "bucket": f"file://{tmp_path}/c", "hosts": [bare]},
            ],
            known_hosts,
            timeout=3,
        )
        started = time.monotonic()
        result = dry_run(tmp_path, regions)
        assert result.returncode == 2
        assert time.monotonic() - started < 60
        table = result.stdout
        assert re.search(r"host gone \(root@127\.0\.0\.1:1\) is unreachable within 3 s", " ".join(table.split()))
        assert re.search(r"host bare: torch is not usable \(.*No module named 'torch'", " ".join(table.split()))
        assert "preflight failed on 2 host(s); nothing was started" in result.stderr
        assert not (tmp_path / "runs").exists()


def test_hosts_that_answer_no_ssh_fail_preflight_in_one_line_each_and_no_traceback(tmp_path):
    """A port that takes the connection and closes it (no SSH banner) and one where nothing
    listens: paramiko's transport thread logs the first with two tracebacks per host; the
    dry run prints only its table, each failure on its host's line (2 learners: the recipe's)."""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))

    def hang_up() -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:  # closed: the test is over
                return
            connection.close()

    threading.Thread(target=hang_up, daemon=True).start()
    hosts = [
        {"name": "mute", "address": "127.0.0.1", "port": listener.getsockname()[1], "user": "root"},
        {"name": "gone", "address": "127.0.0.1", "port": 1, "user": "root"},  # nothing listens on port 1
    ]
    regions = regions_file(
        tmp_path, [{"name": "east", "bucket": f"file://{tmp_path}/b", "hosts": hosts}], tmp_path / "known_hosts", 3
    )
    try:
        result = dry_run(tmp_path, regions)
    finally:
        listener.close()
    said = f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 2, said
    assert result.stderr == "error: preflight failed on 2 host(s); nothing was started\n", said
    problems = result.stdout.split("problems:\n")[1].strip().splitlines()
    assert [line.split(":")[0].strip() for line in problems] == ["mute", "gone"], said
    assert "unreachable within 3 s: it took the connection but answered no SSH protocol banner;" in problems[0], said
    assert "unreachable within 3 s: [Errno 111] Connection refused; check its address and port" in problems[1], said


def test_a_wrong_bucket_is_caught_by_preflight_from_the_host_before_anything_starts(tmp_path, host_venv, monkeypatch):
    with moto_s3_server() as store, sshd(tmp_path, "sshd") as server:
        credentials = tmp_path / "aws-credentials"
        credentials.write_text("[default]\naws_access_key_id = testing\naws_secret_access_key = testing\n")
        env = {"AWS_SHARED_CREDENTIALS_FILE": str(credentials), "AWS_DEFAULT_REGION": "us-east-1"}
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        regions = regions_file(
            tmp_path,
            [
                {
                    "name": "east",
                    "bucket": "s3://no-such-bucket",
                    "storage_options": {"endpoint_url": store.endpoint_url},
                    "hosts": [host_entry(server, "one", host_venv, tmp_path, learners=2, env=env)],
                }
            ],
            known_hosts_of(tmp_path, server),
        )
        runs_dir = tmp_path / "runs"
        result = diloco(
            "up",
            str(write_yaml(tmp_path / "recipe.yaml", SSH_RECIPE)),
            "--regions",
            str(regions),
            "--runs-dir",
            str(runs_dir),
            "--set",
            "name=wrong",
            check=False,
            timeout=600,
        )
        assert result.returncode == 2
        assert "no-such-bucket" in result.stdout + result.stderr
        assert not runs_dir.exists() or not any(p for p in runs_dir.iterdir() if not p.name.startswith("."))
        assert processes_of(str(tmp_path / "work-one")) == []


def test_the_chaos_driver_signals_a_learner_on_its_ssh_host(tmp_path):
    """Chaos mode on the SSH launcher: the driver reads the learner's supervised child
    from the host's process state over SSH and kills it there, and records the event in
    the buckets for `status`."""
    from diloco_cli.codec import RunSecret
    from diloco_cli.config.chaos import ProcessEvent, parse_chaos
    from diloco_cli.config.recipe import Recipe
    from diloco_cli.launch.chaos import ChaosDriver
    from diloco_cli.launch.runs import load_run, write_run_record
    from diloco_cli.store.run_spec import LearnerSpec, RegionSpec, RunSpec, SyncerSpec

    with sshd(tmp_path, "sshd-one") as one:
        known_hosts = known_hosts_of(tmp_path, one)
        host = host_entry(one, "one", str(tmp_path / "venv"), tmp_path)
        spec = RunSpec(
            run="chaotic",
            created=time.time(),
            recipe=Recipe.model_validate(deep_update(TINY_RECIPE, {"training": {"num_learners": 1}})),
            learners=(LearnerSpec(id="east-0", region="east", host="one", shard=0),),
            regions=(RegionSpec(name="east", root=f"file://{tmp_path}/buckets/east"),),
            syncer=SyncerSpec(host="local", home=f"file://{tmp_path}/home"),
            chaos=parse_chaos("seed=1,kill-learner=1/min"),
        )
        run_dir = tmp_path / "runs" / "chaotic"
        run_dir.mkdir(parents=True)
        (run_dir / "secret").write_text(RunSecret.generate().to_hex())
        write_run_record(
            run_dir,
            {
                "spec": json.loads(spec.to_json()),
                "launcher": "ssh",
                "processes": [],
                "hosts": {"one": host},
                "ssh": {"known_hosts": str(known_hosts)},
            },
        )
        victim = subprocess.Popen(["sleep", "120"])  # the learner, as the host's supervisor recorded it
        state = tmp_path / "work-one" / "chaotic" / "processes" / "east-0.json"
        state.parent.mkdir(parents=True)
        state.write_text(json.dumps({"state": "running", "child_pid": victim.pid, "supervisor_pid": os.getpid()}))
        try:
            driver = ChaosDriver(load_run(tmp_path / "runs", "chaotic"))
            driver._apply(ProcessEvent(at_seconds=0.0, action="kill", target="east-0"))
            assert victim.wait(timeout=30) == -signal.SIGKILL
            log = driver.buckets[0].read_chaos_log()
            assert [(e.action, e.target, e.outcome) for e in log.events] == [("kill", "east-0", "done")]
            state.write_text(json.dumps({"state": "restarting", "supervisor_pid": os.getpid()}))
            driver._apply(ProcessEvent(at_seconds=1.0, action="kill", target="east-0"))
            assert driver.buckets[0].read_chaos_log().events[-1].outcome == "not running"
        finally:
            victim.kill()


def test_a_commands_output_arrives_whole_even_when_sshd_sends_the_exit_status_first(tmp_path):
    """sshd may send a command's exit status before the last of its output (preflight once
    read "sbatch" of five missing commands); ``run`` waits for the end of the streams, and
    only briefly where a process left in the background still holds them."""
    from diloco_cli.launch.ssh import EOF_GRACE_SECONDS, run

    tail = 60_000  # the last write, as large as a pipe holds: sshd may still be reading it at the exit
    with sshd_server(tmp_path) as server:
        client = server.connect()
        try:
            cut = []
            for _ in range(120):  # before the fix 5 in 300 came back cut (this catches it 6 times in 7)
                said = run(
                    client,
                    f"for c in a b c; do echo $c; echo $c >&2; done; head -c {tail} /dev/zero | tr '\\0' x",
                    timeout=30,
                )
                # the login shell may print its own noise to stderr first (a pyenv rehash racing
                # another shell's once did): the command's own output must arrive whole after it
                if said.stdout != "a\nb\nc\n" + "x" * tail or not said.stderr.endswith("a\nb\nc\n"):
                    cut.append((len(said.stdout), said.stderr))
            assert not cut, cut
            started = time.monotonic()
            held = run(client, "(sleep 30 &); echo started", timeout=30)  # the sleep keeps stdout open
            assert held.code == 0 and held.stdout == "started\n"
            assert time.monotonic() - started < EOF_GRACE_SECONDS + 5
        finally:
            client.close()
