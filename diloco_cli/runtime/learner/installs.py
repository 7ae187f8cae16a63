"""What a learner takes from the syncer: newer global weights, and its instructions.

A look for newer global weights (:mod:`.poller`) finishes on the storage rank: it
brings what was refused, the syncer's control note, and fetched fragments.
:class:`Installs` applies it to the fragments' bases and folds the note (drain, H, a
new slice of the data) and a signalled stop into the :class:`~.control.Instructions`;
then every process of the learner takes the same instructions and installs the new
bases into its parameters, overwriting the work since the fragment's last send or
keeping the work not sent yet (``sync.keep_unsent``), alike on every process.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from diloco_cli.core.types import FragmentIndex, Version
from diloco_cli.runtime.distributed import full_parameters, install_parameters
from diloco_cli.runtime.learner.context import LearnerContext
from diloco_cli.runtime.learner.control import Install, Instructions, StepControl, share
from diloco_cli.runtime.learner.heartbeats import Heartbeats
from diloco_cli.runtime.learner.poller import GlobalPoller, Poll
from diloco_cli.runtime.learner.progress import Progress
from diloco_cli.store.documents import LearnerState
from diloco_cli.store.filesystem import StorageError

log = logging.getLogger("diloco.learner")

Refused = Callable[[str, str, str], None]
"""Records an object refused: (kind, key, reason)."""


class Installs:
    """The learner's installs of global weights, and the instructions every process
    follows; ``poller`` and ``refused`` on the storage rank only."""

    def __init__(
        self,
        context: LearnerContext,
        model: torch.nn.Module,
        progress: Progress,
        poller: GlobalPoller | None = None,
        refused: Refused | None = None,
    ) -> None:
        self.context, self.model, self.progress, self.poller, self.refused = context, model, progress, poller, refused
        self.instructions = Instructions(sync_interval=context.recipe.sync.sync_interval)
        """What the run asks of the learner now (the same on every process after a step)."""

    @property
    def device(self) -> torch.device:
        """Where the model's parameters are (collectives exchange records there)."""
        return next(self.model.parameters()).device

    def install(self, poll: Poll | None, stop_signalled: bool) -> tuple[Install, ...]:
        """Every process: the storage rank applies a finished look (``poll``) to its
        bases and follows the syncer's note (and a signalled stop); then every process
        takes the same instructions and installs the new bases into its parameters."""
        fragment_list, group, fragments = self.context.fragment_list, self.context.group, self.context.fragments
        installs = (Install.NONE,) * len(fragment_list)
        if poll is not None:
            installed = self.apply(poll)
            installs = tuple(
                Install.NONE if p not in installed else Install.KEEP_UNSENT if installed[p] else Install.OVERWRITE
                for p in range(len(fragment_list))
            )
        if stop_signalled:  # at a step boundary, where every process can stop alike
            self.instructions = replace(self.instructions, stop=True)
        control = share(group, StepControl(self.instructions, installs), self.device)
        self.instructions = control.instructions
        overwritten = self._names(control.installs, Install.OVERWRITE)
        kept = self._names(control.installs, Install.KEEP_UNSENT)
        storage = group.is_storage_rank
        if overwritten:
            install_parameters(self.model, fragments.base if storage else None, overwritten, group)
        if kept:  # the global version plus the work not sent yet
            theta = full_parameters(self.model, kept, group)
            with_unsent = fragments.with_unsent(kept, theta) if storage else None
            install_parameters(self.model, with_unsent, kept, group)
        return control.installs

    def _names(self, installs: tuple[Install, ...], how: Install) -> list[str]:
        fragment_list = self.context.fragment_list
        return [name for p, mode in enumerate(installs) if mode == how for name in fragment_list[p].parameter_names]

    def apply(self, poll: Poll) -> dict[FragmentIndex, bool]:
        """Storage rank: what a look refused, the syncer's note, and the fetched
        fragments into the bases (see :meth:`GlobalPoller.apply`)."""
        for refusal in poll.refusals:
            self.refused(refusal.kind, refusal.key, refusal.reason)
        if poll.control is not None:
            self.instructions = self.instructions.following(poll.control, self.context.recipe.sync.sync_interval)
        fragments = self.context.fragments
        installed = self.poller.apply(poll, fragments, self.context.secret, self.refused)
        if installed:
            self.progress.count_installs(fragments.install_lag[p] for p in installed)
        return installed

    def wait_for_global_weights(self, heartbeats: Heartbeats, stopped: Callable[[], bool]) -> None:
        """Storage rank, at a start with no checkpoint: look for the global weights until
        every fragment has a base (or a stop is signalled), reporting that it waits."""
        fragments = self.context.fragments
        while not fragments.installed and not stopped():
            heartbeats.beat(LearnerState.WAITING)  # with what it refused: the syncer repairs it
            missing = {p: Version(-1) for p, v in fragments.base_version.items() if v < 0}
            try:
                self.apply(self.poller.look_now(missing))
            except StorageError as error:
                log.warning("looking for global weights failed: %s", error)
            if not fragments.installed:
                time.sleep(self.context.recipe.training.poll_seconds)
