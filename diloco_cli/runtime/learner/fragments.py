"""A learner's bookkeeping per fragment: its base, counters and error-feedback residual.

Algorithm (Decoupled DiLoCo, arXiv 2604.21428; docs/algorithm.md, "A learner"):

* after each inner step every fragment's ``c_steps`` and ``c_tokens`` grow;
* when fragment p is due the learner sends ``delta = base[p] - theta[p] + e[p]``
  quantized, and keeps ``e[p] = delta - decode(encode(delta))`` (error feedback);
* when a newer global version of p is available it overwrites ``theta[p]`` with it
  (overwriting beats blending as M grows), sets ``base[p]`` and ``base_version[p]`` and
  resets the counters; the inner AdamW state is kept.

``base`` and ``e`` live on the CPU in fp32, whatever the model's device, dtype or
sharding: this bookkeeping is kept by the storage rank alone, which is handed the full
parameter values when it sends (``theta``) and whose installed bases the learner then
copies into every process's parameters (:mod:`diloco_cli.runtime.distributed`).

Installing overwrites what the learner trained on a fragment since its last send of it;
``tokens_overwritten`` counts those tokens, so that every token trained is accounted
for: in a merged payload, or overwritten by an install.  With ``keep_unsent`` (the
recipe's ``sync.install: keep-unsent``) an install keeps that work instead:
``theta[p] = Theta[p] + (theta[p] - origin[p])``, where ``origin[p]`` is theta at the
fragment's last send (its base when it has not been sent since the last install), and
the counters keep the unsent steps and tokens, so the next send carries them (its delta
``base - theta`` is exactly the unsent work).  The in-flight send is anchored to the
base it was made from, so nothing is counted twice.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from diloco_cli.codec import CodecSpec, RunSecret, encode_payload
from diloco_cli.core.fragments import Fragment
from diloco_cli.core.types import FragmentIndex, Version


class LearnerFragments:
    """Bases, versions, counters and residuals of every fragment of one learner."""

    def __init__(
        self, fragments: tuple[Fragment, ...], shapes: Mapping[str, torch.Size], keep_unsent: bool = False
    ) -> None:
        self.fragments = fragments
        self.base = {name: torch.zeros(shape, dtype=torch.float32) for name, shape in shapes.items()}
        self.residual = {name: torch.zeros(shape, dtype=torch.float32) for name, shape in shapes.items()}
        self.keep_unsent = keep_unsent
        self.origin = (
            {name: torch.zeros(shape, dtype=torch.float32) for name, shape in shapes.items()} if keep_unsent else {}
        )
        """theta at each fragment's last send, or its base since the last install (only
        with ``keep_unsent``: a third copy of the model on the CPU)."""
        self.base_version = {fragment.index: Version(-1) for fragment in fragments}
        self.c_steps = {fragment.index: 0 for fragment in fragments}
        self.c_tokens = {fragment.index: 0 for fragment in fragments}
        self.sent_tokens = {fragment.index: 0 for fragment in fragments}
        """``c_tokens`` at the fragment's last send since its last install."""
        self.sent_steps = {fragment.index: 0 for fragment in fragments}
        """``c_steps`` at the fragment's last send since its last install."""
        self.tokens_overwritten = {fragment.index: 0 for fragment in fragments}
        self.install_serial = {fragment.index: 0 for fragment in fragments}
        """Installs of each fragment so far (a payload made after an install does not
        hold what was sent before it)."""
        self.install_lag: dict[FragmentIndex, int | None] = {fragment.index: None for fragment in fragments}
        """Per fragment, the steps trained between its last send and its last install (None
        when nothing was sent since the install before): how stale the merge it installed
        was, counted in the learner's own steps."""

    def names(self, fragment: FragmentIndex) -> tuple[str, ...]:
        return self.fragments[fragment].parameter_names

    @property
    def installed(self) -> bool:
        """Whether every fragment holds some global version."""
        return all(version >= 0 for version in self.base_version.values())

    @property
    def awaiting_merge(self) -> tuple[FragmentIndex, ...]:
        """The fragments whose send awaits its merge: sent with steps in them since their
        last install."""
        return tuple(fragment for fragment, steps in self.sent_steps.items() if steps > 0)

    def count_step(self, tokens: int) -> None:
        for fragment in self.c_steps:
            self.c_steps[fragment] += 1
            self.c_tokens[fragment] += tokens

    def _deltas(self, fragment: FragmentIndex, theta: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.names(fragment):
            yield (
                name,
                self.base[name] - theta[name].detach().to(device="cpu", dtype=torch.float32) + self.residual[name],
            )

    def encode_delta(
        self,
        fragment: FragmentIndex,
        theta: Mapping[str, torch.Tensor],
        spec: CodecSpec,
        secret: RunSecret,
        meta: Mapping[str, Any],
    ) -> bytes:
        """The payload of ``base - theta + e`` for one fragment (``theta``: the full values
        of its parameters now, always differenced in fp32); ``e`` becomes the new error."""
        full_meta = {
            **meta,
            "fragment": fragment,
            "base_version": self.base_version[fragment],
            "c_steps": self.c_steps[fragment],
            "c_tokens": self.c_tokens[fragment],
        }
        residuals = {name: self.residual[name] for name in self.names(fragment)}
        payload = encode_payload(self._deltas(fragment, theta), spec, secret, full_meta, residuals_into=residuals)
        self.sent_tokens[fragment] = self.c_tokens[fragment]
        self.sent_steps[fragment] = self.c_steps[fragment]
        for name in self.origin and self.names(fragment):
            self.origin[name].copy_(theta[name].detach().to(device="cpu", dtype=torch.float32))
        return payload

    @torch.no_grad()
    def install(
        self,
        fragment: FragmentIndex,
        version: Version,
        values: Mapping[str, torch.Tensor] | None = None,
        keep_unsent: bool | None = None,
    ) -> bool:
        """Make ``values`` (or the base as it is) the fragment's base at ``version``.
        Returns whether the unsent work is kept: then the caller installs
        :meth:`with_unsent` of theta[p]; else theta[p] becomes the base, the counters
        start again and the unsent tokens are counted as overwritten."""
        keep = (self.keep_unsent if keep_unsent is None else keep_unsent) and self.base_version[fragment] >= 0
        sent = self.sent_steps[fragment] > 0
        self.install_lag[fragment] = self.c_steps[fragment] - self.sent_steps[fragment] if sent else None
        if values is not None:
            for name in self.names(fragment):
                self.base[name].copy_(values[name])
        self.base_version[fragment] = version
        if keep:
            self.c_steps[fragment] -= self.sent_steps[fragment]
            self.c_tokens[fragment] -= self.sent_tokens[fragment]
        else:
            self.tokens_overwritten[fragment] += self.c_tokens[fragment] - self.sent_tokens[fragment]
            self.c_steps[fragment] = self.c_tokens[fragment] = 0
            for name in self.origin and self.names(fragment):
                self.origin[name].copy_(self.base[name])
        self.sent_steps[fragment] = self.sent_tokens[fragment] = 0
        self.install_serial[fragment] += 1
        return keep

    @torch.no_grad()
    def with_unsent(self, names: list[str], theta: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``base + (theta - origin)`` for these parameters (of fragments just installed
        keeping their unsent work), which becomes their new origin's reference: the
        origin moves to the base, since the work carried over is unsent again."""
        values = {}
        for name in names:
            values[name] = self.base[name] + (
                theta[name].detach().to(device="cpu", dtype=torch.float32) - self.origin[name]
            )
            self.origin[name].copy_(self.base[name])
        return values

    # ------------------------------------------------------------------ checkpoints

    def state_tensors(self) -> dict[str, torch.Tensor]:
        tensors = {f"base/{name}": tensor for name, tensor in self.base.items()}
        tensors.update({f"residual/{name}": tensor for name, tensor in self.residual.items()})
        tensors.update({f"origin/{name}": tensor for name, tensor in self.origin.items()})
        return tensors

    COUNTERS = ("base_version", "c_steps", "c_tokens", "sent_tokens", "sent_steps", "tokens_overwritten")

    def state_meta(self) -> dict[str, Any]:
        return {counter: {str(p): v for p, v in getattr(self, counter).items()} for counter in self.COUNTERS}

    def load_state(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
        for name in self.base:
            self.base[name].copy_(tensors[f"base/{name}"])
            self.residual[name].copy_(tensors[f"residual/{name}"])
        for counter in (c for c in self.COUNTERS if c in meta):  # sent_steps: not in older checkpoints
            setattr(self, counter, {FragmentIndex(int(p)): int(v) for p, v in meta[counter].items()})
        for name in self.origin:  # a checkpoint made without keep_unsent: its unsent work was never kept
            self.origin[name].copy_(tensors.get(f"origin/{name}", self.base[name]))
