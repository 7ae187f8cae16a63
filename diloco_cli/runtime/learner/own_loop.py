"""Make your own training loop a learner of a diloco run.

Most users already have a training script: a plain PyTorch loop, the Hugging Face
``Trainer``, a torchtitan-style trainer.  :func:`join` wraps its model and inner
optimizer; every ``optimizer.step()`` then also does what the built-in learner does after
a step (sends the fragments due, installs newer global weights, heartbeats, checkpoints),
through the same store protocol, codecs and checkpoints::

    import diloco_cli

    model, optimizer = build()                      # any nn.Module, any torch optimizer
    with diloco_cli.join(model, optimizer, tokens_per_step=batch * length) as run:
        for step in range(run.step, run.total_steps):   # resumes where the learner was
            loss = loss_of(model, batch_for(step, run.shard, run.num_shards))
            loss.backward()
            optimizer.step()                          # the learner's duties happen here
            optimizer.zero_grad()
            run.loss = loss.item()                    # optional: shown by `diloco status`
            if run.stop_requested:                    # `diloco down`, SIGTERM
                break

Name the script in the recipe (``training.entry_point: train.py``) and ``diloco up``,
``status``, ``report`` and ``down`` work unchanged: each learner process runs the script
with the run's context in its environment.  Under ``torchrun`` (``processes_per_learner``
> 1) every process calls :func:`join` with its own (DDP-wrapped or FSDP-sharded) model.
Leaving the ``with`` block finishes the learner: what is left is sent and delivered, a
last checkpoint written; a learner that could not deliver or was stopped exits with the
code its supervisor expects.  See docs/your-own-loop.md.
"""

from __future__ import annotations

import json
import os
import signal
import time
from types import TracebackType
from typing import Any

import torch

from diloco_cli.runtime.distributed import ProcessGroup
from diloco_cli.runtime.entry_point import (
    LEARNER_VARIABLE,
    MANIFEST_VARIABLE,
    SECRET_FILE_VARIABLE,
    STORAGE_OPTIONS_VARIABLE,
)
from diloco_cli.runtime.learner.context import DataPosition, TrainedModel
from diloco_cli.runtime.learner.sync import EXIT_FINISHED, LearnerSync


class NotInARun(RuntimeError):
    """The script was started outside a diloco run (no run context in the environment)."""


def _process_group() -> ProcessGroup:
    """This process's place in its learner (torch.distributed, if the script started it)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return ProcessGroup(
            rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=int(os.environ.get("LOCAL_RANK", "0"))
        )
    return ProcessGroup()


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The model itself, not a DDP wrapper around it (parameter names without ``module.``)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


class JoinedRun:
    """A training loop's membership in a run: use it as a context manager."""

    def __init__(
        self, sync: LearnerSync, optimizer: torch.optim.Optimizer, step_hook: bool, handle_signals: bool
    ) -> None:
        self.sync = sync
        self.loss: float | None = None
        """Set it after a step to have the loss shown by ``diloco status``."""
        self.exit_code: int | None = None
        self._optimizer, self._step_hook, self._handle_signals = optimizer, step_hook, handle_signals
        self._hook: Any = None
        self._last_step_end: float | None = None
        self._previous_handlers: dict[int, Any] = {}

    # what a loop needs to know
    @property
    def step(self) -> int:
        """Inner steps this learner has taken (where a restarted learner resumes)."""
        return self.sync.step

    @property
    def total_steps(self) -> int:
        """The recipe's ``training.inner_steps``."""
        return self.sync.total_steps

    @property
    def shard(self) -> int:
        """This learner's data shard: read only your part of the data.  Read it at
        every step: when the run is scaled (``diloco scale``) the data is cut anew."""
        return self.sync.data_partition[0]

    @property
    def num_shards(self) -> int:
        """How many shards the data is cut into now (the active learners)."""
        return self.sync.data_partition[1]

    @property
    def learner_id(self) -> str:
        return self.sync.me.id

    @property
    def recipe(self) -> Any:
        return self.sync.recipe

    @property
    def stop_requested(self) -> bool:
        """Whether the learner was asked to stop (``diloco down``) or to leave the run
        (``diloco scale --learners -N``): leave the loop."""
        return self.sync.leaving

    def step_done(self, loss: float | None = None, tokens: int | None = None) -> None:
        """Tell the run that one inner step finished (not needed with the optimizer hook,
        which ``join`` installs by default)."""
        now = time.perf_counter()
        seconds = None if self._last_step_end is None else now - self._last_step_end
        self._last_step_end = now
        self.sync.after_step(self.loss if loss is None else loss, seconds, tokens)

    # the context manager
    def __enter__(self) -> JoinedRun:
        if self._handle_signals:
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous_handlers[signum] = signal.signal(signum, self._request_stop)
        self.sync.start()
        self._last_step_end = time.perf_counter()
        if self._step_hook:
            self._hook = self._optimizer.register_step_post_hook(lambda optimizer, args, kwargs: self.step_done())
        return self

    def _request_stop(self, signum: int, _frame: object) -> None:
        self.sync.request_stop()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self._hook is not None:
            self._hook.remove()
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        if error is not None:
            self.sync.failed()
            self.sync.close()
            return
        self.exit_code = self.sync.finish(finished=self.sync.drain_requested or not self.sync.stop_requested)
        if self.exit_code != EXIT_FINISHED:
            raise SystemExit(self.exit_code)


def join(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    tokens_per_step: int,
    data_position: DataPosition | None = None,
    step_hook: bool = True,
    handle_signals: bool = True,
) -> JoinedRun:
    """Join the diloco run this process was started in, as the learner it was started as.

    ``model`` (the module itself, or DDP around it, or an FSDP2-sharded module) and its
    inner ``optimizer`` are the learner's; ``tokens_per_step`` counts one step's tokens
    (all processes of the learner together) for token-weighted merging.  With
    ``step_hook`` every ``optimizer.step()`` is a step of the run; without it, call
    :meth:`JoinedRun.step_done` after each step.  ``data_position`` saves and restores
    where your loop is in its data with each checkpoint (by default a restarted learner
    resumes at :attr:`JoinedRun.step` and your loop finds its data from that).
    """
    from diloco_cli.runtime.membership import ManifestWatch
    from diloco_cli.store.run_spec import read_run_spec, read_secret

    missing = [name for name in (MANIFEST_VARIABLE, LEARNER_VARIABLE, SECRET_FILE_VARIABLE) if not os.environ.get(name)]
    if missing:
        raise NotInARun(
            f"{', '.join(missing)} not set: diloco_cli.join() runs inside a diloco run; name this script in the recipe "
            "(training.entry_point) and start it with `diloco up`"
        )
    options = json.loads(os.environ.get(STORAGE_OPTIONS_VARIABLE) or "{}")
    watch = ManifestWatch(os.environ[MANIFEST_VARIABLE], options)
    spec = read_run_spec(os.environ[MANIFEST_VARIABLE], options)
    secret = read_secret(os.environ[SECRET_FILE_VARIABLE])
    trained = TrainedModel(_unwrapped(model), optimizer, _process_group(), tokens_per_step, data_position)
    sync = LearnerSync(spec, os.environ[LEARNER_VARIABLE], secret, trained, watch)
    return JoinedRun(sync, optimizer, step_hook, handle_signals)
