"""bench.wan's DiLoCo run on the longer schedule stops at the target: the processes are
left as they are once the stop says so (and ended when closed), and the stop reads the
syncer's evaluations at most so often."""

import os
from types import SimpleNamespace

import diloco_cli.views.run_state
from bench.wan_diloco import Processes, stop_at_loss


def test_waiting_ends_as_soon_as_the_stop_says_so_and_closing_ends_the_processes(tmp_path):
    processes = Processes(tmp_path)
    processes.start("sleeper", ["sh", "-c", "sleep 60", "sh"], [], dict(os.environ))  # the CLI's arguments ignored
    asked = []
    try:
        codes = processes.wait(30, lambda: asked.append(1) or len(asked) == 2)
    finally:
        processes.close()
    assert codes == {"sleeper": None} and len(asked) == 2  # still running when the stop said so
    assert processes.running["sleeper"].returncode is not None


def test_the_stop_reads_the_syncers_evaluations_at_most_every_so_often(monkeypatch):
    losses = [[3.0], [3.0, 2.6], [3.0, 2.6, 2.4]]
    reads = []

    def read_buckets(spec, secret, now):
        reads.append(spec)
        evaluations = [SimpleNamespace(loss=loss) for loss in losses[len(reads) - 1]]
        return SimpleNamespace(syncer=SimpleNamespace(evaluations=evaluations))

    monkeypatch.setattr(diloco_cli.views.run_state, "read_buckets", read_buckets)
    throttled = stop_at_loss("spec", "secret", 2.5, every=3600)
    assert not throttled() and not throttled() and len(reads) == 1  # the second call reads nothing
    reached = stop_at_loss("spec", "secret", 2.5, every=0)
    assert not reached() and reached() and len(reads) == 3  # 2.6 is above 2.5, 2.4 at or below it
