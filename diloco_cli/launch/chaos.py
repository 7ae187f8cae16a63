"""The chaos driver: the process faults of a run's chaos plan, at their times.

Started by ``diloco up --chaos`` as one more supervised process of the run (on the
launching machine, stopped by ``diloco down`` like the others).  It walks the plan's
schedule (:func:`diloco_cli.config.chaos.process_events`, the same for the same seed):
SIGKILL a learner, a reducer or the syncer, SIGSTOP a learner and SIGCONT it after a while.  The
target is the supervised child (the learner, reducer or syncer itself, not its supervisor, which
restarts it as it would after a real crash), here or on its SSH host.  Every event is
logged and written as ``chaos.json`` into every region's bucket, where ``diloco status``
shows it.  Storage outages need no driver: every process injects them itself.
"""

from __future__ import annotations

import heapq
import logging
import os
import signal
import time

from diloco_cli.config.chaos import ChaosPlan, ProcessEvent, process_events
from diloco_cli.launch.runs import RunRecord, load_run
from diloco_cli.store.documents import CHAOS_EVENTS_KEPT, ChaosEvent, ChaosLog, SyncerPhase
from diloco_cli.store.filesystem import StorageError

log = logging.getLogger("diloco.chaos")

SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "continue": signal.SIGCONT}
LOOK_SECONDS = 2.0
"""How often the driver looks whether the run has finished, between events."""


class ChaosDriver:
    def __init__(self, record: RunRecord) -> None:
        self.record, self.spec = record, record.spec
        if self.spec.chaos is None:
            raise ValueError(f"run {record.name} has no chaos plan")
        self.plan = self.spec.chaos
        self.buckets = self.spec.buckets(record.secret())
        self.log = self._earlier_log()

    def _earlier_log(self) -> ChaosLog:
        """The events injected so far (by an earlier plan, or before a restart), so that
        the log and its count go on."""
        logs = []
        for bucket in self.buckets:
            try:
                logs.append(bucket.read_chaos_log())
            except (StorageError, ValueError):
                continue
        return max((log for log in logs if log is not None), key=lambda log: log.count, default=ChaosLog())

    def run(self) -> int:
        """Inject every fault that falls due until the run is over; returns 0."""
        origin = self.spec.created + self.plan.begins_at_seconds
        now = time.time() - origin
        queue = [
            (event.at_seconds, index, event)
            for index, event in enumerate(
                process_events(
                    self.plan,
                    [learner.id for learner in self.spec.learners],
                    [r.name for r in self.spec.reducers],
                    syncers=[shard.name for shard in self.spec.syncer_shards],
                )
            )
        ]
        queue = [item for item in queue if item[0] >= now]  # a restarted driver does not replay the past
        heapq.heapify(queue)
        while queue and not self._run_over():
            at, index, event = queue[0]
            wait = origin + at - time.time()
            if wait > 0:
                time.sleep(min(wait, LOOK_SECONDS))
                continue
            heapq.heappop(queue)
            self._apply(event)
            if event.action == "stop" and event.seconds:
                heapq.heappush(
                    queue,
                    (
                        at + event.seconds,
                        -index - 1,
                        ProcessEvent(at_seconds=at + event.seconds, action="continue", target=event.target),
                    ),
                )
        return 0

    def _apply(self, event: ProcessEvent) -> None:
        outcome = self._signal(event.target, SIGNALS[event.action])
        log.info("%s %s: %s", event.action, event.target, outcome)
        self.log.events = [
            *self.log.events,
            ChaosEvent(time=time.time(), action=event.action, target=event.target, outcome=outcome),
        ][-CHAOS_EVENTS_KEPT:]
        self.log.count += 1
        for bucket in self.buckets:
            try:
                bucket.write_chaos_log(self.log)
            except StorageError as error:  # an outage of that region, perhaps: the next event writes again
                log.warning("could not record the event in region %s: %s", bucket.name, error)

    def _signal(self, process: str, signum: int) -> str:
        self.record = load_run(self.record.directory.parent, self.record.name)  # its processes, as recorded now
        host = self.record.placement().get(process, "local")
        if host == "local":
            state = self.record.process_state(process) or {}
            pid = state.get("child_pid")
            if not pid:
                return "not running"
            try:
                os.kill(int(pid), signum)
            except ProcessLookupError:
                return "not running"
            return "done"
        return self._signal_remote(host, process, signum)

    def _signal_remote(self, host_name: str, process: str, signum: int) -> str:
        from diloco_cli.launch.remote import connect_recorded_host, remote_paths, supervisor_states
        from diloco_cli.launch.ssh import SSHError, run

        try:
            client, host = connect_recorded_host(self.record.hosts, self.record.ssh, host_name)
            try:
                state = supervisor_states(client, remote_paths(client, host, self.record.name)).get(process, {})
                pid = state.get("child_pid")
                if not pid:
                    return "not running"
                result = run(client, f"kill -{int(signum)} {int(pid)}")
                return "done" if result.code == 0 else f"kill failed on {host_name}: {result.stderr.strip()[-200:]}"
            finally:
                client.close()
        except (SSHError, OSError) as error:
            return f"host {host_name} not reached: {error}"

    def _run_over(self) -> bool:
        """Whether every syncer shard (the syncer) has finished, as any region shows it."""
        shards = len(self.spec.syncer_shards)
        return all(self._finished(shard) for shard in range(shards))

    def _finished(self, shard: int) -> bool:
        for bucket in self.buckets:
            try:
                status = bucket.syncer_shards(len(self.spec.syncer_shards))[shard].read_syncer_status()
            except (StorageError, ValueError):
                continue
            if status is not None and status.state == SyncerPhase.FINISHED:
                return True
        return False


def chaos_run(record: RunRecord, text: str, emit=lambda line: None) -> ChaosPlan:
    """``diloco chaos RUN SPEC``: give a running run a new chaos plan, its times counted
    from now.  Outages reach the processes through the manifest they follow; the driver
    (for kills and pauses) is started again with the new plan, or stopped if it has none."""
    from dataclasses import asdict

    from diloco_cli.config.chaos import parse_chaos
    from diloco_cli.launch.live import check_running, publish_spec
    from diloco_cli.launch.local import CHAOS_PROCESS, start_chaos_driver
    from diloco_cli.launch.processes import ProcessRecord, stop_supervised
    from diloco_cli.launch.resolve import with_chaos

    check_running(record, "inject faults into")
    plan = parse_chaos(text).model_copy(update={"begins_at_seconds": max(0.0, time.time() - record.spec.created)})
    publish_spec(record, with_chaos(record.spec, plan))
    drivers = [ProcessRecord(**p) for p in record.processes if p["name"] == CHAOS_PROCESS]
    if drivers:
        stop_supervised(drivers, record.directory, timeout=10)
        emit(f"  {CHAOS_PROCESS:<16} {'local':<12} stopped (its plan is replaced)")
    record.processes = [p for p in record.processes if p["name"] != CHAOS_PROCESS]
    if plan.has_process_faults:
        record.processes.append(asdict(start_chaos_driver(record.directory)))
        emit(f"  {CHAOS_PROCESS:<16} {'local':<12} started with the new plan")
    record.save()
    return plan
