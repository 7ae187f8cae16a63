"""How many positions a recipe's model attends to, found from the recipe without building it.

A sequence longer than that fails in two ways, both late: a model with learned positions
(GPT-2's ``n_positions``, the built-in GPT's ``context``) raises an index error at its
first forward pass (in the syncer, at its first evaluation), and a model with rotary
positions (Llama's ``max_position_embeddings``) trains silently on positions it was not
made for.  ``diloco up`` checks ``data.sequence_length`` against it before anything starts.
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


def _hugging_face_context(kwargs: Mapping[str, Any]) -> ModelContext | None:
    overrides = {key: value for key, value in kwargs.items() if key != "config"}
    settings = {**config_settings(kwargs.get("config", {})), **overrides}
    model_type = settings.pop("model_type", None)
    transformers = import_transformers()
    if model_type not in transformers.CONFIG_MAPPING:
        return None  # building the model reports it
    for dtype_key in ("dtype", "torch_dtype"):
        settings.pop(dtype_key, None)
    config = transformers.AutoConfig.for_model(model_type, **settings)
    positions = getattr(config, "max_position_embeddings", None)
    if not isinstance(positions, int):
        return None
    key = config.attribute_map.get("max_position_embeddings", "max_position_embeddings")
    where = "model.kwargs" if key in overrides else "model.kwargs.config"
    return ModelContext(positions, f"{key} of {where}")
