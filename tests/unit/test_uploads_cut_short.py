"""An upload cut short: a payload without its marker is never read, and is seen once the upload
completes; the same for a relay the reducer was copying (the syncer and learners killed in
real runs: tests/integration/test_faults.py)."""

from pathlib import Path

import torch

from diloco_cli.codec import CodecSpec, encode_payload
from diloco_cli.config.recipe import Recipe
from diloco_cli.config.regions import RegionsFile
from diloco_cli.core import decisions
from diloco_cli.launch.resolve import resolve_run
from diloco_cli.runtime.reducer.loop import Reducer
from diloco_cli.runtime.syncer.loop import Syncer
from diloco_cli.store.region import relay_key
from tests.support.runs import TINY_RECIPE, deep_update


def test_a_payload_without_its_marker_is_never_read(tmp_path, secret):
    recipe = Recipe.model_validate(deep_update(TINY_RECIPE, {"sync": {"quorum": 1}}))  # K < M: sends are relayed
    regions = RegionsFile.model_validate(
        {"regions": [{"name": "east", "bucket": f"file://{tmp_path}/east", "hosts": [{"learners": 2}]}]}
    )
    spec = resolve_run(recipe, regions, "unmarked", tmp_path)
    syncer = Syncer(spec, secret)
    syncer.start()
    reducer = Reducer(spec, "east", secret)
    reducer.start()
    reducer.turn()
    bucket = syncer.buckets["east"]
    payload = bucket.store.get("global/snapshots/0000000000.dlc")  # any authentic payload
    key = "payloads/east-0/000-000001000001.dlc"
    bucket.store.put(key, payload[: len(payload) // 2])  # an upload killed midway: no marker
    (Path(tmp_path) / "east" / "payloads" / "east-1").mkdir(parents=True)
    (Path(tmp_path) / "east" / "payloads" / "east-1" / "000-000001000001.dlc.ab12.partial").write_bytes(b"half")
    bucket.store.put(relay_key(key), payload)  # a relay killed between its object and its marker
    for _ in range(3):
        reducer.turn(read_heartbeats=True)
        assert not reducer.waiting and not reducer.relayed
        assert not [
            o
            for o in syncer.observer.look(spec, read_heartbeats=False).observations
            if isinstance(o, decisions.ArrivalSeen)
        ]
    assert bucket.payload_keys() == [] and bucket.relay_keys() == []
    # once the upload completes (payload whole, then marker) it is seen, relayed, and the relay seen
    meta = {"learner": "east-0", "fragment": 0, "base_version": 0, "c_steps": 10, "c_tokens": 100}
    meta |= {"step": 10, "sent_at": 1.0}
    whole = encode_payload([("w", torch.ones(4))], CodecSpec(), secret, meta)
    bucket.send_payload("east-0", 0, 1000002, whole, meta)
    reducer.turn(read_heartbeats=True)
    assert bucket.relay_keys() == ["relays/east-0/000-000001000002.dlc"]
    seen = [
        o
        for o in syncer.observer.look(spec, read_heartbeats=False).observations
        if isinstance(o, decisions.ArrivalSeen)
    ]
    assert [o.arrival.key for o in seen] == ["east:relays/east-0/000-000001000002.dlc"]
