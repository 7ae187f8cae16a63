"""How many positions a recipe's model attends to, and how many tokens it knows, found from
the recipe without building it.

A sequence longer than that fails in two ways, both late: a model with learned positions
(GPT-2's ``n_positions``, the built-in GPT's ``context``) raises an index error at its
first forward pass (in the syncer, at its first evaluation), and a model with rotary
positions (Llama's ``max_position_embeddings``) trains silently on positions it was not
made for.  ``diloco up`` checks ``data.sequence_length`` against it before anything starts.
A token dataset with ids beyond the model's vocabulary fails in every learner's first
step (an index error of the embedding); ``diloco up`` checks the index's ``vocab_size``
against the model's vocabulary too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from diloco_cli.models.hf import FACTORY as HF_FACTORY
from diloco_cli.models.hf import config_settings, import_transformers

GPT_FACTORY = "diloco_cli.models.gpt:byte_gpt"
GPT_DEFAULT_CONTEXT = 128
"""The built-in GPT's context when the recipe does not give one (here, so that checking a
recipe never imports torch)."""
GPT_DEFAULT_VOCABULARY = 256
"""The built-in GPT's vocabulary when the recipe does not give one: the byte values."""


@dataclass(frozen=True)
class ModelContext:
    """The longest sequence a model takes, and the setting that says it."""

    positions: int
    setting: str
    """Where to change it, e.g. ``model.kwargs.context`` or ``n_positions of model.kwargs.config``."""


def model_context(factory: str, kwargs: Mapping[str, Any]) -> ModelContext | None:
    """The recipe model's context: a ``transformers`` config's ``max_position_embeddings``
    (``n_positions`` for GPT-2) with the recipe's overrides, the built-in GPT's
    ``context`` (or its default), any other factory's ``context`` keyword; None when
    nothing says (the model takes any length, as far as diloco can tell)."""
    if factory == HF_FACTORY:
        return _hugging_face_context(kwargs)
    context = kwargs.get("context")
    if isinstance(context, int):
        return ModelContext(context, "model.kwargs.context")
    if factory == GPT_FACTORY:
        return ModelContext(GPT_DEFAULT_CONTEXT, "model.kwargs.context (the built-in GPT's default)")
    return None


@dataclass(frozen=True)
class ModelVocabulary:
    """How many token ids a model embeds, and the setting that says it."""

    size: int
    setting: str


def model_vocabulary(factory: str, kwargs: Mapping[str, Any]) -> ModelVocabulary | None:
    """The recipe model's vocabulary: a ``transformers`` config's ``vocab_size`` with the
    recipe's overrides, the built-in GPT's ``vocabulary_size`` (or its default); None
    for any other factory (diloco cannot tell)."""
    if factory == HF_FACTORY:
        found = _hugging_face_setting(kwargs, "vocab_size")
        return None if found is None else ModelVocabulary(*found)
    if factory == GPT_FACTORY:
        size = kwargs.get("vocabulary_size", GPT_DEFAULT_VOCABULARY)
        return ModelVocabulary(size, "model.kwargs.vocabulary_size") if isinstance(size, int) else None
    return None


def _hugging_face_context(kwargs: Mapping[str, Any]) -> ModelContext | None:
    found = _hugging_face_setting(kwargs, "max_position_embeddings")
    return None if found is None else ModelContext(*found)


def _hugging_face_setting(kwargs: Mapping[str, Any], name: str) -> tuple[int, str] | None:
    """A ``transformers`` config's integer setting ``name`` with the recipe's overrides,
    and where the recipe says it (its own key for it: GPT-2's ``n_positions``)."""
    overrides = {key: value for key, value in kwargs.items() if key != "config"}
    settings = {**config_settings(kwargs.get("config", {})), **overrides}
    model_type = settings.pop("model_type", None)
    transformers = import_transformers()
    if model_type not in transformers.CONFIG_MAPPING:
        return None  # building the model reports it
    for dtype_key in ("dtype", "torch_dtype"):
        settings.pop(dtype_key, None)
    config = transformers.AutoConfig.for_model(model_type, **settings)
    value = getattr(config, name, None)
    if not isinstance(value, int):
        return None
    key = config.attribute_map.get(name, name)
    where = "model.kwargs" if key in overrides else "model.kwargs.config"
    return value, f"{key} of {where}"
