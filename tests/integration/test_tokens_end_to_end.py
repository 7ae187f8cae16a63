"""Tokenized data end to end: `diloco prepare` trains a BPE tokenizer and writes token
shards, `diloco up` trains a tiny Llama-style `transformers` model on them (streamed by
ranged reads), and `diloco export --format hf` gives a directory transformers loads."""

import json

import pytest
import torch

from diloco_cli.data.corpora import builtin_corpus
from tests.support.runs import (
    TINY_RECIPE,
    assert_bases_are_the_syncers,
    assert_every_token_accounted,
    deep_update,
    diloco,
    heartbeats,
    wait_finished,
    write_yaml,
)

pytestmark = pytest.mark.slow


def test_a_transformers_model_trains_on_prepared_tokens_and_exports_for_hugging_face(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(builtin_corpus("shakespeare"))
    dataset = tmp_path / "dataset"
    diloco(
        "prepare",
        str(corpus),
        "-o",
        str(dataset),
        "--vocab-size",
        "512",
        "--shard-tokens",
        "200000",
        "--heldout-fraction",
        "0.05",
    )
    index = json.loads((dataset / "index.json").read_text())
    assert index["vocab_size"] == 512 and index["tokenizer"] == "tokenizer.json" and len(index["train"]) > 2

    runs_dir, name = tmp_path / "runs", "llama-tokens"
    recipe = deep_update(
        TINY_RECIPE,
        {
            "model": {"factory": "diloco_cli.models.hf:causal_lm", "kwargs": {"config": "builtin:tiny-llama"}},
            # small chunks, so that each learner streams many ranged reads
            "data": {"source": str(dataset / "index.json"), "chunk_megabytes": 0.05, "cache_megabytes": 0.2},
            "training": {"inner_steps": 60, "learning_rate": 0.003},
        },
    )
    regions = [
        {"name": n, "bucket": f"file://{tmp_path}/buckets/{n}", "hosts": [{"name": "local", "learners": 1}]}
        for n in ("east", "west")
    ]
    diloco(
        "up",
        str(write_yaml(tmp_path / "recipe.yaml", recipe)),
        "--regions",
        str(write_yaml(tmp_path / "regions.yaml", {"regions": regions})),
        "--name",
        name,
        "--runs-dir",
        str(runs_dir),
    )
    wait_finished(runs_dir, name)
    assert_every_token_accounted(runs_dir, name, heartbeats(runs_dir, name))
    assert_bases_are_the_syncers(runs_dir, name)
    status = json.loads(diloco("status", name, "-o", "json", "--runs-dir", str(runs_dir)).stdout)
    losses = [evaluation["loss"] for evaluation in status["evaluations"]]
    assert losses[0] == pytest.approx(6.24, abs=0.1) and losses[-1] < losses[0] - 0.7, losses  # from ln(512)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    exported = tmp_path / "hf"
    diloco("export", name, "--format", "hf", "-o", str(exported), "--runs-dir", str(runs_dir))
    model = AutoModelForCausalLM.from_pretrained(exported)
    tokenizer = AutoTokenizer.from_pretrained(exported)
    ids = tokenizer("ROMEO: What say you?", return_tensors="pt").input_ids
    assert tokenizer.decode(ids[0]) == "ROMEO: What say you?"
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 512) and torch.isfinite(logits).all()
    sample = diloco("sample", name, "--prompt", "ROMEO:", "-n", "20", "--runs-dir", str(runs_dir))
    assert sample.stdout.startswith("ROMEO:")
