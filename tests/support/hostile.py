"""What an attacker who can write to a bucket plants (frames, markers, objects with their
markers, declared sizes that lie), and the checks that none of it moved the global weights
while real sends still merge; shared by tests/unit/test_hostile.py and
tests/integration/test_hostile_s3.py."""

from __future__ import annotations

import json

import torch

from diloco_cli.codec import CodecSpec, RunSecret, encode_payload
from diloco_cli.codec.frame import PREFIX
from diloco_cli.core.types import FragmentIndex
from diloco_cli.store.documents import Refusals, SyncerPhase
from diloco_cli.store.region import MARKER_SPEC, relayed_payload_key
from diloco_cli.views.run_state import collect_status
from diloco_cli.views.status import render_json, render_plain

FOREIGN = RunSecret(bytes(range(100, 132)))
"""A key that is not the run's."""


def frame(secret: RunSecret, meta: dict, values: int = 16) -> bytes:
    return encode_payload([("w", torch.ones(values))], CodecSpec(), secret, meta)


def marker(secret: RunSecret, meta: dict) -> bytes:
    return encode_payload([], MARKER_SPEC, secret, meta)


def marker_meta(key: str, **extra) -> dict:
    _, learner, name = key.split("/")
    fragment, sequence = name.removesuffix(".dlc").split("-")
    return {
        "learner": learner,
        "fragment": int(fragment),
        "sequence": int(sequence),
        "base_version": 0,
        "c_steps": 10,
        "c_tokens": 1000,
        **extra,
    }


def plant(bucket, key: str, payload: bytes, marker_bytes: bytes) -> None:
    """An object and its marker, written as a learner would (payload first)."""
    bucket.store.put(key, payload)
    bucket.store.put(key + ".ready", marker_bytes)


def with_declared_sizes(data: bytes, header_bytes: int | None = None, body_bytes: int | None = None) -> bytes:
    """``data`` with its prefix's declared header and body lengths replaced (tag unchanged)."""
    magic, version, flags, fingerprint, header, body = PREFIX.unpack_from(data)
    prefix = PREFIX.pack(
        magic,
        version,
        flags,
        fingerprint,
        header if header_bytes is None else header_bytes,
        body if body_bytes is None else body_bytes,
    )
    return prefix + data[PREFIX.size :]


def weights(syncer) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in syncer.state.theta.items()}


def assert_weights_unchanged(syncer, before: dict[str, torch.Tensor], versions: dict) -> None:
    assert dict(syncer.state.fragment_versions) == versions
    for name, tensor in syncer.state.theta.items():
        assert torch.equal(tensor, before[name]), f"{name} moved without a real payload"


def fresh_sends(harness, learner, steps=10) -> dict[FragmentIndex, str]:
    """Train ``learner`` until its sends are in the bucket (not merged yet): key by fragment."""
    known = set(harness.bucket.payload_keys())
    harness.train(learner, steps)
    return {FragmentIndex(int(key.split("/")[2][:3])): key for key in harness.bucket.payload_keys() if key not in known}


def merged_keys(syncer) -> list[str]:
    """The payloads merged (a relay stands for the payload it copies), qualified."""
    keys = [payload.key for record in syncer.home.history() for payload in record.merged]
    return [f"{name.split(':', 1)[0]}:{relayed_payload_key(name.split(':', 1)[1])}" for name in keys]


def region_refusals(harness) -> Refusals:
    """What the region's readers refused: the syncer (aggregates, relays, heartbeats) and
    the region's reducer (its learners' payloads and markers), as ``diloco status`` adds them."""
    return harness.syncer.observer.refusals["east"].plus(harness.reducer.refusals)


def shown(harness) -> tuple[dict, str]:
    """What ``diloco status -o json`` shows of the region, and the plain view."""
    harness.syncer.write_status(SyncerPhase.RUNNING)
    status = collect_status(harness.spec, harness.secret)
    return json.loads(render_json(status))["regions"][0], render_plain(status)


def removed(harness) -> int:
    """Leftovers the syncer's sweepers removed, as its status counts them."""
    return harness.syncer.status(SyncerPhase.RUNNING).leftovers_removed


def assert_merges_go_on(harness, planted: list[str]) -> None:
    """A real send still merges, and none of ``planted`` ever was."""
    version = harness.syncer.state.version
    harness.train(harness.learners[0], 10)
    harness.merge()
    assert harness.syncer.state.version > version
    assert not set(merged_keys(harness.syncer)) & {f"east:{key}" for key in planted}
