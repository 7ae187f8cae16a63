"""Hugging Face ``transformers`` causal language models, built from a config alone.

Recipes name the factory as ``diloco_cli.models.hf:causal_lm``::

    model:
      factory: diloco_cli.models.hf:causal_lm
      kwargs: {config: builtin:llama-small, vocab_size: 50257}

Every learner and the syncer build the model on their own, from the recipe and the
seed, and must agree bit for bit before the first merge.  So the build never reads the
hub (``AutoConfig.for_model`` and ``from_config`` take no name to download), and the
initial weights come from torch's global generator in module order, as with any
``torch.nn.Module``: the same seed gives the same weights on every host.  Weights are
always fp32 whatever ``dtype`` the config names: ``training.precision`` decides the
compute precision, and the outer deltas are taken on fp32 weights.

A tied output head (``tie_word_embeddings``) is the token embedding's tensor, so
``named_parameters`` lists it once, under the embedding's name, and the fragments merge
it with the embedding (:mod:`diloco_cli.core.fragments`).
"""

from __future__ import annotations

import difflib
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diloco_cli.config.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

FACTORY = "diloco_cli.models.hf:causal_lm"
"""The import path recipes give as ``model.factory``."""

BUILTIN_PREFIX = "builtin:"
BUILTIN_CONFIGS = Path(__file__).with_name("configs")
"""``builtin:NAME`` is ``configs/NAME.json`` here."""

INSTALL_HINT = "pip install 'diloco-cli[hf]'"


def causal_lm(config: str | Mapping[str, Any], **overrides: Any) -> PreTrainedModel:
    """A freshly initialised ``AutoModelForCausalLM`` (fp32), built offline.

    ``config`` is ``builtin:NAME`` (see :func:`builtin_config_names`), the path of a
    ``config.json`` (relative to the current directory, which must hold it on every
    host: a built-in name or an inline mapping travels inside the recipe instead), or an
    inline mapping with a ``model_type``.  ``overrides`` replace keys of the config, e.g.
    ``vocab_size`` to match a tokenizer.  Its ``forward(input_ids)`` returns an output
    whose ``.logits`` the training loop reads.
    """
    transformers = import_transformers()
    settings = {**config_settings(config), **overrides}
    model_type = settings.pop("model_type", None)
    if not model_type:
        raise ConfigError(f"model.kwargs.config needs a model_type (e.g. 'llama'), got keys {sorted(settings)}")
    known_types = list(transformers.CONFIG_MAPPING.keys())
    if model_type not in known_types:
        close = difflib.get_close_matches(model_type, known_types, n=3)
        suggestion = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise ConfigError(
            f"model.kwargs.config: transformers {transformers.__version__} "
            f"knows no model_type {model_type!r}{suggestion}"
        )
    for dtype_key in ("dtype", "torch_dtype"):  # fp32 weights; training.precision picks the compute
        settings.pop(dtype_key, None)
    model_config = transformers.AutoConfig.for_model(model_type, **settings)
    return transformers.AutoModelForCausalLM.from_config(model_config)


def config_settings(config: str | Mapping[str, Any]) -> dict[str, Any]:
    """The keys of a model config given as a built-in name, a file path or a mapping."""
    if isinstance(config, Mapping):
        return dict(config)
    if config.startswith(BUILTIN_PREFIX):
        name = config.removeprefix(BUILTIN_PREFIX)
        if name not in builtin_config_names():
            raise ConfigError(
                f"model.kwargs.config: no built-in config {name!r} (built in: {', '.join(builtin_config_names())})"
            )
        path = BUILTIN_CONFIGS / f"{name}.json"
    else:
        path = Path(config)
    try:
        settings = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"model.kwargs.config: no file {path.resolve()}; give a built-in name "
            f"({', '.join(BUILTIN_PREFIX + name for name in builtin_config_names())}) or the config inline"
        ) from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"model.kwargs.config: {path} is not JSON: {error}") from None
    if not isinstance(settings, dict):
        raise ConfigError(f"model.kwargs.config: {path} holds {type(settings).__name__}, not a JSON object")
    return settings


def builtin_config_names() -> list[str]:
    """The names ``builtin:NAME`` can take, sorted."""
    return sorted(path.stem for path in BUILTIN_CONFIGS.glob("*.json"))


def is_hugging_face_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` (so ``save_pretrained``
    writes it).  Never imports transformers: a model it built has imported it."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def import_transformers() -> Any:
    """The transformers package, or an error that says how to install it."""
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"{FACTORY} and `diloco export --format hf` need transformers: {INSTALL_HINT}") from None
    return transformers
