"""The test object-storage servers work for real through fsspec, in-process and from a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest

from testbed.servers import ObjectStore, fake_gcs_server, moto_s3_server

_SERVERS = {"s3": moto_s3_server, "gcs": fake_gcs_server}


@pytest.fixture(scope="module", params=sorted(_SERVERS))
def store(request: pytest.FixtureRequest) -> Iterator[ObjectStore]:
    with _SERVERS[request.param]() as running:
        yield running


@pytest.fixture
def bucket(store: ObjectStore) -> str:
    """A new, empty bucket, as a path without the protocol."""
    name = f"test-{uuid.uuid4().hex[:12]}"
    assert store.create_bucket(name) == f"{store.protocol}://{name}"
    return name


def test_write_read_delete(store: ObjectStore, bucket: str) -> None:
    fs = store.filesystem()
    path = f"{bucket}/dir/object.bin"
    payload = os.urandom(100_000)
    assert not fs.exists(path)
    fs.pipe(path, payload)
    assert fs.exists(path)
    assert fs.cat(path) == payload
    fs.rm(path)
    assert not fs.exists(path)
    with pytest.raises(FileNotFoundError):
        fs.cat(path)


def test_missing_object_raises(store: ObjectStore, bucket: str) -> None:
    with pytest.raises(FileNotFoundError):
        store.filesystem().cat(f"{bucket}/no/such/object")


def test_listing_sees_objects_written_by_another_client(store: ObjectStore, bucket: str) -> None:
    reader, writer = store.filesystem(), store.filesystem()
    prefix = f"{bucket}/round-0"
    writer.pipe(f"{prefix}/a", b"a")
    assert reader.ls(prefix, detail=False) == [f"{prefix}/a"]
    assert reader.find(bucket) == [f"{prefix}/a"]
    writer.pipe(f"{prefix}/b", b"b")
    assert sorted(reader.ls(prefix, detail=False)) == [f"{prefix}/a", f"{prefix}/b"]
    assert reader.find(bucket) == [f"{prefix}/a", f"{prefix}/b"]
    writer.rm(f"{prefix}/a")
    assert reader.find(bucket) == [f"{prefix}/b"]
    assert not reader.exists(f"{prefix}/a")


def test_subprocess_writes_with_env_and_storage_options(store: ObjectStore, bucket: str) -> None:
    path = f"{bucket}/from-subprocess"
    script = (
        "import json, sys, fsspec\n"
        "protocol, options, path = json.loads(sys.argv[1])\n"
        "fsspec.filesystem(protocol, **options).pipe(path, b'written by a subprocess')\n"
    )
    # Only ``env`` may tell the subprocess about the server: drop what this process has set.
    inherited = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("AWS_", "GCSFS_", "STORAGE_EMULATOR_HOST"))
    }
    subprocess.run(
        [sys.executable, "-c", script, json.dumps([store.protocol, store.storage_options, path])],
        env={**inherited, **store.env},
        check=True,
        timeout=60,
    )
    assert store.filesystem().cat(path) == b"written by a subprocess"
