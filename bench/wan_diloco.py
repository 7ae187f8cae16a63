"""Decoupled DiLoCo on the emulated WAN, for ``bench.wan``: the run's learners and syncer
started in their places' namespaces, watched to the end, and what they and the links
measured (the run's report, the proxies' counters, the WAN devices' counters).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from bench._common import median

if TYPE_CHECKING:
    from diloco_cli.store.documents import Heartbeat

REPOSITORY = Path(__file__).resolve().parent.parent
REGIONS = ("east", "west")
SYNCER = "syncer"
MEASURE = ["training.threads_per_learner=1", "sync.evaluate_every=1"]
"""Overrides of every measured run: one thread per learner, the global model evaluated at every version."""
QUICK_RUN = [
    "model.kwargs={num_layers: 1, width: 32, num_heads: 2, context: 32}",
    "data.sequence_length=32",
    "training.warmup_steps=3",
    "training.poll_seconds=0.3",
    "training.heartbeat_seconds=0.5",
    "sync.sync_interval=5",
    "sync.evaluation_batches=2",
    "sync.poll_seconds=0.3",
    "sync.status_seconds=1",
]
"""The tiny model and fast cadences of the WAN benchmarks' quick runs."""


def process_env(threads: int = 1) -> dict[str, str]:
    from testbed.wan import S3_ENV

    return {
        **os.environ,
        **S3_ENV,
        "OMP_NUM_THREADS": str(threads),
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPOSITORY), os.environ.get("PYTHONPATH")])),
    }


def device_bytes(place) -> dict[str, int]:
    """Bytes sent (tx) and received (rx) so far by ``place``'s WAN device (its link to the router)."""
    out = subprocess.run(
        ["ip", "-n", place.name, "-s", "-j", "link", "show", "dev", place.wan_veth],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    stats = json.loads(out)[0]["stats64"]
    return {"tx": int(stats["tx"]["bytes"]), "rx": int(stats["rx"]["bytes"])}


def device_deltas(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return {label: {d: after[label][d] - before[label][d] for d in ("tx", "rx")} for label in before}


def learner_figures(beats: Mapping[str, Heartbeat], launched: float) -> dict:
    """What the learners' last heartbeats say of a run launched at ``launched``: their
    compute seconds and shares of wall time (over their lives, their training loops and
    since the launch, start-up included), the median start-up (the launch to the first
    step: the command's checks, the processes, imports, model, data) and step time."""
    compute = sum(beat.compute_seconds for beat in beats.values())
    alive = sum(beat.time - beat.started_at for beat in beats.values())
    since = [getattr(beat, "training_since", None) for beat in beats.values()]
    looping = sum(beat.time - start for beat, start in zip(beats.values(), since)) if all(since) else None
    from_launch = sum(beat.time - launched for beat in beats.values())
    steps = [beat.step_seconds for beat in beats.values() if beat.step_seconds]
    return {
        "compute_seconds": compute,
        "learner_seconds": alive,
        "compute_share": compute / alive,
        "compute_share_over_loop": compute / looping if looping else None,
        "compute_share_from_launch": compute / from_launch,
        "startup_seconds": median([start - launched for start in since]) if all(since) else None,
        "median_learner_step_seconds": median(steps) if steps else None,
    }


def tail(path: Path, size: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-size:]
    except OSError:
        return ""


def regions_document(learners_per_region: int, syncer_place: str = SYNCER) -> dict:
    """Two regions of ``learners_per_region`` learners; the syncer in ``syncer_place``: a
    place of its own (``syncer``) or a region (its traffic with that bucket stays there)."""
    syncer = {"host": "local", "home": "file://{runs_dir}/{run}/syncer"}
    if syncer_place != SYNCER:
        syncer["region"] = syncer_place
    return {
        "regions": [
            {
                "name": region,
                "bucket": f"s3://diloco-{region}",
                "storage_options": {"endpoint_url": f"http://s3-{region}:9001"},
                "hosts": [{"name": "local", "learners": learners_per_region}],
            }
            for region in REGIONS
        ],
        "syncer": syncer,
    }


def via_setup(spec, wan):
    """The spec with every region's endpoint replaced by its setup URL (moto over the region's
    root link), for this (root) namespace, where the ``s3-<region>`` names do not resolve."""
    regions = tuple(
        region.model_copy(
            update={"storage_options": {**region.storage_options, "endpoint_url": wan.regions[region.name].setup_url}}
        )
        for region in spec.regions
    )
    return spec.model_copy(update={"regions": regions})


PROBE = """
import sys, s3fs
fs = s3fs.S3FileSystem(
    endpoint_url=sys.argv[1], key="testing", secret="testing", use_listings_cache=False, skip_instance_cache=True
)
path = sys.argv[2] + "/probe-" + sys.argv[3]
fs.pipe(path, b"probe")
assert fs.cat(path) == b"probe"
fs.rm(path)
print("ok")
"""


def probe_by_name(wan, place: str, region: str, root: str) -> dict:
    """s3fs in ``place`` reaches ``region``'s bucket by its name; which proxy carried it."""
    bucket_path = root.removeprefix("s3://")
    before = {kind: wan.regions[region].counters(kind) for kind in ("local", "remote")}
    started = time.monotonic()
    out = wan.python(place, PROBE, wan.regions[region].url, bucket_path, place, timeout=120).strip()
    seconds = time.monotonic() - started
    after = {kind: wan.regions[region].counters(kind) for kind in ("local", "remote")}
    moved = {kind: after[kind]["bytes_to_upstream"] - before[kind]["bytes_to_upstream"] for kind in after}
    return {
        "place": place,
        "region": region,
        "url": wan.regions[region].url,
        "answer": out,
        "seconds": seconds,
        "bytes_through": moved,
        "via": "local"
        if moved["local"] and not moved["remote"]
        else "remote"
        if moved["remote"] and not moved["local"]
        else "both",
    }


class Processes:
    """Processes started in namespaces; all stopped (TERM, then KILL) when closed."""

    RESTART_CODE = 75  # a learner that finished but could not deliver its last payloads
    MAX_RESTARTS = 3

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.running: dict[str, subprocess.Popen] = {}
        self.commands: dict[str, tuple[list[str], dict[str, str]]] = {}
        self.restarts: dict[str, int] = {}
        self.files = []

    def start(self, name: str, prefix: Sequence[str], arguments: Sequence[str], env: dict[str, str]) -> None:
        log = open(self.logs / f"{name}.log", "ab")
        self.files.append(log)
        command = [*prefix, sys.executable, "-m", "diloco_cli", *arguments]
        self.commands[name] = (command, env)
        self.running[name] = subprocess.Popen(
            command,
            cwd=REPOSITORY,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def _restart_undelivered(self) -> None:
        """What a supervisor does: start a learner again that exited with 75."""
        for name, process in list(self.running.items()):
            if process.returncode == self.RESTART_CODE and self.restarts.get(name, 0) < self.MAX_RESTARTS:
                self.restarts[name] = self.restarts.get(name, 0) + 1
                command, env = self.commands[name]
                print(f"  {name} exited with {self.RESTART_CODE} (payloads undelivered): starting it again", flush=True)
                log = open(self.logs / f"{name}.log", "ab")
                self.files.append(log)
                self.running[name] = subprocess.Popen(
                    command,
                    cwd=REPOSITORY,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )

    def wait(self, timeout: float, stop: Callable[[], bool] | None = None) -> dict[str, int | None]:
        """Every process's exit code once all ended, or as they are (None: running) as
        soon as ``stop`` says so."""
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in self.running.values()) or self._undelivered():
            if stop is not None and stop():
                return {n: p.poll() for n, p in self.running.items()}
            self._restart_undelivered()
            failed = {
                n: p.returncode for n, p in self.running.items() if p.returncode not in (None, 0, self.RESTART_CODE)
            }
            if failed:
                raise RuntimeError(
                    f"{', '.join(failed)} exited with {failed}; end of the first log:\n"
                    f"{tail(self.logs / (next(iter(failed)) + '.log'))}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the run did not finish in {timeout:.0f} s; still running: "
                    f"{', '.join(n for n, p in self.running.items() if p.poll() is None)}"
                )
            time.sleep(0.5)
        codes = {n: p.returncode for n, p in self.running.items()}
        if any(codes.values()):
            bad = next(n for n, c in codes.items() if c)
            raise RuntimeError(f"exit codes {codes}; end of {bad}'s log:\n{tail(self.logs / (bad + '.log'))}")
        return codes

    def _undelivered(self) -> bool:
        return any(
            p.returncode == self.RESTART_CODE and self.restarts.get(n, 0) < self.MAX_RESTARTS
            for n, p in self.running.items()
        )

    def close(self) -> None:
        for process in self.running.values():
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    process.terminate()
        deadline = time.monotonic() + 15
        for process in self.running.values():
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for log in self.files:
            log.close()


REPORT_KEYS = (
    "state",
    "elapsed_seconds",
    "tokens",
    "total_bytes",
    "wan_bytes",
    "wan_bytes_per_token",
    "kinds",
    "compression",
    "data_parallel",
    "cost_dollars",
)
"""What the result keeps of ``diloco report --output json``."""

HEARTBEAT_KEYS = (
    "region",
    "tokens",
    "step",
    "compute_seconds",
    "started_at",
    "training_since",
    "time",
    "step_seconds",
    "sends",
    "delivered",
)
"""What the result keeps of each learner's last heartbeat."""


def prepare_run(wan, recipe, overrides: Sequence[str], workdir: Path, syncer_place: str) -> tuple:
    """The run resolved as ``diloco up`` resolves it (regions on the WAN's buckets), its
    buckets created, its run directory and secret written and its manifest in every
    bucket: ``(name, spec, setup, run_dir, secret)``."""
    from diloco_cli.launch.resolve import create_run_directory
    from diloco_cli.launch.up import resolve

    learners_per_region = recipe.training.num_learners // len(REGIONS)
    regions_path = workdir / "regions.json"
    regions_path.write_text(json.dumps(regions_document(learners_per_region, syncer_place), indent=2))
    name = f"wan-{time.strftime('%Y%m%d-%H%M%S')}"
    spec, _, _ = resolve(None, regions_path, list(overrides), name, workdir / "runs")
    setup = via_setup(spec, wan)
    for region in REGIONS:
        setup_store = wan.regions[region].store("setup")
        if not setup_store.filesystem().exists(f"diloco-{region}"):  # a later run in the same emulation
            setup_store.create_bucket(f"diloco-{region}")
    # run.json {"spec": ...} and the secret (0600)
    run_dir, secret = create_run_directory(workdir / "runs", spec, launcher="local")
    # the manifest (the spec with the names) in every bucket, for `status --manifest`
    for bucket in setup.buckets(None):
        bucket.write_manifest(spec.to_json())
    return name, spec, setup, run_dir, secret


def check_probes(wan, spec, syncer_place: str) -> list[dict]:
    """Each region's bucket by its name from the region itself and from the syncer's place,
    two probes at a time (of different regions: each proxy then sees one of them): the
    region reaches it through its local proxy, the syncer's place through the remote one."""
    roots = {region.name: region.root for region in spec.regions}
    pairs = [[(region, region), (syncer_place, other)] for region, other in zip(REGIONS, (*REGIONS[1:], REGIONS[0]))]
    probes = []
    with ThreadPoolExecutor(max_workers=2) as pool:
        for pair in pairs:
            probes += list(pool.map(lambda job: probe_by_name(wan, job[0], job[1], roots[job[1]]), pair))
    for probe in probes:
        expected = "local" if probe["place"] == probe["region"] else "remote"
        if probe["answer"] != "ok" or probe["via"] != expected:
            raise RuntimeError(
                f"s3-{probe['region']} from {probe['place']} went {probe['via']}, not {expected}: {probe}"
            )
    return probes


def traffic_counters(wan) -> dict:
    """The regions' proxies' counters and every place's device bytes, now."""
    return {
        "proxies": {r: {kind: wan.regions[r].counters(kind) for kind in ("local", "remote")} for r in REGIONS},
        "devices": {label: device_bytes(wan[label]) for label in wan.places},
    }


def traffic_since(wan, before: dict) -> tuple[dict, dict]:
    """What the proxies passed and the devices carried since ``before``: ``(proxies, devices)``."""
    after = traffic_counters(wan)
    proxies = {
        r: {
            kind: {key: value - before["proxies"][r][kind][key] for key, value in after["proxies"][r][kind].items()}
            for kind in ("local", "remote")
        }
        for r in REGIONS
    }
    return proxies, device_deltas(before["devices"], after["devices"])


def run_processes(
    wan, spec, run_dir: Path, threads: int, syncer_place: str, timeout: float, stop: Callable[[], bool] | None = None
) -> dict:
    """The syncer, the reducers and the learners, each in its place, until the run ends
    or ``stop`` says so (learners that exit with payloads undelivered started again); the
    logs' ends on failure."""
    manifest, secret_file = str(run_dir / "run.json"), str(run_dir / "secret")
    env = process_env(threads=threads)
    processes = Processes(run_dir / "logs")
    secret_args = ["--manifest", manifest, "--secret-file", secret_file]
    try:
        launched = time.time()
        syncer_env = {**env, "OMP_NUM_THREADS": "1"}
        processes.start("syncer", wan[syncer_place].exec_prefix(), ["_syncer", *secret_args], syncer_env)
        for reducer in spec.reducers:
            command = ["_reducer", *secret_args, "--region", reducer.region]
            processes.start(reducer.name, wan[reducer.region].exec_prefix(), command, syncer_env)
        for learner in spec.learners:
            command = ["_learner", *secret_args, "--learner", learner.id]
            processes.start(learner.id, wan[learner.region].exec_prefix(), command, env)
        codes = processes.wait(timeout, stop)
        ended = time.time()
    except BaseException:
        for log in sorted((run_dir / "logs").glob("*.log")):
            print(f"--- {log.name}:\n{tail(log, 1500)}", file=sys.stderr)
        raise
    finally:
        processes.close()
    stopped = any(code is None for code in codes.values())
    return {
        "exit_codes": codes,
        "restarts": processes.restarts,
        "launched": launched,
        "ended": ended,
        "stopped": stopped,
    }


def stop_at_loss(setup, secret, target: float, every: float = 1.0) -> Callable[[], bool]:
    """True once the syncer's status (read through the setup endpoints, past the proxies'
    counters) holds an evaluation at or below ``target``; the buckets read at most every
    ``every`` seconds."""
    from diloco_cli.views.run_state import read_buckets

    last = [0.0]

    def reached() -> bool:
        if time.monotonic() - last[0] < every:
            return False
        last[0] = time.monotonic()
        status = read_buckets(setup, secret, time.time()).syncer
        return status is not None and any(e.loss <= target for e in status.evaluations)

    return reached


def diloco_on_wan(
    wan,
    overrides: Sequence[str],
    workdir: Path,
    timeout: float,
    syncer_place: str = SYNCER,
    stop_at: float | None = None,
) -> dict:
    """The whole run, learners, reducers and the syncer in their namespaces (the syncer in
    ``syncer_place``: its own place or a region), or with ``stop_at`` a held-out loss, the
    run until the syncer's first evaluation at or below it; what it measured."""
    from diloco_cli.config.files import load_recipe

    recipe = load_recipe(None, overrides)
    name, spec, setup, run_dir, secret = prepare_run(wan, recipe, overrides, workdir, syncer_place)
    probes = check_probes(wan, spec, syncer_place)
    before = traffic_counters(wan)
    stop = None if stop_at is None else stop_at_loss(setup, secret, stop_at)
    threads = recipe.training.threads_per_learner or 1
    ran = run_processes(wan, spec, run_dir, threads, syncer_place, timeout, stop)
    proxies, devices = traffic_since(wan, before)
    measured = measure_run(recipe, spec, setup, secret, ran["launched"])
    proxy_wan = sum(p["remote"]["bytes_to_upstream"] + p["remote"]["bytes_to_client"] for p in proxies.values())
    # every byte a place outside the regions moved crossed its link; a region's device also
    # carries its learners' and reducer's traffic with the other region (none: they stay home)
    wire_wan = sum(devices[place]["tx"] + devices[place]["rx"] for place in (syncer_place,) if place in devices)
    wan_bytes, tokens = measured.pop("wan_bytes"), measured["tokens"]
    kept = {key: measured.pop(key) for key in ("links", "syncer_kinds")}
    report, heartbeats = measured.pop("report"), measured.pop("heartbeats")
    return {
        "run": name,
        "spec_regions": [{"name": r.name, "root": r.root, "storage_options": r.storage_options} for r in spec.regions],
        "exit_codes": ran["exit_codes"],
        "stopped_at_target": ran["stopped"],
        "restarts": ran["restarts"],
        "launched": ran["launched"],
        "wall_seconds": ran["ended"] - ran["launched"],
        **measured,
        "wan_bytes": wan_bytes,
        "wan_bytes_per_token": wan_bytes / tokens,
        "proxy_wan_bytes": proxy_wan,
        "wan_bytes_per_token_proxy": proxy_wan / tokens,
        "metered_over_proxy": wan_bytes / proxy_wan - 1 if proxy_wan else None,
        "wire_wan_bytes": wire_wan,
        "wan_bytes_per_token_wire": wire_wan / tokens,
        **kept,
        "proxies": proxies,
        "devices": devices,
        "probes": probes,
        "report": report,
        "heartbeats": heartbeats,
    }


def measure_run(recipe, spec, setup, secret, launched: float) -> dict:
    """What the run's buckets say once it ended: the syncer's evaluations and versions,
    the learners' heartbeats and ``diloco report``'s traffic."""
    from diloco_cli.bandwidth.prices import load_prices
    from diloco_cli.views.report import collect_report, render_json
    from diloco_cli.views.run_state import read_buckets

    read = read_buckets(setup, secret, time.time())
    beats, status = read.heartbeats, read.syncer
    if status is None or len(beats) != len(spec.learners):
        raise RuntimeError(
            f"after the run: syncer status {'missing' if status is None else 'read'}, "
            f"{len(beats)} of {len(spec.learners)} heartbeats"
        )
    report = json.loads(render_json(collect_report(setup, secret, load_prices())))
    evaluations = [e.model_dump(mode="json") for e in status.evaluations]
    first_start = min(beat.started_at for beat in beats.values())
    training, sync = recipe.training, recipe.sync
    link_keys = ("source", "bucket", "wan", "requests", "bytes_up", "bytes_down", "seconds")
    return {
        "learners_started_after_seconds": first_start - launched,
        "versions": status.version,
        "versions_expected": training.inner_steps
        // sync.sync_interval
        * sync.num_fragments
        * training.num_learners
        // recipe.quorum,
        "evaluations": evaluations,
        "final_loss": evaluations[-1]["loss"],
        "tokens": report["tokens"],
        **learner_figures(beats, launched),
        "wan_bytes": report["wan_bytes"],
        "links": [{key: link[key] for key in link_keys} for link in report["links"]],
        "syncer_kinds": {
            region: {kind: traffic.model_dump() for kind, traffic in counters.kinds.items()}
            for region, counters in status.storage.items()
        },
        "report": {key: report[key] for key in REPORT_KEYS},
        "heartbeats": {
            learner: {key: getattr(beat, key, None) for key in HEARTBEAT_KEYS}
            for learner, beat in sorted(beats.items())
        },
    }
