"""``diloco prepare``: make a token dataset from a corpus, or index shards you have."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import click

from diloco_cli.cli.errors import reported
from diloco_cli.cli.parameters import PATH, Real, Whole, any_number, argument, command, option, runs_dir_option

if TYPE_CHECKING:
    from diloco_cli.data.tokens.progress import Progress
    from diloco_cli.data.tokens.storage import Location, Retry


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


@command()
@argument(
    "corpus",
    required=False,
    help=(
        "The corpus: a local path or fsspec URL of a file, or a glob of files "
        "(plain text, JSON lines or Parquet; .gz/.zst read as such)."
    ),
)
@option(
    "--output",
    "-o",
    metavar="URL",
    help="Where the dataset goes: a local directory or a URL (s3://bucket/prefix).",
)
@option(
    "--storage-options",
    metavar="JSON",
    help=(
        "Filesystem options of --output (or --existing), as a region file's storage_options: "
        'e.g. \'{"endpoint_url": "http://localhost:9000"}\' for an S3-compatible store.'
    ),
)
@option(
    "--regions",
    "-r",
    type=PATH,
    help=(
        "Region file: one copy in each region's bucket instead of --output "
        "(a region's data_source when it names an index, else <bucket>/datasets/NAME/)."
    ),
)
@option(
    "--name",
    help="The dataset's name in <bucket>/datasets/NAME/ with --regions [default: the corpus's file name].",
)
@option(
    "--tokenizer",
    metavar="FILE",
    help="A Hugging Face tokenizer.json to tokenize with (copied beside the shards).",
)
@option(
    "--vocab-size",
    metavar="N",
    type=Whole(1, 2**32),
    help=(
        "Without --tokenizer: train a byte-level BPE of N tokens on the corpus. "
        "With --existing: every token id is below N."
    ),
)
@option(
    "--format",
    "corpus_format",
    type=click.Choice(["auto", "text", "jsonl", "parquet"]),
    default="auto",
    help="The corpus's format; auto: by each file's name (.jsonl, .parquet, else text).",
)
@option(
    "--text-field",
    metavar="NAME",
    default="text",
    help="JSON lines: the key of the text; Parquet: the text column.",
)
@option(
    "--separator",
    metavar="TEXT",
    default="\n\n",
    help=(
        "Plain text: what separates two documents (each ends with --eos-token, so a model learns "
        "to stop where they end). A blank line suits prose, but cuts source files or articles "
        "that have blank lines into short pieces: give text that only comes between documents "
        "(in bash, $'\\n<|doc|>\\n' has newlines), or one JSON line per document."
    ),
    show_default="a blank line",
)
@option(
    "--eos-token",
    metavar="TOKEN",
    default="<|endoftext|>",
    help="The end-of-document token written after every document.",
)
@option("--shard-tokens", metavar="N", type=Whole(1), default=10_000_000, help="Tokens per training shard.")
@option(
    "--heldout-fraction",
    metavar="F",
    type=Real(any_number),
    default=0.01,
    help="The fraction of documents held out for evaluation (at least one document).",
)
@option(
    "--work-dir",
    metavar="DIR",
    type=PATH,
    help=(
        "Where to stage shards bound for buckets "
        "[default: ~/.cache/diloco/prepare/...; the output itself when it is local]."
    ),
)
@option(
    "--overwrite",
    is_flag=True,
    help=(
        "Replace the dataset the output already holds "
        "(else one of another tokenizer is refused, and one of this tokenizer is resumed)."
    ),
)
@option(
    "--existing",
    metavar="DIR",
    help=(
        "Index the token shards already in DIR (nanoGPT's train.bin and val.bin) instead of making them; "
        "needs --dtype and --vocab-size."
    ),
)
@option("--dtype", type=click.Choice(["uint16", "uint32"]), help="With --existing: the shards' token type.")
@option("--heldout", metavar="FILE", default="val.bin", help="With --existing: the held-out shard.")
@option(
    "--train",
    multiple=True,
    metavar="FILE",
    help="With --existing: a training shard, in order (repeatable) [default: every *.bin but --heldout, by name].",
)
@runs_dir_option()
@reported
def prepare(
    corpus: str | None,
    output: str | None,
    storage_options: str | None,
    regions: Path | None,
    name: str | None,
    tokenizer: str | None,
    vocab_size: int | None,
    corpus_format: str,
    text_field: str,
    separator: str,
    eos_token: str,
    shard_tokens: int,
    heldout_fraction: float,
    work_dir: Path | None,
    overwrite: bool,
    existing: str | None,
    dtype: str | None,
    heldout: str,
    train: list[str],
    runs_dir: Path,
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
                dtype,
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
        corpus=Corpus(corpus, format=corpus_format, text_field=text_field, separator=separator),
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
    click.echo(render_prepared(prepared))
    if (warning := short_documents_warning(prepared)) is not None:
        click.echo(warning, err=True)


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
    click.echo(render_indexed(index, location))


def register(app: click.Group) -> None:
    app.add_command(prepare)
