"""Corpora of made-up documents for ``diloco prepare``, and the check that a prepared dataset
matches its index (sizes and SHA-256) and decodes, document by document, back to its corpus."""

import hashlib
import random
from pathlib import Path

import numpy as np
from click.testing import CliRunner
from tokenizers import Tokenizer

from diloco_cli.cli.app import app
from diloco_cli.data.tokens.index import DatasetIndex
from diloco_cli.data.tokens.shards import is_heldout

runner = CliRunner()


WORDS = [
    "the",
    "king",
    "crown",
    "naïve",
    "café",
    "über",
    "—",
    "sea",
    "1606",
    "storm",
    "🌊",
    "said",
    "to",
    "a",
    "of",
    "Ω",
    "fool",
    "night",
]


def make_documents(count: int, seed: int = 0) -> list[str]:
    """Documents of a few lines of words (ASCII and not), none with a blank line."""
    rng = random.Random(seed)
    documents = []
    for _ in range(count):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(rng.randint(1, 4))]
        documents.append("\n".join(lines) + rng.choice(["", ".", "!"]))
    return documents


def write_text_corpus(path: Path, documents: list[str]) -> Path:
    path.write_text("\n\n".join(documents), encoding="utf-8")
    return path


def prepare(*args: str) -> str:
    result = runner.invoke(app, ["prepare", *args])
    assert result.exit_code == 0, result.output
    return result.stdout


def read_dataset(directory: Path) -> tuple[DatasetIndex, dict[str, bytes]]:
    index = DatasetIndex.model_validate_json((directory / "index.json").read_bytes())
    files = {entry.name: (directory / entry.name).read_bytes() for entry in (*index.train, index.heldout)}
    return index, files


def assert_matches_index(index: DatasetIndex, files: dict[str, bytes]) -> None:
    for entry in (*index.train, index.heldout):
        assert len(files[entry.name]) == entry.tokens * index.item_bytes, entry.name
        assert hashlib.sha256(files[entry.name]).hexdigest() == entry.sha256, entry.name


def decoded_documents(
    index: DatasetIndex, files: dict[str, bytes], tokenizer_json: bytes, heldout_fraction: float
) -> list[str]:
    """The corpus's documents in order, decoded from the training and held-out shards."""
    tokenizer = Tokenizer.from_str(tokenizer_json.decode())
    assert hashlib.sha256(tokenizer_json).hexdigest() == index.tokenizer_sha256

    def documents_of(data: bytes) -> list[str]:
        tokens = np.frombuffer(data, dtype=index.dtype).tolist()
        ends = [i for i, token in enumerate(tokens) if token == index.eos_token_id]
        assert ends and ends[-1] == len(tokens) - 1  # every document ends with the EOS token
        starts = [0] + [end + 1 for end in ends[:-1]]
        return [tokenizer.decode(tokens[start:end], skip_special_tokens=False) for start, end in zip(starts, ends)]

    train = documents_of(b"".join(files[entry.name] for entry in index.train))
    heldout = documents_of(files[index.heldout.name])
    assert 1 <= len(heldout) < len(train)
    merged = []
    for number in range(len(train) + len(heldout)):
        merged.append(heldout.pop(0) if is_heldout(number, heldout_fraction) else train.pop(0))
    return merged


def check_dataset(directory: Path, documents: list[str], heldout_fraction: float = 0.01) -> DatasetIndex:
    index, files = read_dataset(directory)
    assert_matches_index(index, files)
    assert decoded_documents(index, files, (directory / index.tokenizer).read_bytes(), heldout_fraction) == documents
    return index
