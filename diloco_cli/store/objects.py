"""An object store rooted at one URL: whole-object reads and writes, fresh listings,
marked objects, sealed documents, every call under the retry policy and metered."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from diloco_cli.codec import RunSecret
from diloco_cli.store.documents import DocumentType, seal, unseal
from diloco_cli.store.faults import StorageFaults
from diloco_cli.store.filesystem import (
    StorageError,
    find_below,
    open_bucket,
    protocol_of,
    write_whole,
)
from diloco_cli.store.metering import StorageMeter, listing_bytes
from diloco_cli.store.retry import RetryPolicy, call_with_retries
from diloco_cli.store.wire import wire_model

MARKER_SUFFIX = ".ready"
"""A marked object ``X`` is trusted only once ``X.ready`` exists (written after ``X``)."""

PARTIAL_SUFFIX = ".partial"
"""A local write in progress (renamed into place when whole)."""


class ObjectStore:
    """Objects under ``root`` (an fsspec URL); keys are ``/``-separated relative paths.

    Every call is retried under ``retry`` (:mod:`diloco_cli.store.retry`) and counted in
    ``meter`` under the kind ``kind_of(key)`` gives it (listings under ``listing``).
    Absent objects raise ``FileNotFoundError`` (or read as None where said); a call that
    still fails after every try raises ``StorageError``."""

    def __init__(
        self,
        root: str,
        storage_options: dict[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        kind_of: Callable[[str], str] = lambda key: "other",
        faults: StorageFaults | None = None,
    ) -> None:
        self.root = root.rstrip("/")
        self._storage_options = dict(storage_options or {})
        self._filesystem, self._path = open_bucket(self.root, self._storage_options)
        self._wire = wire_model(protocol_of(self.root))
        """What each request carries besides objects (estimated: :mod:`.wire`)."""
        self.retry = retry or RetryPolicy()
        self.meter = StorageMeter()
        self.kind_of = kind_of
        self.faults = faults
        """Injected outages (chaos mode): checked before every call."""

    def __repr__(self) -> str:
        return f"ObjectStore({self.root!r})"

    def _full(self, key: str) -> str:
        return f"{self._path}/{key}" if key else self._path

    def _call(self, what: str, key: str, call, op: str, kind: str | None = None, batch: Sequence[str] = ()):
        """Run ``call`` under the retry policy, counted under ``kind`` (or ``kind_of(key)``)
        as ``op``; ``batch``: the paths a batch deletion names."""
        description = f"{what} {self.root}/{key}"
        if self.faults is not None:
            call = self._faulty(call, description)
        path = "/" + self._full(key)
        bucket_path = "/" + self._path.split("/", 1)[0]

        def overhead(missing: bool) -> tuple[int, int]:
            if batch:
                return self._wire.estimate_batch(bucket_path, batch)
            return self._wire.estimate(op, path, missing=missing)

        return call_with_retries(
            call, self.retry, self.meter, description, kind or self.kind_of(key), op, overhead=overhead
        )

    def _faulty(self, call, description: str):
        faults = self.faults

        def checked():
            faults.check(description)
            return call()

        return checked

    def put(self, key: str, data: bytes, raw_bytes: int = 0) -> None:
        """Write a whole object (replacing it: use only for mutable objects or new keys);
        ``raw_bytes``: the fp32 size of the tensors it carries, for compression reports."""
        self._call("writing", key, lambda: write_whole(self._filesystem, self._full(key), data), "write")
        self.meter.count(self.kind_of(key), up=len(data), raw=raw_bytes)

    def get(self, key: str) -> bytes:
        """Read a whole object; FileNotFoundError when it does not exist."""
        data = self._call("reading", key, lambda: self._filesystem.cat_file(self._full(key)), "read")
        self.meter.count(self.kind_of(key), down=len(data))
        return data

    def exists(self, key: str) -> bool:
        """Whether object ``key`` (of at least one byte: a marker, a payload) exists; one request."""
        try:  # one request, a read of the first byte (s3fs's exists: a HEAD, and a LIST when missing)
            self._call("checking", key, lambda: self._filesystem.cat_file(self._full(key), start=0, end=1), "read")
        except FileNotFoundError:
            return False
        return True

    def list(self, prefix: str, include_partial: bool = False) -> list[str]:
        """Keys of every object under ``prefix/``, freshly listed (recursive, sorted)."""
        paths = self._call(
            "listing", prefix, lambda: find_below(self._filesystem, self._full(prefix)), "list", kind="listing"
        )
        self.meter.count("listing", down=listing_bytes(paths))
        # Only what lies strictly below the prefix: s3fs's find, racing a first write under an
        # empty prefix, can list nothing and then return the prefix itself as a "directory".
        below = self._full(prefix) + "/"
        start = len(self._path) + 1
        keys = (path[start:] for path in paths if path.startswith(below))
        return sorted(key for key in keys if include_partial or not key.endswith(PARTIAL_SUFFIX))

    def delete(self, key: str) -> None:
        def remove() -> None:
            try:
                self._filesystem.rm_file(self._full(key))
            except FileNotFoundError:
                pass

        self._call("deleting", key, remove, "delete")

    def delete_many(self, keys: list[str]) -> None:
        """Delete these objects in as few requests as the backend allows (S3's
        DeleteObjects takes 1,000 keys, GCS batches); missing ones are no error."""
        if not keys:
            return
        paths = [self._full(key) for key in keys]

        def remove() -> None:
            try:
                self._filesystem.rm(paths)
            except FileNotFoundError:  # a backend that deletes one by one met a missing one
                for path in paths:
                    try:
                        self._filesystem.rm_file(path)
                    except FileNotFoundError:
                        pass

        self._call(
            "deleting",
            f"{keys[0]} and {len(keys) - 1} more",
            remove,
            "delete",
            kind=self.kind_of(keys[0]),
            batch=paths,
        )

    def remove_everything(self) -> None:
        """Delete every object under the root (``diloco rm``: the root is the run's own)."""

        def remove() -> None:
            try:
                self._filesystem.rm(self._path, recursive=True)
            except FileNotFoundError:
                pass

        self._call("removing everything under", "", remove, "delete", kind="other")

    # ------------------------------------------------------------------ documents

    def get_document(self, key: str, model: type[DocumentType], secret: RunSecret | None) -> DocumentType | None:
        """A sealed document (verified when ``secret`` is given), or None when absent.
        A damaged or forged one raises (a subclass of ``PayloadError``): it is never
        mistaken for an absent one."""
        try:
            data = self.get(key)
        except FileNotFoundError:
            return None
        return unseal(data, key, model, secret)

    def put_document(self, key: str, document, secret: RunSecret) -> None:
        self.put(key, seal(document, key, secret))

    # ------------------------------------------------------------------ marked objects

    def put_marked(self, key: str, data: bytes, marker: bytes, raw_bytes: int = 0) -> None:
        """Write an immutable object, then its marker: readers trust it only after both."""
        self.put(key, data, raw_bytes)
        self.put(key + MARKER_SUFFIX, marker)

    def list_marked(self, prefix: str) -> list[str]:
        """Keys under ``prefix`` whose marker exists (the object itself is then whole)."""
        return [key[: -len(MARKER_SUFFIX)] for key in self.list(prefix) if key.endswith(MARKER_SUFFIX)]

    def get_marker(self, key: str) -> bytes:
        return self.get(key + MARKER_SUFFIX)

    def delete_marked(self, key: str) -> None:
        """Remove the marker first, so the object is never trusted without it."""
        self.delete(key + MARKER_SUFFIX)
        self.delete(key)

    def probe(self) -> None:
        """Write, read and delete a probe object (once, no retries: preflight wants a
        quick answer); StorageError names the bucket if any step fails.  On a local
        filesystem the folders the write made are removed too: a probe leaves nothing."""
        key = "diloco-probe"
        made = self._missing_local_folders()
        try:
            write_whole(self._filesystem, self._full(key), b"probe")
            if self._filesystem.cat_file(self._full(key)) != b"probe":
                raise StorageError(f"{self.root}: a probe object read back differently")
            self._filesystem.rm_file(self._full(key))
        except StorageError:
            raise
        except Exception as error:  # any backend's failure means the bucket is unusable
            raise StorageError(
                f"bucket {self.root} cannot be written, read and deleted: {type(error).__name__}: {error}. "
                "Check the URL, that the bucket exists, and the credentials in the environment."
            ) from None
        finally:
            for folder in made:  # the deepest first; one that holds something stays
                try:
                    os.rmdir(folder)
                except OSError:
                    break

    def _missing_local_folders(self) -> list[str]:
        """The folders above a local store's root that do not exist yet, deepest first."""
        if protocol_of(self.root) != "file":
            return []
        missing, folder = [], Path(self._path)
        while not folder.exists() and folder != folder.parent:
            missing.append(str(folder))
            folder = folder.parent
        return missing
