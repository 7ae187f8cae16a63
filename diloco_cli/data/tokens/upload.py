"""Copying staged shards to a dataset's location, resumably, and its index last.

Each file copied is added to the location's upload record (``uploads.json``: name, size
and SHA-256 of each file that arrived whole).  An interrupted upload starts again where
it stopped: a file the record lists, present with the same size, is not sent again.
The index goes last and the record is then removed, so a location with an index holds a
complete dataset and one without is unfinished, whatever the moment of interruption.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from diloco_cli.data.tokens.index import FORMAT, FROZEN, DatasetIndex, parse_document
from diloco_cli.data.tokens.progress import Progress
from diloco_cli.data.tokens.shards import PROGRESS_NAME
from diloco_cli.data.tokens.storage import Location, Retry, join, read_if_present, remove_if_present, size_if_present
from diloco_cli.store.filesystem import write_whole

UPLOADS_NAME = "uploads.json"


class StoredFile(BaseModel):
    """A file of the dataset as it lies in a location."""

    model_config = FROZEN

    name: str
    size: int = Field(ge=0)
    sha256: str


class UploadRecord(BaseModel):
    """The files of an unfinished upload that have arrived whole."""

    model_config = FROZEN

    format: Literal["diloco-tokens/1"] = FORMAT
    tokenizer_sha256: str
    files: tuple[StoredFile, ...] = ()


def read_uploads(location: Location, retry: Retry) -> UploadRecord | None:
    filesystem, root = location.open()
    data = read_if_present(filesystem, join(root, UPLOADS_NAME), retry)
    if data is None:
        return None
    return parse_document(
        UploadRecord, data, f"{location.url}/{UPLOADS_NAME}", "remove it (or give --overwrite) to upload again"
    )


def upload_dataset(
    staging: Path, files: list[StoredFile], index: DatasetIndex, location: Location, retry: Retry, progress: Progress
) -> int:
    """Copy ``files`` from ``staging`` to ``location`` (each retried by ``retry``), then
    write ``index``; returns how many files an earlier run had already copied."""
    filesystem, root = location.open()
    earlier = read_uploads(location, retry)
    arrived = (
        {file.name: file for file in earlier.files}
        if earlier and earlier.tokenizer_sha256 == index.tokenizer_sha256
        else {}
    )
    progress.begin(f"uploading to {location.url}", sum(file.size for file in files))
    skipped = 0
    for file in files:
        remote = join(root, file.name)
        if arrived.get(file.name) == file and size_if_present(filesystem, remote, retry) == file.size:
            skipped += 1
            progress.advance(file.size)
            progress.done(f"{location.url}/{file.name}", reused=True)
            continue
        retry(lambda local=str(staging / file.name), remote=remote: filesystem.put_file(local, remote))
        arrived[file.name] = file
        record = UploadRecord(tokenizer_sha256=index.tokenizer_sha256, files=tuple(arrived.values()))
        retry(
            lambda data=record.model_dump_json(indent=2).encode(): write_whole(
                filesystem, join(root, UPLOADS_NAME), data
            )
        )
        progress.advance(file.size)
        progress.done(f"{location.url}/{file.name}", reused=False)
    write_index(location, index, retry)
    return skipped


def write_index(location: Location, index: DatasetIndex, retry: Retry) -> None:
    """Write the index, which makes the location's dataset complete, then remove the
    records of its making."""
    filesystem, root = location.open()
    retry(lambda: write_whole(filesystem, join(root, location.index_name), index.to_json()))
    for record in (UPLOADS_NAME, PROGRESS_NAME):
        remove_if_present(filesystem, join(root, record), retry)
