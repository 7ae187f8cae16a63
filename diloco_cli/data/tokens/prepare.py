"""``diloco prepare``: a corpus made into a token dataset in one or more locations.

The corpus is tokenized once into a local staging directory (the output itself when it
is one local directory) and the staged files are then copied to every location: the
output, or each region's own bucket (data stays in its region).  Both halves resume
after an interruption (:mod:`~diloco_cli.data.tokens.shards`,
:mod:`~diloco_cli.data.tokens.upload`); each location's index is written last.

Shards only mean something with the tokenizer that made them, so a location never
holds two: one that already has an index, a progress record or an upload record of
another tokenizer is refused, unless ``overwrite`` clears it first.
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path

from diloco_cli.config.regions import RegionsFile
from diloco_cli.data.tokens.corpus import Corpus
from diloco_cli.data.tokens.index import (
    TOKENIZER_NAME,
    DatasetError,
    DatasetIndex,
    ShardEntry,
    dtype_for_vocabulary,
    parse_index,
)
from diloco_cli.data.tokens.progress import Progress, Silent, counted
from diloco_cli.data.tokens.shards import (
    PARTIAL_SUFFIX,
    PROGRESS_NAME,
    DocumentCounts,
    ProgressRecord,
    TokenizeSettings,
    read_progress,
    tokenize_corpus,
)
from diloco_cli.data.tokens.storage import Location, Retry, call_once, join, read_if_present, remove_if_present
from diloco_cli.data.tokens.tokenizer import (
    EOS_TOKEN,
    TRAINING_SAMPLE_BYTES,
    DatasetTokenizer,
    load_tokenizer,
    train_tokenizer,
)
from diloco_cli.data.tokens.upload import UPLOADS_NAME, StoredFile, read_uploads, upload_dataset, write_index
from diloco_cli.store.filesystem import absolute_path

WORK_ROOT = Path("~/.cache/diloco/prepare")
"""Where a dataset bound for buckets is staged, unless told otherwise (removed once
every location is complete)."""

REGION_DATASETS = "datasets"
"""A region without a ``data_source`` gets the dataset at ``<bucket>/datasets/<name>/``."""


@dataclass(frozen=True)
class PrepareRequest:
    """What to make and where (the command line's options)."""

    corpus: Corpus
    locations: tuple[Location, ...]
    """Every place the dataset goes."""
    tokenizer: str | None = None
    """A ``tokenizer.json`` to use; None trains a byte-level BPE of ``vocab_size``."""
    vocab_size: int | None = None
    eos_token: str = EOS_TOKEN
    shard_tokens: int = 10_000_000
    heldout_fraction: float = 0.01
    work_dir: Path | None = None
    """Where to stage the shards; None: the output when it is one local directory, else
    a directory under :data:`WORK_ROOT` named after the locations."""
    overwrite: bool = False
    """Replace whatever dataset the locations (and the staging directory) hold."""

    def __post_init__(self) -> None:
        if not 0 < self.heldout_fraction < 1:
            raise DatasetError(f"--heldout-fraction {self.heldout_fraction} must be above 0 and below 1")

    @property
    def staging(self) -> Path:
        if self.work_dir is not None:
            return self.work_dir.expanduser().resolve()
        if len(self.locations) == 1 and self.locations[0].is_local:
            return local_path(self.locations[0])
        digest = hashlib.sha256("\n".join(location.index_url for location in self.locations).encode()).hexdigest()[:16]
        return (WORK_ROOT / digest).expanduser()


@dataclass(frozen=True)
class Prepared:
    """What a run of ``prepare`` made, reused and found."""

    index: DatasetIndex | None
    """The dataset's index (None when every location was complete before)."""
    index_urls: tuple[str, ...]
    """Every location's index."""
    shards_made: int = 0
    shards_reused: int = 0
    """Shards an interrupted run had finished (checked, not tokenized again)."""
    uploads_skipped: int = 0
    """Files an interrupted run had copied (not sent again)."""
    complete_before: tuple[str, ...] = ()
    """Locations that held this dataset, complete, before this run."""
    vocab_size_asked: int | None = None
    """``--vocab-size`` when the tokenizer trained on the corpus came out smaller (the
    corpus has no more pairs to merge), else None."""
    documents: DocumentCounts | None = None
    """How many documents the corpus made and the shortest (None when nothing was made)."""
    separator: str | None = None
    """What cut the documents, when a file was read as plain text (else None: JSON lines
    and Parquet say where documents end)."""


def local_path(location: Location) -> Path:
    return Path(location.url.removeprefix("file://")).expanduser().resolve()


def region_locations(regions: RegionsFile, name: str, runs_dir: str) -> tuple[Location, ...]:
    """Each region's own location of dataset ``name``: its ``data_source`` when that names
    an index (``....json``), else ``<bucket>/datasets/<name>/`` in the region's bucket
    (``datasets`` in place of ``{run}`` where the bucket's URL has one); local ones
    absolute, as ``prepare`` prints them for a recipe."""
    locations = []
    for region in regions.regions:
        if region.data_source is None:
            url = f"{region.run_root(REGION_DATASETS, runs_dir)}/{name}"
            locations.append(Location(absolute_path(url), dict(region.storage_options)))
        elif region.data_source.split("?")[0].endswith(".json"):
            locations.append(Location.of_index(absolute_path(region.data_source), dict(region.data_storage_options)))
        else:
            raise DatasetError(
                f"region {region.name!r}: data_source {region.data_source} is not a token dataset's index (….json); "
                f"point it at where the index should go (e.g. s3://bucket/datasets/{name}/index.json), or remove it "
                f"to use <bucket>/{REGION_DATASETS}/{name}/"
            )
    return tuple(locations)


def tokenizer_hashes(location: Location, retry: Retry) -> dict[str, str]:
    """What the location already holds of a dataset (index, progress record, upload
    record), each with the SHA-256 of its tokenizer."""
    filesystem, root = location.open()
    found = {}
    index_data = read_if_present(filesystem, join(root, location.index_name), retry)
    if index_data is not None:
        found["a dataset"] = parse_index(index_data, location.index_url).tokenizer_sha256
    if location.is_local and (progress := read_progress(local_path(location))) is not None:
        found["the progress of a dataset"] = progress.settings.tokenizer_sha256
    if (uploads := read_uploads(location, retry)) is not None:
        found["part of a dataset"] = uploads.tokenizer_sha256
    return found


def is_complete_with(location: Location, tokenizer_sha256: str, retry: Retry) -> bool:
    """Whether ``location`` holds the complete dataset of this tokenizer; a
    :class:`DatasetError` when it holds anything made with another."""
    found = tokenizer_hashes(location, retry)
    for what, theirs in found.items():
        if theirs != tokenizer_sha256:
            raise DatasetError(
                f"{location.url} already holds {what} made with another tokenizer (sha256 {theirs[:12]}, this one "
                f"{tokenizer_sha256[:12]}); shards of two tokenizers never share a location: give another output, "
                "or --overwrite to replace it"
            )
    return "a dataset" in found


def clear(location: Location, retry: Retry) -> None:
    """Remove the dataset a location holds, the index first (so nothing trusts it while
    its shards go), then every file its records name, then the records."""
    filesystem, root = location.open()
    names: set[str] = set()
    index_data = read_if_present(filesystem, join(root, location.index_name), retry)
    if index_data is not None:
        index = parse_index(index_data, location.index_url)
        names |= {shard.name for shard in (*index.train, index.heldout)} | {index.tokenizer} - {None}
        remove_if_present(filesystem, join(root, location.index_name), retry)
    if (uploads := read_uploads(location, retry)) is not None:
        names |= {file.name for file in uploads.files}
    if location.is_local and (progress := read_progress(local_path(location))) is not None:
        names |= {shard.name for shard in progress.train} | {TOKENIZER_NAME}
        names |= {path.name for path in local_path(location).glob(f"*{PARTIAL_SUFFIX}")}
    for name in sorted(names) + [UPLOADS_NAME, PROGRESS_NAME]:
        remove_if_present(filesystem, join(root, name), retry)


def staged_tokenizer(staging: Path, eos_token: str) -> DatasetTokenizer | None:
    """The tokenizer an earlier run trained, when the staging directory's progress record
    or index was made with it."""
    path = staging / TOKENIZER_NAME
    if not path.exists():
        return None
    tokenizer = DatasetTokenizer.from_json(path.read_bytes(), str(path), eos_token)
    return tokenizer if tokenizer.sha256 in tokenizer_hashes(Location(str(staging)), call_once).values() else None


def obtain_tokenizer(request: PrepareRequest, progress: Progress) -> DatasetTokenizer:
    """The tokenizer given, else the one an earlier run trained, else a byte-level BPE
    trained on the corpus now."""
    if request.tokenizer is not None:
        return load_tokenizer(request.tokenizer, {}, request.eos_token)
    if (earlier := staged_tokenizer(request.staging, request.eos_token)) is not None:
        return earlier
    if request.vocab_size is None:
        raise DatasetError(
            "give a tokenizer (--tokenizer tokenizer.json), or --vocab-size N to train a byte-level BPE on the corpus"
        )
    files = request.corpus.files()
    total = request.corpus.total_bytes(files)
    progress.begin(
        f"training a tokenizer of {request.vocab_size} tokens",
        None if total is None else min(total, TRAINING_SAMPLE_BYTES),
    )
    return train_tokenizer(counted(request.corpus.documents(files), progress), request.vocab_size, request.eos_token)


def dataset_index(record: ProgressRecord) -> DatasetIndex:
    settings = record.settings
    assert record.heldout is not None, "the index is made from a finished record"
    return DatasetIndex(
        dtype=settings.dtype,
        vocab_size=settings.vocab_size,
        tokenizer=TOKENIZER_NAME,
        tokenizer_sha256=settings.tokenizer_sha256,
        eos_token_id=settings.eos_token_id,
        train=tuple(ShardEntry(name=shard.name, tokens=shard.tokens, sha256=shard.sha256) for shard in record.train),
        heldout=record.heldout,
    )


def staged_files(index: DatasetIndex, staging: Path, tokenizer_size: int) -> list[StoredFile]:
    """The staged files in upload order: the tokenizer, the training shards, the held-out shard."""
    files = [StoredFile(name=TOKENIZER_NAME, size=tokenizer_size, sha256=index.tokenizer_sha256)]
    for shard in (*index.train, index.heldout):
        files.append(StoredFile(name=shard.name, size=shard.tokens * index.item_bytes, sha256=shard.sha256))
    return files


def prepare_dataset(request: PrepareRequest, retry: Retry = call_once, progress: Progress = Silent()) -> Prepared:
    """Make the token dataset ``request`` describes in every one of its locations,
    going on from whatever an interrupted run with the same options left."""
    staging = request.staging
    in_place = [location for location in request.locations if location.is_local and local_path(location) == staging]
    if request.overwrite:
        for location in request.locations:
            clear(location, retry)
        if not in_place:
            shutil.rmtree(staging, ignore_errors=True)
    tokenizer = obtain_tokenizer(request, progress)
    if not in_place:
        is_complete_with(Location(str(staging)), tokenizer.sha256, retry)
    complete = [location for location in request.locations if is_complete_with(location, tokenizer.sha256, retry)]
    index_urls = tuple(location.index_url for location in request.locations)
    trained_smaller = request.tokenizer is None and (request.vocab_size or 0) > tokenizer.vocab_size
    asked = request.vocab_size if trained_smaller else None
    if len(complete) == len(request.locations):
        return Prepared(index=None, index_urls=index_urls, complete_before=index_urls, vocab_size_asked=asked)

    staging.mkdir(parents=True, exist_ok=True)
    staged = staging / TOKENIZER_NAME
    if not staged.exists() or staged.read_bytes() != tokenizer.content:
        staged.write_bytes(tokenizer.content)
    settings = TokenizeSettings(
        corpus=request.corpus.url,
        corpus_format=request.corpus.format,
        text_field=request.corpus.text_field,
        separator=request.corpus.separator,
        tokenizer_sha256=tokenizer.sha256,
        eos_token_id=tokenizer.eos_token_id,
        vocab_size=tokenizer.vocab_size,
        dtype=dtype_for_vocabulary(tokenizer.vocab_size),
        shard_tokens=request.shard_tokens,
        heldout_fraction=request.heldout_fraction,
    )
    tokenized = tokenize_corpus(request.corpus, tokenizer, settings, staging, progress)
    index = dataset_index(tokenized.record)
    files = staged_files(index, staging, len(tokenizer.content))
    skipped = 0
    for location in request.locations:
        if location in in_place:
            write_index(location, index, retry)
        elif location not in complete:
            skipped += upload_dataset(staging, files, index, location, retry, progress)
    if not in_place:
        shutil.rmtree(staging)
    return Prepared(
        index=index,
        index_urls=index_urls,
        shards_made=len(index.train) - tokenized.reused,
        shards_reused=tokenized.reused,
        uploads_skipped=skipped,
        complete_before=tuple(location.index_url for location in complete),
        vocab_size_asked=asked,
        documents=tokenized.record.documents,
        separator=request.corpus.separator if request.corpus.reads_text() else None,
    )
