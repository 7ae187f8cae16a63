"""A learner that runs the user's own training script (``training.entry_point``).

The launcher starts every learner the same way (``diloco _learner``, under torchrun when
it has several processes); when the recipe names a script, the learner process runs it
as ``__main__`` with the run's context in its environment, where
:func:`diloco_cli.join` finds it.  So ``up``, ``resume``, ``down``, supervision and the
SSH launcher need nothing of their own for it.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

from diloco_cli.store.run_spec import RunSpec

MANIFEST_VARIABLE = "DILOCO_MANIFEST"
LEARNER_VARIABLE = "DILOCO_LEARNER"
SECRET_FILE_VARIABLE = "DILOCO_SECRET_FILE"
STORAGE_OPTIONS_VARIABLE = "DILOCO_STORAGE_OPTIONS"
SHARD_VARIABLE = "DILOCO_SHARD"
NUM_SHARDS_VARIABLE = "DILOCO_NUM_SHARDS"
"""This learner's data shard and the number of shards: for scripts that build their
data before :func:`diloco_cli.join` (a ``Trainer``'s dataset)."""


def run_entry_point(spec: RunSpec, manifest: str, learner: str, secret_file: str, storage_options: dict) -> int:
    """Run the recipe's script as this learner; returns its exit code (0 when it just ends)."""
    script = str(spec.recipe.training.entry_point)
    path = Path(script)
    if not path.is_file():
        raise FileNotFoundError(
            f"training.entry_point {script!r}: no such file on this host (the path must exist on every learner host)"
        )
    shard, num_shards = spec.data_partition(learner)
    os.environ.update(
        {
            MANIFEST_VARIABLE: manifest,
            LEARNER_VARIABLE: learner,
            SECRET_FILE_VARIABLE: secret_file,
            STORAGE_OPTIONS_VARIABLE: json.dumps(storage_options),
            SHARD_VARIABLE: str(shard),
            NUM_SHARDS_VARIABLE: str(num_shards),
        }
    )
    sys.argv = [str(path)]
    sys.path.insert(0, str(path.resolve().parent))
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as exit:
        return exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
    return 0
