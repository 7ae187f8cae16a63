"""What the syncer holds, and how it is made durable and restored.

The global weights Theta, the outer momentum, the carried publication error and the
window of recent updates, per fragment.  Each merge is committed to the home store
(:class:`~diloco_cli.store.home.SyncerHome`) before it is published; a restarted syncer
rebuilds everything from the initial weights and the newest commit of each fragment, and
its ledger (the merged and retired payload keys) from all commit markers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from diloco_cli.codec import CodecSpec, RunSecret, decode_payload, encode_payload
from diloco_cli.codec.exact import ExactPublisher
from diloco_cli.core.anchor import UpdateWindow
from diloco_cli.core.fragments import Fragment
from diloco_cli.core.outer import NesterovOuterOptimizer
from diloco_cli.core.types import FragmentIndex, Version
from diloco_cli.store.home import Commit, SyncerHome

STATE_SPEC = CodecSpec(codec="fp32", zstd_level=0)
INITIAL_SPEC = CodecSpec(codec="fp32", zstd_level=1)


@dataclass
class SyncerState:
    """The syncer's tensors and bookkeeping for every fragment."""

    fragments: tuple[Fragment, ...]
    theta: dict[str, torch.Tensor]
    optimizer: NesterovOuterOptimizer
    publisher: ExactPublisher
    windows: dict[FragmentIndex, UpdateWindow]
    fragment_versions: dict[FragmentIndex, Version]
    version: Version = Version(0)
    ledger: set[str] = field(default_factory=set)
    """Payload keys (``<region>:<key>``) consumed: merged or superseded."""
    commits: list[Commit] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    """Restored from the newest commit: EMAs, counters."""

    def fragment_theta(self, fragment: FragmentIndex) -> dict[str, torch.Tensor]:
        return {name: self.theta[name] for name in self.fragments[fragment].parameter_names}


def _update_loader(home: SyncerHome, version: Version, secret: RunSecret):
    return lambda: decode_payload(home.read_update(version), secret).tensors


def encode_fragment_state(state: SyncerState, fragment: FragmentIndex, secret: RunSecret) -> bytes:
    names = state.fragments[fragment].parameter_names
    momentum = state.optimizer.state_tensors()
    carries = state.publisher.carry_tensors()
    tensors = [(f"theta/{name}", state.theta[name]) for name in names]
    tensors += [(f"momentum/{name}", momentum[f"{fragment}/{name}"]) for name in names if f"{fragment}/{name}" in momentum]
    tensors += [(f"carry/{name}", carries[f"{fragment}/{name}"]) for name in names if f"{fragment}/{name}" in carries]
    return encode_payload(tensors, STATE_SPEC, secret, {"fragment": fragment})


def restore_state(
    home: SyncerHome,
    secret: RunSecret,
    fragments: tuple[Fragment, ...],
    initial_theta: dict[str, torch.Tensor],
    optimizer: NesterovOuterOptimizer,
    publisher: ExactPublisher,
    window_versions: int,
) -> SyncerState:
    """Rebuild the syncer's state from its home store (initial weights + commits)."""
    initial = home.read_initial()
    if initial is None:
        home.write_initial(encode_payload(initial_theta.items(), INITIAL_SPEC, secret, {"version": 0}))
        theta = {name: tensor.detach().to(torch.float32).clone() for name, tensor in initial_theta.items()}
    else:
        theta = decode_payload(initial, secret).tensors
    commits = home.commits()
    windows = {f.index: UpdateWindow(window_versions) for f in fragments}
    versions = {f.index: Version(0) for f in fragments}
    momentum, carries = {}, {}
    newest_by_fragment: dict[FragmentIndex, Commit] = {}
    for commit in commits:
        newest_by_fragment[commit.fragment] = commit
        versions[commit.fragment] = commit.version
        windows[commit.fragment].record(commit.version, _update_loader(home, commit.version, secret))
    for fragment, commit in newest_by_fragment.items():
        tensors = decode_payload(home.read_state(commit.version), secret).tensors
        for key, tensor in tensors.items():
            kind, _, name = key.partition("/")
            if kind == "theta":
                theta[name].copy_(tensor)
            elif kind == "momentum":
                momentum[f"{fragment}/{name}"] = tensor
            elif kind == "carry":
                carries[f"{fragment}/{name}"] = tensor
    optimizer.load_state_tensors(momentum)
    publisher.load_carry_tensors(carries)
    ledger = {key for commit in commits for key in commit.merged + commit.retired}
    return SyncerState(
        fragments=fragments,
        theta=theta,
        optimizer=optimizer,
        publisher=publisher,
        windows=windows,
        fragment_versions=versions,
        version=max((c.version for c in commits), default=Version(0)),
        ledger=ledger,
        commits=commits,
        meta=commits[-1].meta if commits else {},
    )


def commit_merge(
    home: SyncerHome,
    state: SyncerState,
    secret: RunSecret,
    fragment: FragmentIndex,
    version: Version,
    update: bytes,
    merged: list[str],
    retired: list[str],
    meta: dict[str, Any],
    keep_updates_after: Version,
) -> Commit:
    """Make a merged version durable, then drop state files that no restart needs.

    The merge round has already advanced ``state`` (Theta, momentum, carry, window).
    Update files stay while the window needs them or while they are newer than
    ``keep_updates_after`` (regions may still have to be given them after a restart)."""
    home.commit(version, fragment, update, encode_fragment_state(state, fragment, secret), merged, retired, meta)
    commit = Commit(version, fragment, tuple(merged), tuple(retired), {**meta, "version": version, "fragment": fragment})
    previous = [c for c in state.commits if c.fragment == fragment]
    state.commits.append(commit)
    state.ledger.update(merged + retired)
    state.version = version
    state.fragment_versions[fragment] = version
    if previous:
        home.delete_state(previous[-1].version)
    kept = set(state.windows[fragment].versions)
    for old in previous:
        if old.version not in kept and old.version <= keep_updates_after:
            home.delete_update(old.version)
    return commit
