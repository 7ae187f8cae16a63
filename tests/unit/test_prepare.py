"""``diloco prepare``: real corpora (text, JSON lines, Parquet) through a real tokenizer
into shards on disk, interrupted and resumed (into S3, in every region's bucket:
tests/integration/test_prepare_s3.py).

Every dataset is checked the same way: its files match the index (sizes and SHA-256)
and its shards decode, document by document, back to the corpus.
"""

import json
import sys

import pytest
from click.testing import CliRunner
from tokenizers import Tokenizer

from diloco_cli.cli.app import app
from diloco_cli.data.tokens.corpus import Corpus
from diloco_cli.data.tokens.prepare import PrepareRequest, prepare_dataset
from diloco_cli.data.tokens.progress import Silent
from diloco_cli.data.tokens.shards import PROGRESS_NAME, read_progress
from diloco_cli.data.tokens.storage import Location
from tests.support.corpora import check_dataset, make_documents, prepare, read_dataset, write_text_corpus

runner = CliRunner()


def test_prepare_text_round_trips_through_the_trained_tokenizer(tmp_path):
    documents = make_documents(300)
    corpus = write_text_corpus(tmp_path / "corpus.txt", documents)
    output = prepare(
        str(corpus),
        "-o",
        str(tmp_path / "out"),
        "--vocab-size",
        "300",
        "--shard-tokens",
        "3000",
        "--heldout-fraction",
        "0.05",
    )
    index = check_dataset(tmp_path / "out", documents, 0.05)
    assert index.format == "diloco-tokens/1" and index.dtype == "uint16" and index.vocab_size <= 300
    assert index.tokenizer == "tokenizer.json" and index.eos_token_id is not None
    assert len(index.train) > 3 and all(entry.tokens == 3000 for entry in index.train[:-1])
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == sorted(
        ["index.json", "tokenizer.json", "heldout.bin", *(e.name for e in index.train)]
    )
    assert f"index: {tmp_path / 'out' / 'index.json'}" in output


@pytest.mark.parametrize("corpus_format", ["jsonl", "parquet"])
def test_prepare_json_lines_and_parquet_take_the_named_text_field(tmp_path, corpus_format):
    documents = make_documents(200, seed=1)
    records = [{"id": number, "body": document} for number, document in enumerate(documents)]
    if corpus_format == "jsonl":
        corpus = tmp_path / "corpus.jsonl"
        corpus.write_text("".join(json.dumps(record) + "\n" for record in records))
    else:
        import pyarrow
        import pyarrow.parquet

        corpus = tmp_path / "corpus.parquet"
        pyarrow.parquet.write_table(pyarrow.Table.from_pylist(records), corpus, row_group_size=64)
    prepare(
        str(corpus),
        "-o",
        str(tmp_path / "out"),
        "--text-field",
        "body",
        "--vocab-size",
        "320",
        "--shard-tokens",
        "2500",
    )
    check_dataset(tmp_path / "out", documents)


class Interrupted(Exception):
    pass


class InterruptAfterShards(Silent):
    """Stops prepare once ``count`` new training shards are recorded (as a kill would)."""

    def __init__(self, count: int) -> None:
        self.left = count

    def done(self, item: str, reused: bool) -> None:
        if item.startswith("train-") and not reused:
            self.left -= 1
            if self.left == 0:
                raise Interrupted(item)


def test_an_interrupted_tokenizing_goes_on_without_redoing_a_finished_shard(tmp_path):
    documents = make_documents(400, seed=2)
    corpus = Corpus(str(write_text_corpus(tmp_path / "corpus.txt", documents)))
    output = tmp_path / "out"
    request = PrepareRequest(corpus=corpus, locations=(Location(str(output)),), vocab_size=300, shard_tokens=2000)
    with pytest.raises(Interrupted):
        prepare_dataset(request, progress=InterruptAfterShards(3))
    assert not (output / "index.json").exists()  # unfinished: nothing may trust it
    finished = read_progress(output).train
    assert [shard.name for shard in finished] == ["train-00000.bin", "train-00001.bin", "train-00002.bin"]
    before = {shard.name: (output / shard.name).stat() for shard in finished}

    prepared = prepare_dataset(request)
    assert prepared.shards_reused == 3 and prepared.shards_made == len(prepared.index.train) - 3
    for name, stat in before.items():  # the same files, untouched
        assert (output / name).stat().st_ino == stat.st_ino and (output / name).stat().st_mtime_ns == stat.st_mtime_ns
    assert not (output / PROGRESS_NAME).exists()
    check_dataset(output, documents)

    # an uninterrupted run with the same tokenizer makes the very same shards
    clean = tmp_path / "clean"
    prepare_dataset(
        PrepareRequest(
            corpus=corpus,
            locations=(Location(str(clean)),),
            tokenizer=str(output / "tokenizer.json"),
            shard_tokens=2000,
        )
    )
    assert read_dataset(clean)[0] == prepared.index


def test_a_second_tokenizer_is_refused_in_the_same_output(tmp_path):
    documents = make_documents(200, seed=4)
    corpus = str(write_text_corpus(tmp_path / "corpus.txt", documents))
    prepare(corpus, "-o", str(tmp_path / "first"), "--vocab-size", "300")
    prepare(corpus, "-o", str(tmp_path / "second"), "--vocab-size", "280")
    index_before = (tmp_path / "first" / "index.json").read_bytes()

    again = prepare(corpus, "-o", str(tmp_path / "first"), "--vocab-size", "300")
    assert "already complete, nothing to do" in again

    refused = runner.invoke(
        app,
        ["prepare", corpus, "-o", str(tmp_path / "first"), "--tokenizer", str(tmp_path / "second" / "tokenizer.json")],
    )
    assert refused.exit_code == 2
    message = refused.stderr.strip()
    assert message.count("\n") == 0 and message.startswith("error: ")
    assert "already holds a dataset made with another tokenizer" in message and "--overwrite" in message
    assert (tmp_path / "first" / "index.json").read_bytes() == index_before

    prepare(
        corpus, "-o", str(tmp_path / "first"), "--tokenizer", str(tmp_path / "second" / "tokenizer.json"), "--overwrite"
    )
    assert (
        check_dataset(tmp_path / "first", documents).tokenizer_sha256
        == read_dataset(tmp_path / "second")[0].tokenizer_sha256
    )


@pytest.mark.parametrize(
    ("corpus_name", "content", "arguments", "expected"),
    [
        (
            "c.jsonl",
            '{"body": "x"}\n',
            ["--vocab-size", "300"],
            "has no text in 'text' (keys: body); name the key with --text-field",
        ),
        ("c.parquet", "", ["--vocab-size", "300"], "needs pyarrow: pip install 'diloco-cli[parquet]'"),
        ("c.txt", "a\n\nb\n\nc", ["--vocab-size", "100"], "--vocab-size 100 is too small"),
        ("c.txt", "a\n\nb\n\nc", [], "give a tokenizer (--tokenizer tokenizer.json), or --vocab-size N"),
        ("c.txt", "only one document", ["--vocab-size", "300"], "leaves no training tokens"),
        ("c.txt", "", ["--vocab-size", "300"], "corpus {corpus} is empty: it holds no document"),
        ("c.txt", "\n\n\n\n", ["--vocab-size", "300"], "is empty: it holds no document"),
        ("c.jsonl", "\n\n", ["--vocab-size", "300"], "is empty: it holds no document"),
        ("c.txt", "a\n\nb", ["--vocab-size", "300", "--storage-options", "endpoint"], "is not a JSON object"),
        (
            "c.txt",
            "a\n\nb",
            ["--vocab-size", "300", "--storage-options", '{"secret": "x"}'],
            "--storage-options hold credentials (secret)",
        ),
        ("missing.txt", None, ["--vocab-size", "300"], "no such file"),
    ],
)
def test_mistakes_are_one_line_and_say_what_to_do(tmp_path, monkeypatch, corpus_name, content, arguments, expected):
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # as if pyarrow were not installed
    if content is not None:
        (tmp_path / corpus_name).write_text(content)
    result = runner.invoke(app, ["prepare", str(tmp_path / corpus_name), "-o", str(tmp_path / "out"), *arguments])
    assert result.exit_code == 2, result.output
    *progress, error = result.stderr.splitlines()
    expected = expected.format(corpus=tmp_path / corpus_name)
    assert error.startswith("error: ") and expected in error and "Traceback" not in result.output


def test_a_vocabulary_larger_than_the_corpus_supports_says_what_it_got(tmp_path):
    """A byte-level BPE stops merging when no pair occurs twice: the output says how many
    tokens it made of the number asked, so that the model's vocab_size can follow."""
    documents = make_documents(200, seed=6)
    corpus = write_text_corpus(tmp_path / "corpus.txt", documents)
    output = prepare(str(corpus), "-o", str(tmp_path / "out"), "--vocab-size", "70000")
    made = read_dataset(tmp_path / "out")[0].vocab_size
    assert made < 1000
    assert f"vocabulary: {made:,} tokens made, 70,000 asked" in output
    assert f"the model's vocab_size must be at least {made:,}" in output
    quiet = prepare(str(corpus), "-o", str(tmp_path / "exact"), "--vocab-size", str(made))
    assert "vocabulary:" not in quiet


def test_prepare_says_how_many_documents_it_made_and_how_long_they_are(tmp_path):
    """Documents, tokens, the mean and the shortest, counted over the whole corpus: the
    same when an interrupted run is resumed half-way as when nothing interrupted it."""
    documents = make_documents(400, seed=7)
    corpus = write_text_corpus(tmp_path / "corpus.txt", documents)
    clean = prepare(str(corpus), "-o", str(tmp_path / "clean"), "--vocab-size", "300", "--shard-tokens", "2000")
    tokenizer = Tokenizer.from_file(str(tmp_path / "clean" / "tokenizer.json"))
    lengths = [len(ids) for ids in (encoding.ids for encoding in tokenizer.encode_batch(documents))]
    tokens = sum(lengths) + len(documents)  # each with its end-of-document token
    mean = sum(lengths) / len(documents)
    expected = (
        f"{len(documents):,} documents, {tokens:,} tokens: {mean:,.0f} tokens a document on average, "
        f"the shortest {min(lengths)}"
    )
    assert expected in clean.splitlines()

    request = PrepareRequest(
        corpus=Corpus(str(corpus)),
        locations=(Location(str(tmp_path / "resumed")),),
        tokenizer=str(tmp_path / "clean" / "tokenizer.json"),
        shard_tokens=2000,
    )
    with pytest.raises(Interrupted):
        prepare_dataset(request, progress=InterruptAfterShards(2))
    resumed = prepare_dataset(request)
    assert resumed.shards_reused == 2 and resumed.documents.documents == len(documents)
    assert resumed.documents.shortest == min(lengths)


def test_documents_cut_short_by_the_separator_are_warned_of_with_what_to_do(tmp_path):
    """Source files have blank lines: the default separator cuts them into pieces of a few
    tokens, and a model trained on those learns to stop after a few tokens."""
    source = "\n\n".join(f"def f{n}(x):\n    return x + {n}\n" for n in range(40))
    (tmp_path / "code").mkdir()
    for number in range(30):
        (tmp_path / "code" / f"m{number:02d}.py").write_text(source)
    corpus = str(tmp_path / "code" / "*.py")
    cut = runner.invoke(app, ["prepare", corpus, "-o", str(tmp_path / "cut"), "--vocab-size", "300"])
    assert cut.exit_code == 0, cut.output
    assert "1,200 documents" in cut.stdout  # 30 files of 40 functions
    warning = cut.stderr.splitlines()[-1]
    assert warning.startswith("warning: the documents average ") and "far shorter than a training sequence" in warning
    assert "The separator '\\n\\n' cut the text into them" in warning and "give --separator" in warning
    whole = runner.invoke(
        app,
        ["prepare", corpus, "-o", str(tmp_path / "whole"), "--tokenizer", str(tmp_path / "cut/tokenizer.json")]
        + ["--separator", "\n<|doc|>\n"],
    )
    assert whole.exit_code == 0 and "30 documents" in whole.stdout and "warning" not in whole.stderr, whole.output
    assert "what separates two documents" in runner.invoke(app, ["prepare", "--help"]).stdout


def test_prepare_prints_absolute_urls_a_run_can_read_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_text_corpus(tmp_path / "corpus.txt", make_documents(100, seed=8))
    output = prepare("corpus.txt", "-o", "tokens", "--vocab-size", "300")
    assert f"index: {tmp_path}/tokens/index.json" in output.splitlines()
    assert f"train on it: diloco up RECIPE --set data.source={tmp_path}/tokens/index.json" in output
