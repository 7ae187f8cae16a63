"""Hugging Face models: built offline and identically everywhere, fragmented like any
model, exported in Hugging Face format with the dataset's tokenizer, sampled."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from diloco_cli.cli.app import app
from diloco_cli.codec import RunSecret
from diloco_cli.config.errors import ConfigError
from diloco_cli.config.loading import load_model
from diloco_cli.config.recipe import DataConfig, Recipe
from diloco_cli.config.regions import RegionsFile
from diloco_cli.core.fragments import fragments_of_model
from diloco_cli.launch.resolve import resolve_run
from diloco_cli.models.gpt import byte_gpt
from diloco_cli.models.hf import causal_lm
from diloco_cli.runtime import export
from diloco_cli.runtime.export import (
    SamplingTokenizer,
    dataset_tokenizer,
    sample_text,
    sampling_tokenizer,
    save_hugging_face,
)
from diloco_cli.store.documents import Head
from tests.support.runs_on_disk import made_run

ROOT = Path(__file__).resolve().parents[2]
TINY = "builtin:tiny-llama"
TINY_PARAMETERS = 123_712
LLAMA_SMALL_PARAMETERS = 109_529_856


@pytest.fixture
def offline(monkeypatch):
    """Any network connection fails the test: building a model must never reach the hub."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def refuse(self, address):
        raise AssertionError(f"network access to {address}")

    monkeypatch.setattr(socket.socket, "connect", refuse)


def built(seed: int, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    return causal_lm(TINY, **overrides)


def perturbed(model: torch.nn.Module) -> torch.nn.Module:
    """The model with weights no fresh build has, as the global weights of a run would be."""
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.01)
    return model.eval()


def tiny_tokenizer(vocab_size: int = 300) -> Tokenizer:
    """A byte-level BPE trained on a few sentences, as `diloco prepare` would make one."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, hello tokens"] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer


def token_dataset(directory: Path, tokenizer: Tokenizer | None) -> Path:
    """A token dataset (nanoGPT-style shards indexed as `prepare --existing` does), with
    this tokenizer or none; returns its index."""
    from diloco_cli.data.tokens.existing import index_existing
    from diloco_cli.data.tokens.storage import Location

    directory.mkdir(parents=True, exist_ok=True)
    for name in ("train.bin", "val.bin"):
        np.arange(1000, dtype=np.uint16).tofile(directory / name)
    tokenizer_file = None
    if tokenizer is not None:
        tokenizer_file = directory.parent / f"{directory.name}-tokenizer.json"
        tokenizer_file.write_text(tokenizer.to_str())
    index_existing(
        Location(str(directory)),
        dtype="uint16",
        vocab_size=1000,
        tokenizer=str(tokenizer_file) if tokenizer_file else None,
    )
    return directory / "index.json"


# --------------------------------------------------------------------------- the build


def test_tiny_llama_builds_offline_and_identically_from_the_same_seed(offline):
    first, second, other_seed = built(0), built(0), built(1)
    assert sum(p.numel() for p in first.parameters()) == TINY_PARAMETERS
    assert next(first.parameters()).dtype == torch.float32
    assert [name for name, _ in first.named_parameters()] == [name for name, _ in second.named_parameters()]
    first_state, second_state = first.state_dict(), second.state_dict()
    assert list(first_state) == list(second_state)
    assert all(torch.equal(first_state[name], second_state[name]) for name in first_state)
    assert not torch.equal(
        first_state["model.layers.0.mlp.up_proj.weight"], other_seed.state_dict()["model.layers.0.mlp.up_proj.weight"]
    )


def test_forward_returns_logits_over_the_vocabulary(offline):
    model = built(0)
    output = model(torch.randint(0, 512, (2, 16)))
    assert output.logits.shape == (2, 16, 512)


@pytest.mark.parametrize("tied", [True, False])
def test_fragments_cover_every_parameter_once(offline, tied):
    model = built(0, tie_word_embeddings=tied)
    fragments = fragments_of_model(model, 4)
    names = [name for fragment in fragments for name in fragment.parameter_names]
    assert sorted(names) == sorted(name for name, _ in model.named_parameters())
    assert len(names) == len(set(names))
    assert fragments[0].parameter_names == ("model.embed_tokens.weight",)
    # a tied head is the embedding's tensor: listed once, merged with it
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert ("lm_head.weight" in names) == (not tied)
    assert sum(f.num_bytes for f in fragments) == 4 * sum(p.numel() for _, p in model.named_parameters())


def test_the_config_may_be_inline_or_a_file_with_overrides(tmp_path, offline):
    settings = json.loads((ROOT / "diloco_cli/models/configs/tiny-llama.json").read_text())
    inline = causal_lm({**settings, "num_hidden_layers": 1, "torch_dtype": "bfloat16"}, vocab_size=300)
    assert inline.config.num_hidden_layers == 1 and inline.lm_head.out_features == 300
    assert next(inline.parameters()).dtype == torch.float32  # training.precision decides, not the config
    path = tmp_path / "config.json"
    path.write_text(json.dumps(settings))
    torch.manual_seed(0)
    from_file = causal_lm(str(path))
    assert all(
        torch.equal(a, b) for a, b in zip(from_file.state_dict().values(), built(0).state_dict().values(), strict=True)
    )


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("builtin:tiny-lama", r"no built-in config 'tiny-lama' \(built in: llama-small, tiny-llama\)"),
        ("no/such/config.json", "no file .*no/such/config.json; give a built-in name"),
        ({"hidden_size": 64}, "needs a model_type"),
        ({"model_type": "lama"}, "knows no model_type 'lama'; did you mean 'llama'"),
    ],
)
def test_config_mistakes_say_what_is_wrong(config, message):
    with pytest.raises(ConfigError, match=message):
        causal_lm(config)


def test_llama_small_recipe_validates_and_its_model_has_109_5m_parameters():
    recipe = load_model(Recipe, ROOT / "recipes" / "llama-small.yaml")
    assert recipe.data.is_tokens and recipe.training.precision == "bf16" and recipe.outer_learning_rate == 0.7
    with torch.device("meta"):  # counts without allocating 440 MB
        model = recipe.model.build()
    assert sum(p.numel() for p in model.parameters()) == LLAMA_SMALL_PARAMETERS
    assert model.config.max_position_embeddings == recipe.data.sequence_length == 1024
    assert len(fragments_of_model(model, recipe.sync.num_fragments)) == 4


# -------------------------------------------------------------------------- the export


def test_hugging_face_export_loads_back_with_transformers(tmp_path, offline):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = perturbed(built(0)), tiny_tokenizer()
    save_hugging_face(model, tmp_path / "hf", tokenizer.to_str())

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    expected, actual = model.state_dict(), loaded.state_dict()
    assert list(actual) == list(expected)
    assert all(torch.equal(actual[name], expected[name]) for name in expected)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    tokens = torch.randint(0, 512, (2, 12))
    assert torch.equal(loaded(tokens).logits, model(tokens).logits)

    text = "hello quick brown tokens"
    assert AutoTokenizer.from_pretrained(tmp_path / "hf")(text).input_ids == tokenizer.encode(text).ids


def test_the_export_prints_nothing_and_generate_with_max_new_tokens_does_not_warn(tmp_path, offline, capfd):
    """``diloco export --format hf`` printed transformers' "Writing model shards" bar, and
    the exported generation config's max_length made every generate(max_new_tokens=...)
    warn that both were set."""
    from transformers import AutoModelForCausalLM

    tokenizer, model = tiny_tokenizer(), perturbed(built(0))
    capfd.readouterr()  # (training the tokenizer prints)
    save_hugging_face(model, tmp_path / "hf", tokenizer.to_str(), tokenizer.token_to_id("<|endoftext|>"))
    assert capfd.readouterr() == ("", "")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    capfd.readouterr()  # (loading draws its own bar)
    model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False)
    assert "max_length" not in capfd.readouterr().err


def test_export_hf_writes_the_global_model_and_the_dataset_tokenizer(tmp_path, offline, monkeypatch):
    index = token_dataset(tmp_path / "dataset", tiny_tokenizer())
    recipe = Recipe.model_validate(
        {
            "model": {"factory": "diloco_cli.models.hf:causal_lm", "kwargs": {"config": TINY}},
            "data": {"source": str(index)},
        }
    )
    spec = resolve_run(recipe, RegionsFile(), "hf-run", tmp_path / "runs")
    global_weights = {name: parameter.detach().clone() for name, parameter in perturbed(built(0)).named_parameters()}
    head = Head(version=3, fragment_versions={}, snapshot_version=0, recent=(), recent_from=0)
    monkeypatch.setattr(
        export, "latest_weights", lambda bucket, secret, fragments, initial=None, shards=1: (global_weights, [head])
    )

    assert [head.version for head in export.export_hugging_face(spec, RunSecret.generate(), tmp_path / "hf")] == [3]
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in (tmp_path / "hf").iterdir()
    }
    from transformers import AutoModelForCausalLM

    loaded = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "hf").named_parameters())
    assert all(torch.equal(loaded[name], tensor) for name, tensor in global_weights.items())


def test_an_exported_model_stops_generating_at_the_end_of_text_and_its_tokenizer_pads(tmp_path, offline, monkeypatch):
    """The dataset's end-of-document token is the exported model's end of text in
    config.json, generation_config.json and tokenizer_config.json (padding with it too),
    its context the tokenizer's longest input, and every file readable as any other."""
    tokenizer = tiny_tokenizer()
    eos = tokenizer.token_to_id("<|endoftext|>")
    index = token_dataset(tmp_path / "dataset", tokenizer)
    recipe = Recipe.model_validate(
        {
            "model": {"factory": "diloco_cli.models.hf:causal_lm", "kwargs": {"config": TINY}},
            "data": {"source": str(index), "sequence_length": 64},
        }
    )
    spec = resolve_run(recipe, RegionsFile(), "hf-run", tmp_path / "runs")
    global_weights = {name: parameter.detach().clone() for name, parameter in perturbed(built(0)).named_parameters()}
    head = Head(version=3, fragment_versions={}, snapshot_version=0, recent=(), recent_from=0)
    monkeypatch.setattr(
        export, "latest_weights", lambda bucket, secret, fragments, initial=None, shards=1: (global_weights, [head])
    )
    export.export_hugging_face(spec, RunSecret.generate(), tmp_path / "hf")

    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    tokenizer_config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert config["eos_token_id"] == generation["eos_token_id"] == eos
    assert config["pad_token_id"] == generation["pad_token_id"] == eos
    assert tokenizer_config["eos_token"] == tokenizer_config["pad_token"] == "<|endoftext|>"
    assert tokenizer_config["model_max_length"] == 256  # tiny-llama's context
    assert "max_length" not in generation  # else generate(max_new_tokens=...) warns that both are set

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    loaded_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    padded = loaded_tokenizer(["hello", "the quick brown fox jumps"], padding=True, return_tensors="pt")
    assert padded.input_ids.shape[0] == 2 and (padded.input_ids[0] == eos).any()
    assert padded.attention_mask[0].sum() < padded.attention_mask[1].sum()

    prompt = loaded_tokenizer("hello world", return_tensors="pt").input_ids
    steps = []

    def end_of_text_on_the_third_token(module, inputs, output):
        steps.append(1)
        if len(steps) == 3:
            output.logits[:, -1, :] = -1e9
            output.logits[:, -1, eos] = 1e9
        return output

    model.register_forward_hook(end_of_text_on_the_third_token)
    generated = model.generate(prompt, max_new_tokens=20, do_sample=False)
    assert generated.shape[1] == prompt.shape[1] + 3 and generated[0, -1] == eos

    umask = os.umask(0)
    os.umask(umask)
    modes = {path.name: path.stat().st_mode & 0o777 for path in (tmp_path / "hf").iterdir()}
    assert modes["model.safetensors"] == 0o666 & ~umask and set(modes.values()) == {0o666 & ~umask}, modes


def test_export_hf_is_refused_for_the_byte_gpt_before_reading_any_weights(tmp_path):
    runs_dir, _ = made_run(tmp_path)  # a run on disk that never published global weights
    result = CliRunner().invoke(
        app, ["export", "made", "--format", "hf", "-o", str(tmp_path / "hf"), "--runs-dir", str(runs_dir)]
    )
    assert result.exit_code == 2
    assert "error: --format hf needs a Hugging Face transformers model" in result.output
    assert "diloco_cli.models.gpt:byte_gpt: export it with --format safetensors" in result.output
    assert not (tmp_path / "hf").exists()


def test_the_tokenizer_comes_from_the_token_dataset_index(tmp_path):
    tokenizer = tiny_tokenizer()
    with_tokenizer = DataConfig(source=str(token_dataset(tmp_path / "a", tokenizer)))
    without = DataConfig(source=str(token_dataset(tmp_path / "b", None)))
    eos = tokenizer.token_to_id("<|endoftext|>")
    assert dataset_tokenizer(with_tokenizer) == (tokenizer.to_str(), eos)
    assert dataset_tokenizer(without) is None and dataset_tokenizer(DataConfig()) is None
    assert sampling_tokenizer(DataConfig()) is None  # text: the model reads bytes
    assert sampling_tokenizer(with_tokenizer).tokenizer.encode("hello").ids == tokenizer.encode("hello").ids
    assert sampling_tokenizer(with_tokenizer).end_of_document == eos
    with pytest.raises(ConfigError, match="names no tokenizer"):
        sampling_tokenizer(without)


# ------------------------------------------------------------------------- the sample


def test_sample_continues_a_prompt_in_tokens_or_bytes(offline):
    tokenizer = SamplingTokenizer(tiny_tokenizer(), None)
    model = perturbed(built(0, vocab_size=tokenizer.tokenizer.get_vocab_size()))
    sample = sample_text(model, "hello world", 8, 0.8, 40, 0, 256, tokenizer)
    assert sample.text.startswith("hello world") and len(sample.text) > len("hello world")
    assert sample.new_tokens == 8 and not sample.ended
    torch.manual_seed(0)
    assert sample_text(byte_gpt().eval(), "ROMEO:", 8, 0.8, 40, 0, 128).text.startswith("ROMEO:")
    with pytest.raises(ConfigError, match="encodes to no tokens"):
        sample_text(built(0), "", 1, 0.8, 40, 0, 256, tokenizer)


def test_sample_stops_at_the_end_of_the_document_unless_told_to_go_on(offline):
    """The model ends a document with the dataset's end-of-document token, as it learned
    to: the sample ends there (without printing the token), as the exported model's
    generate does; --past-end goes on into the next document."""
    tokens_of = SamplingTokenizer(tiny_tokenizer(), tiny_tokenizer().token_to_id("<|endoftext|>"))
    model = perturbed(built(0, vocab_size=tokens_of.tokenizer.get_vocab_size()))
    steps = []

    def end_of_document_on_the_third_token(module, inputs, output):
        steps.append(1)
        if len(steps) == 3:
            output.logits[:, -1, :] = -1e9
            output.logits[:, -1, tokens_of.end_of_document] = 1e9
        return output

    model.register_forward_hook(end_of_document_on_the_third_token)
    stopped = sample_text(model, "hello world", 20, 0.8, 40, 0, 256, tokens_of)
    assert stopped.ended and stopped.new_tokens == 3 and "<|endoftext|>" not in stopped.text
    steps.clear()
    went_on = sample_text(model, "hello world", 20, 0.8, 40, 0, 256, tokens_of, past_end=True)
    assert not went_on.ended and went_on.new_tokens == 20 and "<|endoftext|>" in went_on.text
    assert went_on.text.startswith(stopped.text)  # the same draws up to the end
    assert "--past-end" in CliRunner().invoke(app, ["sample", "--help"]).stdout
