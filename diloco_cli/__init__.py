"""diloco: train one PyTorch model across regions joined only by object storage.

An implementation of Decoupled DiLoCo (Google DeepMind, "Decoupled DiLoCo for Resilient
Distributed Pre-training", arXiv 2604.21428).

``diloco_cli.join(model, optimizer, tokens_per_step=...)`` makes your own training loop
a learner of a run (see :mod:`diloco_cli.runtime.learner.own_loop`); it is imported on first use, so that
the command line starts without torch.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["join"]


def __getattr__(name: str) -> Any:
    if name == "join":
        from diloco_cli.runtime.learner.own_loop import join

        return join
    raise AttributeError(f"module 'diloco_cli' has no attribute {name!r}")
