"""``diloco prepare``: make a token dataset from a corpus, or index shards you have."""

from __future__ import annotations

import re
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from diloco_cli.cli.errors import reported
from diloco_cli.cli.runs_commands import RUNS_DIR

if TYPE_CHECKING:
    from diloco_cli.data.tokens.progress import Progress
    from diloco_cli.data.tokens.storage import Location, Retry


class CorpusFormat(str, Enum):
    AUTO = "auto"
    TEXT = "text"
    JSONL = "jsonl"
    PARQUET = "parquet"


class TokenType(str, Enum):
    UINT16 = "uint16"
    UINT32 = "uint32"


def storage_retry() -> Retry:
    """Every storage call retried as a run's are (the recipe's default ``storage`` policy)."""
    from diloco_cli.config.recipe import RetryPolicy
    from diloco_cli.store.metering import StorageMeter
    from diloco_cli.store.retry import call_with_retries

    meter = StorageMeter()
    return lambda call: call_with_retries(call, RetryPolicy(), meter, "a storage call of diloco prepare")


def parse_storage_options(text: str | None) -> dict:
    """``--storage-options``: a JSON object of filesystem options, as a region file's
    ``storage_options`` (never credentials)."""
    import json

    from diloco_cli.config.credentials import refuse_inline_credentials
    from diloco_cli.config.errors import ConfigError

    if text is None:
        return {}
    try:
        options = json.loads(text)
    except ValueError:
        options = None
    if not isinstance(options, dict):
        raise ConfigError(
            f"--storage-options {text!r} is not a JSON object; give e.g. "
            '\'{"endpoint_url": "http://localhost:9000"}\' (the storage_options of a region file)'
        )
    try:
        refuse_inline_credentials(options, "--storage-options")
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return options


def dataset_name(corpus: str) -> str:
    """A dataset name from the corpus's file name: ``data/tiny-stories.jsonl.gz`` is ``tiny-stories``."""
    base = corpus.rstrip("/").rsplit("/", 1)[-1].split(".", 1)[0]
    return re.sub(r"[^a-z0-9-]+", "-", base.lower()).strip("-") or "corpus"


@reported
def prepare(
    corpus: str | None = typer.Argument(
        None,
        help=(
            "The corpus: a local path or fsspec URL of a file, or a glob of files "
            "(plain text, JSON lines or Parquet; .gz/.zst read as such)."
        ),
        show_default=False,
    ),
    output: str | None = typer.Option(
        None,
        "--output",
        "-o",
        metavar="URL",
        help="Where the dataset goes: a local directory or a URL (s3://bucket/prefix).",
    ),
    storage_options: str | None = typer.Option(
        None,
        "--storage-options",
        metavar="JSON",
        help=(
            "Filesystem options of --output (or --existing), as a region file's storage_options: "
            'e.g. \'{"endpoint_url": "http://localhost:9000"}\' for an S3-compatible store.'
        ),
    ),
    regions: Path | None = typer.Option(
        None,
        "--regions",
        "-r",
        help=(
            "Region file: one copy in each region's bucket instead of --output "
            "(a region's data_source when it names an index, else <bucket>/datasets/NAME/)."
        ),
    ),
    name: str | None = typer.Option(
        None,
        "--name",
        help="The dataset's name in <bucket>/datasets/NAME/ with --regions [default: the corpus's file name].",
    ),
    tokenizer: str | None = typer.Option(
        None,
        "--tokenizer",
        metavar="FILE",
        help="A Hugging Face tokenizer.json to tokenize with (copied beside the shards).",
    ),
    vocab_size: int | None = typer.Option(
        None,
        "--vocab-size",
        metavar="N",
        min=1,
        max=2**32,
        help=(
            "Without --tokenizer: train a byte-level BPE of N tokens on the corpus. "
            "With --existing: every token id is below N."
        ),
    ),
    corpus_format: CorpusFormat = typer.Option(
        CorpusFormat.AUTO,
        "--format",
        help="The corpus's format; auto: by each file's name (.jsonl, .parquet, else text).",
    ),
    text_field: str = typer.Option(
        "text", "--text-field", metavar="NAME", help="JSON lines: the key of the text; Parquet: the text column."
    ),
    separator: str = typer.Option(
        "\n\n",
        "--separator",
        metavar="TEXT",
        help=(
            "Plain text: what separates two documents (each ends with --eos-token, so a model learns "
            "to stop where they end). A blank line suits prose, but cuts source files or articles "
            "that have blank lines into short pieces: give text that only comes between documents "
            "(in bash, $'\\n<|doc|>\\n' has newlines), or one JSON line per document."
        ),
        show_default="a blank line",
    ),
    eos_token: str = typer.Option(
        "<|endoftext|>", "--eos-token", metavar="TOKEN", help="The end-of-document token written after every document."
    ),
    shard_tokens: int = typer.Option(
        10_000_000, "--shard-tokens", metavar="N", min=1, help="Tokens per training shard."
    ),
    heldout_fraction: float = typer.Option(
        0.01,
        "--heldout-fraction",
        metavar="F",
        help="The fraction of documents held out for evaluation (at least one document).",
    ),
    work_dir: Path | None = typer.Option(
        None,
        "--work-dir",
        metavar="DIR",
        help=(
            "Where to stage shards bound for buckets "
            "[default: ~/.cache/diloco/prepare/...; the output itself when it is local]."
        ),
    ),
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        help=(
            "Replace the dataset the output already holds "
            "(else one of another tokenizer is refused, and one of this tokenizer is resumed)."
        ),
    ),
    existing: str | None = typer.Option(
        None,
        "--existing",
        metavar="DIR",
        help=(
            "Index the token shards already in DIR (nanoGPT's train.bin and val.bin) instead of making them; "
            "needs --dtype and --vocab-size."
        ),
    ),
    dtype: TokenType | None = typer.Option(None, "--dtype", help="With --existing: the shards' token type."),
    heldout: str = typer.Option("val.bin", "--heldout", metavar="FILE", help="With --existing: the held-out shard."),
    train: list[str] = typer.Option(
        [],
        "--train",
        metavar="FILE",
        help="With --existing: a training shard, in order (repeatable) [default: every *.bin but --heldout, by name].",
    ),
    runs_dir: Path = RUNS_DIR,
) -> None:
    """Tokenize a corpus into token shards, an index and a tokenizer, in one place or in each region's bucket;
    resumes after an interruption."""
    from diloco_cli.config.errors import ConfigError
    from diloco_cli.data.tokens.storage import Location
    from diloco_cli.store.filesystem import absolute_path
    from diloco_cli.views.prepare import progress_display, render_prepared, short_documents_warning

    display = progress_display()
    options = parse_storage_options(storage_options)
    if options and regions is not None:
        raise ConfigError(
            "--storage-options goes with --output or --existing; with --regions each region's storage_options apply"
        )
    if existing is not None:
        if corpus is not None or output is not None or regions is not None:
            raise ConfigError(
                "--existing DIR indexes shards where they are: give no corpus, --output or --regions with it"
            )
        if dtype is None or vocab_size is None:
            raise ConfigError("--existing needs --dtype (uint16 or uint32) and --vocab-size N")
        with display:
            _index_existing(
                Location(absolute_path(existing), options),
                dtype.value,
                vocab_size,
                heldout,
                train,
                tokenizer,
                eos_token,
                overwrite,
                display,
            )
        return
    if corpus is None:
        raise ConfigError("give a corpus to prepare (or --existing DIR to index shards you have)")
    if (output is None) == (regions is None):
        raise ConfigError("give one of --output URL (one location) and --regions FILE (a copy in each region's bucket)")
    from diloco_cli.config.files import load_regions
    from diloco_cli.data.tokens.corpus import Corpus
    from diloco_cli.data.tokens.prepare import PrepareRequest, prepare_dataset, region_locations

    if regions is not None:
        locations = region_locations(load_regions(regions), name or dataset_name(corpus), str(runs_dir))
    else:
        locations = (Location(absolute_path(output), options),)
    request = PrepareRequest(
        corpus=Corpus(corpus, format=corpus_format.value, text_field=text_field, separator=separator),
        locations=locations,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        eos_token=eos_token,
        shard_tokens=shard_tokens,
        heldout_fraction=heldout_fraction,
        work_dir=work_dir,
        overwrite=overwrite,
    )
    with display:
        prepared = prepare_dataset(request, storage_retry(), display)
    typer.echo(render_prepared(prepared))
    if (warning := short_documents_warning(prepared)) is not None:
        typer.echo(warning, err=True)


def _index_existing(
    location: Location,
    dtype: str,
    vocab_size: int,
    heldout: str,
    train: list[str],
    tokenizer: str | None,
    eos_token: str,
    overwrite: bool,
    display: Progress,
) -> None:
    from diloco_cli.data.tokens.existing import index_existing
    from diloco_cli.views.prepare import render_indexed

    index = index_existing(
        location,
        dtype=dtype,
        vocab_size=vocab_size,
        heldout=heldout,
        train=train,
        tokenizer=tokenizer,
        eos_token=eos_token,
        overwrite=overwrite,
        retry=storage_retry(),
        progress=display,
    )
    typer.echo(render_indexed(index, location))


def register(app: typer.Typer) -> None:
    app.command()(prepare)
