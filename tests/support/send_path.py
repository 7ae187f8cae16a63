"""The files one send passes through, counted by running it: ``python -m tests.support.send_path``.

A learner's send from ``after_step`` to the published update, with 1 and 2 syncer shards,
under K = M (the region's reducer forwards an aggregate) and K < M (it relays the send):
the harness (tests/support/harness.py) trains both learners to the step before a send,
then, with every Python call traced (threads too: the outbox uploads in its own), the
send step's ``after_step``, the reducer's turns and the syncers' turns until the update
is published.  Printed: each setting's ``diloco_cli`` modules, by folder, and their
count.  docs/layout.md lists them.  (What the send step's compute calls, its batch, the
model and the inner step, is before ``after_step`` and not counted; everything the
coordinators' turns do besides carrying the send, their heartbeats, status and upkeep, is.)
"""

from __future__ import annotations

import sys
import tempfile
import threading
from collections import defaultdict
from pathlib import Path

from diloco_cli.codec import RunSecret

PACKAGE = Path(__file__).resolve().parents[2] / "diloco_cli"


STEP = ("diloco_cli/models/", "diloco_cli/training/", "diloco_cli/data/")
"""The send step's own compute (its batch, forward, backward, AdamW), before ``after_step``."""


def _traced(action) -> set[str]:
    seen: set[str] = set()

    def profile(frame, event, _arg):
        if event == "call":
            name = frame.f_code.co_filename
            if name.startswith(str(PACKAGE)):
                seen.add(str(Path(name).relative_to(PACKAGE.parent)))

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        action()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return seen


def send_path(shards: int, quorum: int) -> set[str]:
    """The modules one send's path runs (see the module docstring)."""
    from tests.support.harness import Harness

    with tempfile.TemporaryDirectory() as folder:
        harness = Harness(Path(folder), RunSecret(bytes(range(32))), shards=shards, quorum=quorum)
        try:
            interval = harness.spec.recipe.sync.sync_interval
            for learner in harness.learners:
                for _ in range(interval - 1):
                    learner.loop.train_step()
                assert learner.sends.outbox.wait_empty(10)

            def the_send() -> None:
                for learner in harness.learners:
                    learner.loop.train_step()
                    assert learner.sends.outbox.wait_empty(10)
                harness.merge()

            return {name for name in _traced(the_send) if not name.startswith(STEP)}
        finally:
            harness.close()


def main() -> None:
    for shards, quorum in ((1, 2), (2, 2), (1, 1), (2, 1)):
        files = send_path(shards, quorum)
        kind = "aggregates (K = M)" if quorum == 2 else "relays (K < M)"
        print(f"{shards} shard(s), {kind}: {len(files)} files")
        by_folder = defaultdict(list)
        for name in sorted(files):
            by_folder[str(Path(name).parent)].append(Path(name).name)
        for folder, names in sorted(by_folder.items()):
            print(f"  {folder}/: {', '.join(names)}")


if __name__ == "__main__":
    main()
