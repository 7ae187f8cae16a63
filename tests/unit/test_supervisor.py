"""What a supervisor records of a crash, from the child's log (the supervisor's restarts
over real processes: tests/integration/test_cli_processes.py)."""

import signal

from diloco_cli.launch.supervisor import exit_reason, last_error

PROGRESS = (
    "2026-12-03 17:00:01,120 diloco_cli.runtime.learner INFO step 40/400 loss 3.21\n"
    "2026-12-03 17:00:02,340 diloco_cli.runtime.learner INFO sent fragment 1 at step 40\n"
)


def test_a_routine_info_line_is_never_the_last_error(tmp_path):
    """A child killed while it logged only progress has no error line: None, and the
    supervisor says how it ended instead."""
    log = tmp_path / "learner.log"
    log.write_text("[supervisor 2026-12-03 17:00:00] starting (restart 0): python -m x\n" + PROGRESS)
    assert last_error(log) is None
    assert exit_reason(-signal.SIGKILL) == "killed by SIGKILL" and exit_reason(3) == "exit 3"


def test_the_last_error_is_the_traceback_or_a_warning_of_this_childs_own_output(tmp_path):
    log = tmp_path / "learner.log"
    earlier = "Traceback (most recent call last):\nRuntimeError: an earlier child's crash\n"
    log.write_text(earlier + PROGRESS)
    start = len(earlier.encode())
    assert last_error(log) == "RuntimeError: an earlier child's crash"
    assert last_error(log, start) is None  # the child killed after it: not its error
    with open(log, "a") as more:
        more.write("2026-12-03 17:00:03,000 diloco_cli.store WARNING bucket local-a: retrying a put\n" + PROGRESS)
    assert last_error(log, start).endswith("WARNING bucket local-a: retrying a put")
