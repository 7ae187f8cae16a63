"""The global model of a run as a ``torch.nn.Module``: for export and for sampling.

Two export formats: ``safetensors`` (the ``state_dict`` of any recipe model, loaded back
into the recipe's model) and ``hf`` (a Hugging Face directory that
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load,
for models built by :mod:`diloco_cli.models.hf`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from diloco_cli.codec import RunSecret
from diloco_cli.config.errors import ConfigError
from diloco_cli.config.recipe import DataConfig
from diloco_cli.core.fragments import fragments_of_model
from diloco_cli.models.hf import FACTORY, import_transformers, is_hugging_face_model
from diloco_cli.runtime.global_weights import latest_weights
from diloco_cli.store.documents import Head
from diloco_cli.store.run_spec import RunSpec


def seeded_model(spec: RunSpec) -> torch.nn.Module:
    """The recipe's model built from its seed: its weights are version 0, as the syncer's."""
    torch.manual_seed(spec.recipe.training.seed)
    return spec.recipe.model.build()


def global_model(spec: RunSpec, secret: RunSecret, region: str | None = None) -> tuple[torch.nn.Module, list[Head]]:
    """The recipe's model holding the newest global weights, read from one region."""
    model = seeded_model(spec)
    heads = load_global_weights(model, spec, secret, region)
    return model, heads


def load_global_weights(
    model: torch.nn.Module, spec: RunSpec, secret: RunSecret, region: str | None = None
) -> list[Head]:
    """Copy the newest global weights, read from one region, into a freshly built
    recipe model (from the recipe's seed: its weights are then version 0, which saves
    reading a snapshot while the head still lists every update) and put it in eval mode;
    returns the heads they were read at (one per syncer shard)."""
    bucket = spec.bucket(region or spec.regions[0].name, secret)
    fragments = fragments_of_model(model, spec.recipe.sync.num_fragments)
    initial = {
        name: parameter.detach().to("cpu", torch.float32).clone() for name, parameter in model.named_parameters()
    }
    parameters, heads = latest_weights(bucket, secret, fragments, initial, len(spec.syncer_shards))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.copy_(parameters[name])
    model.eval()
    return heads


def versions_label(heads: list[Head]) -> str:
    """``version 12``, or with syncer shards ``versions 12, 11 (one per syncer shard)``:
    each shard numbers its own versions."""
    if len(heads) == 1:
        return f"version {heads[0].version}"
    return f"versions {', '.join(str(head.version) for head in heads)} (one per syncer shard)"


def export_safetensors(spec: RunSpec, secret: RunSecret, output: Path, region: str | None = None) -> list[Head]:
    """Write the global model's ``state_dict`` (every key, tied ones included, so that
    ``model.load_state_dict(safetensors.torch.load_file(path))`` works as is)."""
    model, heads = global_model(spec, secret, region)
    tensors = {name: tensor.detach().clone().contiguous() for name, tensor in model.state_dict().items()}
    metadata = {
        "run": spec.run,
        "version": ",".join(str(head.version) for head in heads),
        "model_factory": spec.recipe.model.factory,
        "model_kwargs": json.dumps(spec.recipe.model.kwargs),
        "format": "pt",
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(output), metadata=metadata)
    return heads


def export_hugging_face(spec: RunSpec, secret: RunSecret, output: Path, region: str | None = None) -> list[Head]:
    """Write the global model as a Hugging Face directory, with the tokenizer the run's
    token dataset names, if any (see :func:`save_hugging_face`).

    The model's kind and the tokenizer are checked before the weights are read, so a
    wrong format fails at once, even for a run that has published nothing yet.
    """
    model = seeded_model(spec)
    require_hugging_face(model, spec.recipe.model.factory)
    tokenizer = dataset_tokenizer(spec.recipe.data)
    heads = load_global_weights(model, spec, secret, region)
    save_hugging_face(model, output, *(tokenizer or (None, None)))
    return heads


def require_hugging_face(model: torch.nn.Module, factory: str) -> None:
    """Refuse ``--format hf`` for a model ``save_pretrained`` cannot write."""
    if not is_hugging_face_model(model):
        raise ConfigError(
            f"--format hf needs a Hugging Face transformers model (model.factory {FACTORY}), but this run "
            f"trains {factory}: export it with --format safetensors"
        )


def save_hugging_face(
    model: torch.nn.Module, directory: Path, tokenizer_json: str | None, eos_token_id: int | None = None
) -> None:
    """Write ``config.json``, ``generation_config.json`` and ``model.safetensors``
    (``save_pretrained``: a tied head is stored once and tied again on load) and, given a
    ``tokenizer.json`` text, the tokenizer as a ``PreTrainedTokenizerFast``, so that
    ``from_pretrained(directory)`` of ``AutoModelForCausalLM`` and ``AutoTokenizer`` both
    load it.

    ``eos_token_id`` is the token that ended every training document (the dataset's):
    it goes into all three files with the beginning and padding tokens
    (:func:`special_token_ids`), and the model's context is the tokenizer's longest
    input, so that ``generate`` stops at the end of a text and the tokenizer pads.  The
    generation config sets no ``max_length``: ``generate(max_new_tokens=...)`` would warn
    that both are set.  Every file gets the permissions of any file this process creates
    (``save_pretrained`` writes the weights readable by their owner alone); no progress
    bar is drawn (it would land in the command's output)."""
    transformers = import_transformers()
    special = special_token_ids(model.config, eos_token_id)
    context = getattr(model.config, "max_position_embeddings", None)
    for settings in (model.config, model.generation_config):
        for key, value in special.items():
            setattr(settings, key, value)
    directory.mkdir(parents=True, exist_ok=True)
    with progress_bars_off(transformers):
        model.save_pretrained(directory)
    if tokenizer_json is not None:
        tokenizer_object = Tokenizer.from_str(tokenizer_json)
        tokens = {
            key.removesuffix("_id"): tokenizer_object.id_to_token(value)
            for key, value in special.items()
            if value is not None
        }
        tokenizer = transformers.PreTrainedTokenizerFast(
            tokenizer_object=tokenizer_object, model_max_length=context, **tokens
        )
        tokenizer.save_pretrained(directory)
    umask = os.umask(0)
    os.umask(umask)
    for path in directory.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~umask)


@contextmanager
def progress_bars_off(transformers: Any) -> Iterator[None]:
    """transformers' progress bars off for a while (``save_pretrained`` draws one on
    stderr), and as they were after."""
    logging = transformers.utils.logging
    was_enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            logging.enable_progress_bar()


def special_token_ids(config: Any, eos_token_id: int | None) -> dict[str, int | None]:
    """``bos_token_id``, ``eos_token_id`` and ``pad_token_id`` for an exported model: the
    dataset's end-of-document token (else the config's), the config's beginning token,
    and the config's padding token, else the end-of-text one (as GPT-2 and Llama
    tokenizers are usually padded)."""
    eos = eos_token_id if eos_token_id is not None else getattr(config, "eos_token_id", None)
    pad = getattr(config, "pad_token_id", None)
    return {
        "bos_token_id": getattr(config, "bos_token_id", None),
        "eos_token_id": eos,
        "pad_token_id": pad if pad is not None else eos,
    }


def dataset_tokenizer(data: DataConfig) -> tuple[str, int | None] | None:
    """The ``tokenizer.json`` text that a token dataset's index names (verified against
    the index's hash) with the index's end-of-document token, or None for text data or an
    index that names no tokenizer."""
    if not data.is_tokens:
        return None
    from diloco_cli.data.tokens.index import UNKNOWN_TOKENIZER, DatasetError
    from diloco_cli.data.tokens.storage import Location, read_index

    location = Location.of_index(data.source, data.storage_options)
    index = read_index(location)
    if not index.tokenizer:
        return None
    filesystem, root = location.open()
    content = filesystem.cat_file(f"{root}/{index.tokenizer}")
    if index.tokenizer_sha256 != UNKNOWN_TOKENIZER and hashlib.sha256(content).hexdigest() != index.tokenizer_sha256:
        raise DatasetError(
            f"{location.url}/{index.tokenizer} does not match the tokenizer_sha256 of {location.index_url}; "
            "prepare the dataset again"
        )
    return content.decode("utf-8"), index.eos_token_id


@dataclass(frozen=True)
class SamplingTokenizer:
    """The run's tokens: the dataset's tokenizer and its end-of-document token."""

    tokenizer: Tokenizer
    end_of_document: int | None
    """The token after every training document (None when the index does not say)."""


@dataclass(frozen=True)
class Sample:
    """A continuation, and whether it stopped at the end of a document."""

    text: str
    ended: bool
    """The model ended the document (its end-of-document token, not printed) before the
    tokens asked for."""
    new_tokens: int
    """Tokens generated, the end-of-document token included."""


def sampling_tokenizer(data: DataConfig) -> SamplingTokenizer | None:
    """The tokenizer that turns a prompt into the run's tokens: None for text data (the
    model reads bytes), the dataset's tokenizer for a token dataset."""
    if not data.is_tokens:
        return None
    tokenizer = dataset_tokenizer(data)
    if tokenizer is None:
        raise ConfigError(
            f"the token dataset {data.source} names no tokenizer, so a prompt cannot be turned into its tokens"
        )
    return SamplingTokenizer(Tokenizer.from_str(tokenizer[0]), tokenizer[1])


@torch.no_grad()
def sample_text(
    model: torch.nn.Module,
    prompt: str,
    new_tokens: int,
    temperature: float,
    top_k: int | None,
    seed: int,
    context: int,
    tokens_of: SamplingTokenizer | None = None,
    past_end: bool = False,
) -> Sample:
    """Continue ``prompt`` one token at a time, seeing at most the last ``context`` tokens
    (the sequence length the model was trained on): tokens of ``tokens_of`` when given,
    else bytes.  The model may return logits or an output with ``.logits``.  It stops
    where the model ends the document (the dataset's end-of-document token, which is
    not printed) unless ``past_end``, which goes on into a next document."""
    generator = torch.Generator().manual_seed(seed)
    tokenizer = None if tokens_of is None else tokens_of.tokenizer
    stop = None if tokens_of is None or past_end else tokens_of.end_of_document
    if tokenizer is None:
        prompt_tokens = list(prompt.encode("utf-8")) or [10]
    else:
        prompt_tokens = tokenizer.encode(prompt).ids
        if not prompt_tokens:
            raise ConfigError(f"the prompt {prompt!r} encodes to no tokens; give some text")
    tokens = torch.tensor([prompt_tokens], dtype=torch.long)
    ended = False
    for _ in range(new_tokens):
        output = model(tokens[:, -context:])
        logits = getattr(output, "logits", output)[0, -1].float()
        if temperature <= 0:
            next_token = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k:
                threshold = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < threshold, float("-inf"))
            next_token = int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))
        if next_token == stop:
            ended = True
            break
        tokens = torch.cat([tokens, torch.tensor([[next_token]])], dim=1)
    if tokenizer is None:
        text = bytes(tokens[0].tolist()).decode("utf-8", errors="replace")
    else:
        text = tokenizer.decode(tokens[0].tolist(), skip_special_tokens=False)
    return Sample(text, ended, tokens.shape[1] - len(prompt_tokens) + ended)
