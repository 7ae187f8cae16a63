"""The store layer: whole objects, markers, fresh listings, authenticated metadata."""

import json

import fsspec
import pytest

from diloco_cli.codec import CodecSpec, PayloadError, RunSecret, encode_payload
from diloco_cli.core.types import FragmentIndex, LearnerId, Version
from diloco_cli.store.documents import ControlNote, DamagedDocument, ForgedDocument, Head, Heartbeat, LearnerState
from diloco_cli.store.objects import ObjectStore
from diloco_cli.store.region import RegionBucket


@pytest.fixture(params=["memory", "file"])
def root(request, tmp_path):
    if request.param == "memory":
        memory = fsspec.filesystem("memory")
        memory.store.clear()
        memory.pseudo_dirs.clear()
        memory.pseudo_dirs.append("")
        return "memory://diloco-test"
    return f"file://{tmp_path}/bucket"


def test_whole_objects_and_fresh_listings(root):
    store, other = ObjectStore(root), ObjectStore(root)
    assert store.list("a") == [] and store.get_document("a/missing.json", Head, None) is None
    store.put("a/1", b"one")
    assert other.list("a") == ["a/1"]
    other.put("a/2", b"two")
    assert store.list("a") == ["a/1", "a/2"]  # no listing cache hides the new object
    store.delete("a/1")
    assert other.list("a") == ["a/2"]
    with pytest.raises(FileNotFoundError):
        store.get("a/1")
    assert store.meter.snapshot().bytes_up == 3 and other.meter.snapshot().bytes_up == 3


def test_a_listing_holds_only_keys_below_its_prefix(root):
    """s3fs's find, racing the first write under an empty prefix, can answer with the prefix
    itself; an object named like the prefix stands in for that answer here."""
    store = ObjectStore(root)
    store.put("commits", b"not below the prefix")
    assert store.list("commits") == []
    assert store.list("") == ["commits"]


def test_only_marked_objects_are_listed_as_marked(root):
    store = ObjectStore(root)
    store.put("p/unmarked.dlc", b"half of an upload")
    store.put_marked("p/whole.dlc", b"payload", b"marker")
    assert store.list_marked("p") == ["p/whole.dlc"]
    store.delete_marked("p/whole.dlc")
    assert store.list_marked("p") == [] and not store.exists("p/whole.dlc")


def test_a_killed_local_write_leaves_nothing_readable(tmp_path):
    store = ObjectStore(f"file://{tmp_path}/bucket")
    (tmp_path / "bucket" / "p").mkdir(parents=True)
    (tmp_path / "bucket" / "p" / "x.dlc.0123abcd.partial").write_bytes(b"cut short")
    assert store.list("p") == []


def test_a_local_bucket_answers_as_fsspecs_local_filesystem(tmp_path):
    """A ``file://`` bucket is read and written without fsspec (:class:`LocalFolder`, for
    the start of ``diloco status``): every call its object store makes answers as fsspec's
    local filesystem does, on the same files (ranges, sorted recursive listings, missing
    objects, batch and recursive deletion)."""
    from fsspec.implementations.local import LocalFileSystem

    from diloco_cli.store.filesystem import LocalFolder, open_bucket

    folder, root = open_bucket(f"file://{tmp_path}/./bucket/")
    assert isinstance(folder, LocalFolder) and root == str(tmp_path / "bucket")
    fsspec_local = LocalFileSystem()
    for key, data in {"b/2": b"two", "a/1": b"one", "a/z/3": b"three", "c": b"0123456789"}.items():
        folder.pipe_file(f"{root}/{key}", data)
    for listed in ("", "/a", "/a/z", "/missing"):
        assert folder.find(root + listed) == fsspec_local.find(root + listed)
    assert folder.find(root) == [f"{root}/{key}" for key in ("a/1", "a/z/3", "b/2", "c")]
    for start, end in ((None, None), (0, 1), (3, 7), (8, None), (5, 50)):
        assert folder.cat_file(f"{root}/c", start, end) == fsspec_local.cat_file(f"{root}/c", start, end)
    for each in (folder, fsspec_local):
        with pytest.raises(FileNotFoundError):
            each.cat_file(f"{root}/missing")
        with pytest.raises(FileNotFoundError):
            each.rm_file(f"{root}/missing")
    folder.rm([f"{root}/a/1", f"{root}/b/2"])
    assert folder.find(root) == [f"{root}/a/z/3", f"{root}/c"]
    with pytest.raises(IsADirectoryError):  # a folder goes only when asked to go whole
        folder.rm(f"{root}/a")
    folder.rm(root, recursive=True)
    assert not (tmp_path / "bucket").exists() and folder.find(root) == []
    with pytest.raises(FileNotFoundError):
        folder.rm(root, recursive=True)


def test_a_local_write_whose_folder_is_removed_before_its_rename_is_written_again(tmp_path, monkeypatch):
    """A region's folder removed (the bucket wiped and recreated) between a write of the
    whole object to its ``.partial`` and the rename into place: the write is tried again
    under the retry policy, into the folder made anew, instead of failing the writer."""
    import os
    import shutil

    from diloco_cli.config.recipe import RetryPolicy
    from diloco_cli.store import filesystem

    store = ObjectStore(f"file://{tmp_path}/region", retry=RetryPolicy(first_backoff_seconds=0.01))
    store.put("global/head.json", b"old")
    rename, removed = os.replace, []

    def wiped_first(source, target):
        if not removed:  # the region's folder goes after the .partial was written
            removed.append(source)
            shutil.rmtree(tmp_path / "region")
        rename(source, target)

    monkeypatch.setattr(filesystem.os, "replace", wiped_first)
    store.put("global/head.json", b"new")
    assert removed and removed[0].endswith(".partial")
    assert store.get("global/head.json") == b"new" and store.meter.snapshot().retries == 1


def test_payload_markers_are_authenticated(root, secret):
    bucket = RegionBucket("r", root, None, secret)
    key = bucket.send_payload(
        LearnerId("m0"), FragmentIndex(1), 7, b"data", {"base_version": 3, "c_steps": 5, "c_tokens": 640}
    )
    record = bucket.payload_record(key)
    assert (record.learner, record.fragment, record.sequence, record.base_version, record.c_tokens) == (
        "m0",
        1,
        7,
        3,
        640,
    )
    # a marker written without the run's secret is refused
    forged = RegionBucket("r", root, None, RunSecret(bytes(32)))
    forged_key = forged.send_payload(
        LearnerId("m1"), FragmentIndex(0), 1, b"data", {"base_version": 0, "c_steps": 1, "c_tokens": 1}
    )
    with pytest.raises(PayloadError):
        bucket.payload_record(forged_key)
    # a genuine marker copied next to another payload is refused too
    bucket.store.put("payloads/m0/001-000000000008.dlc", b"other")
    bucket.store.put("payloads/m0/001-000000000008.dlc.ready", bucket.store.get_marker(key))
    with pytest.raises(PayloadError, match="describes another payload"):
        bucket.payload_record("payloads/m0/001-000000000008.dlc")


def test_learner_epochs_are_sealed_per_learner(root, secret):
    bucket = RegionBucket("r", root, None, secret)
    assert bucket.read_epoch(LearnerId("m0")) == 0
    bucket.write_epoch(LearnerId("m0"), 3)
    assert bucket.read_epoch(LearnerId("m0")) == 3 and bucket.read_epoch(LearnerId("m1")) == 0
    bucket.store.put("control/m1.epoch", bucket.store.get("control/m0.epoch"))  # copied to another learner
    with pytest.raises(ForgedDocument):
        bucket.read_epoch(LearnerId("m1"))


def beat(learner="m0", **changes):
    values = dict(
        learner=learner,
        region="r",
        host="local",
        pid=1,
        state=LearnerState.TRAINING,
        step=5,
        total_steps=10,
        tokens=640,
        started_at=0.0,
        time=1.0,
    )
    return Heartbeat(**{**values, **changes})


def test_documents_are_sealed_and_refused_when_damaged_forged_or_moved(root, secret):
    bucket = RegionBucket("r", root, None, secret)
    bucket.write_heartbeat(beat(base_versions={FragmentIndex(0): Version(3)}))
    assert bucket.read_heartbeat(LearnerId("m0")) == beat(base_versions={FragmentIndex(0): Version(3)})
    sealed = bucket.store.get("heartbeats/m0.json")
    # moved to another learner's key: refused (the tag binds the key)
    bucket.store.put("heartbeats/m1.json", sealed)
    with pytest.raises(ForgedDocument, match="heartbeats/m1.json"):
        bucket.read_heartbeat(LearnerId("m1"))
    # edited, even with valid JSON: refused
    edited = json.loads(sealed)
    edited["document"]["step"] = 9
    bucket.store.put("heartbeats/m0.json", json.dumps(edited).encode())
    with pytest.raises(ForgedDocument):
        bucket.read_heartbeat(LearnerId("m0"))
    # written with another run's key: refused
    RegionBucket("r", root, None, RunSecret(bytes(32))).write_control(LearnerId("m0"), ControlNote(resync_serial=9))
    with pytest.raises(ForgedDocument):
        bucket.read_control(LearnerId("m0"))
    # not JSON at all: damaged, and never mistaken for absent
    bucket.store.put("global/head.json", b"\x00garbage{")
    with pytest.raises(DamagedDocument, match="global/head.json"):
        bucket.read_head()
    assert isinstance(DamagedDocument("x"), PayloadError) and isinstance(ForgedDocument("x"), PayloadError)
    # a reader without the secret (status --manifest) only displays: no verification
    assert RegionBucket("r", root, None, None).read_heartbeat(LearnerId("m0")).step == 9


def test_head_lists_the_updates_a_reader_misses():
    head = Head(
        version=Version(9),
        fragment_versions={FragmentIndex(0): Version(8), FragmentIndex(1): Version(9)},
        snapshot_version=Version(6),
        recent=(
            (Version(4), FragmentIndex(0)),
            (Version(5), FragmentIndex(1)),
            (Version(8), FragmentIndex(0)),
            (Version(9), FragmentIndex(1)),
        ),
        recent_from=Version(3),
    )
    assert head.updates_after(FragmentIndex(0), Version(4)) == [8]
    assert head.updates_after(FragmentIndex(1), Version(3)) == [5, 9]
    assert head.updates_after(FragmentIndex(1), Version(2)) is None  # older than listed: use the snapshot
    assert Head.model_validate_json(head.model_dump_json()) == head


def test_markers_are_tiny_authenticated_frames(secret):
    marker = encode_payload([], CodecSpec(zstd_level=0), secret, {"version": 1})
    assert len(marker) < 200
