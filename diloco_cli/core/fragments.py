"""Fragments of a model's parameters and the staggered schedule that sends them.

Streaming DiLoCo (arXiv 2501.18512, section 2.2) splits the parameters into P fragments
that are synchronised at staggered steps, so that the peak upload of a send is about 1/P
of the model.  Here the split is a greedy bin-packing of whole tensors into fragments of
near-equal bytes, with the token embedding (and a tied output head, which is the same
tensor) in a fragment of its own: it is merged with a plain weighted mean instead of RDA
(Decoupled DiLoCo, arXiv 2604.21428).

With ``sync.shards: N`` the fragments are also dealt out to N syncer shards, round robin
(:class:`SyncerShard`): fragments are independent in the algorithm (each has its own
version chain, window, outer momentum and round), so each shard syncs its own.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from diloco_cli.core.types import FragmentIndex

if TYPE_CHECKING:  # torch only where a model is split: the views and the launcher read shards without it
    import torch


@dataclass(frozen=True)
class Fragment:
    """One fragment: its index, parameter names (in model order) and size."""

    index: FragmentIndex
    parameter_names: tuple[str, ...]
    num_bytes: int
    mean_names: frozenset[str]
    """The parameters of this fragment that are merged with the weighted mean (the
    embedding's under ``sync.merge: rda``, every one under ``mean``); the rest take
    radial-directional averaging."""


@dataclass(frozen=True)
class SyncerShard:
    """Syncer shard ``index`` of ``count``: it syncs the fragments p with ``p % count ==
    index``.  Round robin, because fragment p is sent at offset p*H//P of each period:
    consecutive fragments go to different shards, so each shard's merges are spread
    evenly over the period instead of bunched together."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"syncer shard {self.index} of {self.count} does not exist")

    @property
    def sharded(self) -> bool:
        """Whether the run has more than one syncer shard."""
        return self.count > 1

    def owns(self, fragment: int) -> bool:
        return fragment % self.count == self.index

    def of(self, fragments: Sequence[Fragment]) -> tuple[Fragment, ...]:
        """This shard's fragments among ``fragments``, in order."""
        return tuple(fragment for fragment in fragments if self.owns(fragment.index))

    @staticmethod
    def of_fragment(fragment: int, count: int) -> SyncerShard:
        """The shard that syncs ``fragment`` in a run of ``count`` shards."""
        return SyncerShard(fragment % count, count)


class FragmentError(ValueError):
    """The model cannot be split as asked."""


def split_into_fragments(
    parameter_sizes: Sequence[tuple[str, int]],
    num_fragments: int,
    embedding_names: Collection[str] = (),
) -> tuple[Fragment, ...]:
    """Split parameters (name, bytes), in model order, into ``num_fragments`` fragments.

    With P >= 2 and an embedding, fragment 0 holds exactly the embedding parameters and
    the other P-1 fragments are packed greedily: tensors from largest to smallest (model
    order breaks ties), each into the lightest fragment so far (lowest index breaks ties).
    Fragments are then numbered by the model position of their first parameter, so the
    result depends only on the names, sizes and order given.  With P = 1 everything is
    one fragment.
    """
    if num_fragments < 1:
        raise FragmentError(f"the number of fragments must be at least 1, got {num_fragments}")
    names = [name for name, _ in parameter_sizes]
    if len(set(names)) != len(names):
        raise FragmentError("parameter names must be unique")
    unknown = set(embedding_names) - set(names)
    if unknown:
        raise FragmentError(f"embedding parameters {sorted(unknown)} are not parameters of the model")
    position = {name: index for index, name in enumerate(names)}
    size_of = dict(parameter_sizes)
    embeddings = frozenset(embedding_names)

    groups: list[list[str]]
    if num_fragments == 1:
        groups = [names]
    else:
        rest = [name for name in names if name not in embeddings]
        bins_to_pack = num_fragments - 1 if embeddings else num_fragments
        if len(rest) < bins_to_pack:
            raise FragmentError(
                f"{num_fragments} fragments need at least {bins_to_pack} parameter tensors outside the "
                f"embedding, but the model has {len(rest)}; lower num_fragments"
            )
        bins: list[list[str]] = [[] for _ in range(bins_to_pack)]
        loads = [0] * bins_to_pack
        for name in sorted(rest, key=lambda n: (-size_of[n], position[n])):
            lightest = min(range(bins_to_pack), key=lambda b: (loads[b], b))
            bins[lightest].append(name)
            loads[lightest] += size_of[name]
        packed = sorted((sorted(group, key=position.__getitem__) for group in bins), key=lambda g: position[g[0]])
        groups = ([sorted(embeddings, key=position.__getitem__)] if embeddings else []) + packed

    return tuple(
        Fragment(
            index=FragmentIndex(index),
            parameter_names=tuple(group),
            num_bytes=sum(size_of[name] for name in group),
            mean_names=frozenset(group) & embeddings,
        )
        for index, group in enumerate(groups)
    )


def embedding_parameter_names(model: torch.nn.Module) -> set[str]:
    """Names of the weights of every ``nn.Embedding`` (a tied head shares the tensor and
    so the name, since ``named_parameters`` lists a shared tensor once)."""
    import torch

    embedding_weights = {id(module.weight) for module in model.modules() if isinstance(module, torch.nn.Embedding)}
    return {name for name, parameter in model.named_parameters() if id(parameter) in embedding_weights}


def fragments_of_model(model: torch.nn.Module, num_fragments: int, merge: str = "rda") -> tuple[Fragment, ...]:
    """The fragments of a model's trainable parameters (see :func:`split_into_fragments`),
    each merging its embedding by the weighted mean (``merge: rda``) or every tensor
    (``merge: mean``)."""
    sizes = [
        (name, parameter.numel() * parameter.element_size())
        for name, parameter in model.named_parameters()
        if parameter.requires_grad
    ]
    trainable = {name for name, _ in sizes}
    fragments = split_into_fragments(sizes, num_fragments, embedding_parameter_names(model) & trainable)
    if merge == "mean":
        return tuple(replace(fragment, mean_names=frozenset(fragment.parameter_names)) for fragment in fragments)
    return fragments


def fragment_offset(fragment: int, sync_interval: int, num_fragments: int) -> int:
    """The inner step within each period of H at which a fragment is sent: p*H//P."""
    return fragment * sync_interval // num_fragments


def fragments_due(step: int, sync_interval: int, num_fragments: int) -> list[FragmentIndex]:
    """The fragments due after inner step ``step`` (counted from 1).

    Fragment p is sent at the steps where ``(step - p*H//P) % H == 0`` (Streaming
    DiLoCo's staggered schedule), so each fragment goes every H steps and the sends of
    different fragments are spread evenly over the period.
    """
    if sync_interval < 1:
        raise ValueError(f"the sync interval H must be at least 1, got {sync_interval}")
    if step < 1:
        return []
    return [
        FragmentIndex(p)
        for p in range(num_fragments)
        if step >= fragment_offset(p, sync_interval, num_fragments)
        and (step - fragment_offset(p, sync_interval, num_fragments)) % sync_interval == 0
    ]


SyncSchedule = Sequence[tuple[int, int]]
"""``(until_step, H)`` stages: before inner step ``until_step``, H is the stage's."""


def scheduled_sync_interval(step: int, schedule: SyncSchedule, interval: int, recipe_interval: int) -> int:
    """H after inner step ``step``: the stage's H while ``step`` is before its
    ``until_step``, else ``interval`` (the recipe's H, or the learner's H_m under dynamic
    local updates, which scales a stage's H by ``interval / recipe_interval`` too)."""
    for until, stage_interval in schedule:
        if step < until:
            return max(1, stage_interval * interval // recipe_interval)
    return interval


class SendPacing:
    """When each fragment is due: by the steps (``sync.pace: steps``) or by the merges
    (``merges``).

    By the steps, fragment p goes at the steps :func:`fragments_due` names, whatever the
    merges do.  With K = M a round is merged once the last learner's send lands, so a
    learner d steps ahead of the slowest installs every merge d of its steps after its
    send, and d grows as the learners' speeds drift apart, up to about H, though nobody
    waits.  By the merges, a learner sends fragment p H steps after it installed the
    merge that answered its previous send of p, so every learner starts a round from the
    same install and they send together again, the fast ones having trained more steps
    (token-weighted, nothing lost) instead of waiting; a round then lasts H steps plus
    the merge's round trip.  A send still unanswered 2H steps later is followed by the
    next all the same, so a slow syncer or a lost merge does not stop the sends.  The
    first send of each fragment (and the first after a restart) is where the steps put
    it, which keeps Streaming DiLoCo's stagger between fragments.

    Every process of a learner keeps its own copy and feeds it the same sends and
    installs, so all agree on what is due without a word between them.
    """

    def __init__(self, num_fragments: int, by_merges: bool, schedule: SyncSchedule, recipe_interval: int) -> None:
        self.num_fragments, self.by_merges = num_fragments, by_merges
        self.schedule, self.recipe_interval = schedule, recipe_interval
        self.last_send: dict[int, int] = {}
        self.awaiting: set[int] = set()
        """The fragments whose last send no install has answered yet."""
        self.next_due: dict[int, int] = {}
        self.start_at(0, recipe_interval)

    def interval(self, step: int, interval: int) -> int:
        """H at inner step ``step`` for a learner whose H is ``interval`` (the recipe's,
        or its own under dynamic local updates): :func:`scheduled_sync_interval`."""
        return scheduled_sync_interval(step, self.schedule, interval, self.recipe_interval)

    def start_at(self, step: int, interval: int) -> None:
        """Training starts (again) after inner step ``step``: each fragment's next send is
        where the steps put it, and nothing is in flight."""
        self.last_send, self.awaiting, self.next_due = {}, set(), {}
        at = self.interval(step + 1, interval)
        for later in range(step + 1, step + at + 1):
            for p in fragments_due(later, at, self.num_fragments):
                self.next_due.setdefault(p, later)

    def due(self, step: int, interval: int) -> list[FragmentIndex]:
        """The fragments to send after inner step ``step``."""
        at = self.interval(step, interval)
        if not self.by_merges:
            return fragments_due(step, at, self.num_fragments)
        return [
            FragmentIndex(p)
            for p in range(self.num_fragments)
            if (step - self.last_send[p] >= 2 * at if p in self.awaiting else step >= self.next_due[p])
        ]

    def sent(self, fragment: FragmentIndex, step: int) -> None:
        self.last_send[fragment] = step
        self.awaiting.add(fragment)

    def installed(self, installed: Sequence[int], step: int, interval: int) -> None:
        """After step ``step``, per fragment, whether a newer global version was installed
        (nonzero): each answers the send in flight, if any (an install with none in
        flight changes nothing)."""
        for fragment, newer in enumerate(installed):
            if newer and fragment in self.awaiting:
                self.awaiting.discard(fragment)
                self.next_due[fragment] = step + self.interval(step, interval)


def sends_per_learner(inner_steps: int, sync_interval: int, num_fragments: int, schedule: SyncSchedule = ()) -> int:
    """A learner's sends over ``inner_steps``: those :func:`fragments_due` makes at the
    H of each step (:func:`scheduled_sync_interval`), and once more per fragment at the
    end when it trained after its last send (the final sends of a learner that
    finishes).  Counted stage by stage in closed form: a plan asks for millions of steps."""
    bounds = [1, *(min(until, inner_steps + 1) for until, _ in schedule), inner_steps + 1]
    intervals = [interval for _, interval in schedule] + [sync_interval]
    total = 0
    for fragment in range(num_fragments):
        last = 0
        for start, end, interval in zip(bounds, bounds[1:], intervals):
            offset = fragment_offset(fragment, interval, num_fragments)
            low = max(start, offset, 1)
            first = offset + -(-(low - offset) // interval) * interval
            if first < end:
                sends = (end - 1 - first) // interval + 1
                total += sends
                last = first + (sends - 1) * interval
        total += last < inner_steps
    return total


def dynamic_sync_intervals(sync_interval: int, step_seconds: Mapping[str, float]) -> dict[str, int]:
    """Dynamic local updates (Decoupled DiLoCo, arXiv 2604.21428): each learner's H
    scaled by its speed, ``H_m = max(1, floor(H * speed_m / fastest speed))`` with speed
    the inverse of its step time, so that a slow learner sends as often, in wall time, as
    the fastest one does every H steps."""
    times = {learner: seconds for learner, seconds in step_seconds.items() if seconds > 0}
    if not times:
        return {}
    fastest = min(times.values())
    return {learner: max(1, int(sync_interval * fastest / seconds + 1e-9)) for learner, seconds in times.items()}
