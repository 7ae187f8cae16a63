"""The README's "Your data" steps, as written, from a clone's root: a corpus prepared into
the local regions' buckets, recipes/tiny-llama.yaml trained on it (a short run: fewer
steps), a sample and a Hugging Face export that transformers loads.

The first try of these steps once passed every check of ``up`` and then crash-looped:
``prepare`` printed a relative URL, which every process read from ``runs/<run>/``."""

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from diloco_cli.data.corpora import builtin_corpus
from tests.support.readme import own_data_commands
from tests.support.runs import assert_bases_are_the_syncers, logs_of

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SHORT_RUN = {
    "training.inner_steps": 16,
    "training.warmup_steps": 3,
    "training.heartbeat_seconds": 0.5,
    "training.poll_seconds": 0.3,
    "sync.sync_interval": 8,
    "sync.evaluate_every": 2,
    "sync.evaluation_batches": 1,
    "sync.poll_seconds": 0.2,
}


def run(command: str, cwd: Path, extra: list[str] = ()) -> subprocess.CompletedProcess:
    arguments = [a.strip('"') for a in re.findall(r'"[^"]*"|\S+', command)]
    return subprocess.run(
        [sys.executable, "-m", "diloco_cli", *arguments[1:], *extra],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_readme_own_data_steps_train_a_hugging_face_model_on_ones_own_text(tmp_path):
    started = time.monotonic()
    for folder, name in (("recipes", "tiny-llama.yaml"), ("regions", "local.yaml")):  # a clone's root
        (tmp_path / folder).mkdir()
        shutil.copy(ROOT / folder / name, tmp_path / folder / name)
    (tmp_path / "corpus.txt").write_bytes(builtin_corpus("shakespeare")[:300_000])
    prepare, up, sample, export = own_data_commands()

    prepared = run(prepare, tmp_path)
    assert prepared.returncode == 0, prepared.stderr
    index = tmp_path / "runs/datasets/buckets/local-a/corpus/index.json"
    assert f"train on it: diloco up RECIPE --set data.source=file://{index}" in prepared.stdout, prepared.stdout
    assert (tmp_path / "runs/datasets/buckets/local-b/corpus/index.json").exists()

    short = [f"--set={key}={value}" for key, value in SHORT_RUN.items()]
    trained = run(up, tmp_path, short)
    assert trained.returncode == 0, trained.stderr
    name = re.search(r"started run (\S+):", trained.stdout).group(1)
    assert f"run {name}  finished" in trained.stdout, logs_of(tmp_path / "runs", name)[-3000:]
    assert "(restart 1)" not in logs_of(tmp_path / "runs", name)  # no process crashed
    assert_bases_are_the_syncers(tmp_path / "runs", name)

    sampled = run(sample.replace("RUN", name), tmp_path)
    assert sampled.returncode == 0 and sampled.stdout.startswith("Once upon a time"), sampled.stderr
    assert "<|endoftext|>" not in sampled.stdout
    exported = run(export.replace("RUN", name), tmp_path)
    assert exported.returncode == 0 and exported.stderr == "", exported.stderr
    assert exported.stdout.startswith("wrote my-model: global version ")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "my-model")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "my-model")
    prompt = tokenizer("Once upon a time", return_tensors="pt").input_ids
    with torch.no_grad():
        generated = model.generate(prompt, max_new_tokens=8, do_sample=False)
    assert generated.shape[1] <= prompt.shape[1] + 8
    print(f"the README's own-data steps took {time.monotonic() - started:.0f} s")
