"""Reading YAML into typed config, with errors that name the file, the key and the fix."""

from __future__ import annotations

import copy
import difflib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ValidationError

from diloco_cli.config.errors import ConfigError

if TYPE_CHECKING:  # yaml is imported where a file or a --set value is read: `diloco status` reads none
    import yaml

Model = TypeVar("Model", bound=BaseModel)


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model an annotation holds (directly, in a list, or optional)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for argument in typing.get_args(annotation):
        if (found := _model_in(argument)) is not None:
            return found
    return None


def _allowed_keys(model: type[BaseModel], location: Sequence[Any]) -> list[str]:
    """The field names allowed at ``location`` (the path of keys, and list indices,
    into the model)."""
    current: type[BaseModel] | None = model
    for key in location[:-1]:
        if isinstance(key, int):  # an index into a list: the list's items are the model
            continue
        field = current.model_fields.get(key) if current else None
        current = _model_in(field.annotation) if field else None
    return sorted(current.model_fields) if current else []


def _union_branch(model: type[BaseModel], location: Sequence[Any]) -> bool:
    """Whether the last part of ``location`` names a branch of a union-typed field (pydantic
    reports each branch's complaint under it), not a key."""
    if len(location) < 2 or not isinstance(location[-1], str):
        return False
    current: type[BaseModel] | None = model
    field = None
    for key in location[:-1]:
        if isinstance(key, int):
            continue
        field = current.model_fields.get(key) if current else None
        current = _model_in(field.annotation) if field else None
    if field is None or current is not None:
        return False
    return typing.get_origin(field.annotation) in (typing.Union, types.UnionType)


RETIRED_KEYS = {
    "sync.reducers": "every region has a reducer now (under K < M it relays each send for the syncer "
    "to anchor, with no loss against reading the payloads directly): remove the key",
    "training.learner_speeds": "slowed learners are a chaos event now: remove the key and start the run "
    "with `diloco up --chaos slow-learner=ID:SPEED` (one item per learner, e.g. slow-learner=local-b-0:0.6)",
    "sync.delete_consumed_payloads": "consumed payloads are always deleted: remove the key; to keep them "
    "(to audit a run), start it with `diloco up --chaos keep-payloads`",
}
"""Keys a recipe may still carry from an older version: what became of them."""


def describe_validation_error(error: ValidationError, model: type[BaseModel], source: str) -> str:
    """One line per problem: ``source: key.path: what is wrong``.  A value that fits
    none of a key's kinds (``auto`` or a number) is one problem: ``... or ...``."""
    lines: list[str] = []
    alternatives: dict[str, int] = {}  # key -> its line, for a union's other branches
    for problem in error.errors():
        location = list(problem["loc"])
        if problem["type"] != "extra_forbidden" and _union_branch(model, location):
            location = location[:-1]  # a union's branch ('float', "literal['auto']"), not a key
        key = ".".join(str(part) for part in location) or "(top level)"
        if key in alternatives:
            other = problem["msg"].removeprefix("Input should be ")
            lines[alternatives[key]] = lines[alternatives[key]].replace(" (got", f" or {other} (got", 1)
            continue
        if problem["type"] == "extra_forbidden" and key in RETIRED_KEYS:
            lines.append(f"{source}: '{key}' is no longer a setting: {RETIRED_KEYS[key]}")
        elif problem["type"] == "extra_forbidden":
            allowed = _allowed_keys(model, location)
            close = difflib.get_close_matches(str(location[-1]), allowed, n=1)
            hint = f" (allowed here: {', '.join(allowed)})" if allowed else ""
            guess = f"; did you mean '{close[0]}'?" if close else ""
            lines.append(f"{source}: unknown key '{key}'{hint}{guess}")
        elif problem["type"] == "missing":
            lines.append(f"{source}: missing key '{key}'")
        else:
            got = problem.get("input")
            shown = f" (got {got!r})" if got is not None and not isinstance(got, dict | list) else ""
            alternatives[key] = len(lines)
            lines.append(f"{source}: {key}: {problem['msg']}{shown}")
    return "\n".join(lines)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b=value`` into (["a", "b"], value parsed as YAML)."""
    key, separator, raw = text.partition("=")
    if not separator or not key.strip():
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE, e.g. --set training.inner_steps=200")
    import yaml

    return key.strip().split("."), yaml.safe_load(raw)


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Set each ``key.path=value`` into a nested dict (a copy)."""
    result = copy.deepcopy(data)
    for override in overrides:
        path, value = parse_override(override)
        node = result
        for key in path[:-1]:
            child = node.get(key)
            if not isinstance(child, dict):
                child = node[key] = {}
            node = child
        node[path[-1]] = value
    return result


def deep_merged(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``override``'s values in place (nested dicts merged key by key; a copy)."""
    result = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = deep_merged(result[key], value)
        else:
            result[key] = value
    return result


def yaml_problem(error: yaml.YAMLError) -> str:
    """`` at line 3, column 16: expected ',' or ']' (in a flow sequence from line 3)``: a
    YAML error where it is, in one line."""
    mark = getattr(error, "problem_mark", None)
    problem = " ".join(str(getattr(error, "problem", None) or error).split())
    if mark is None:
        return f": {problem}"
    where = f" at line {mark.line + 1}, column {mark.column + 1}: {problem}"
    context, context_mark = getattr(error, "context", None), getattr(error, "context_mark", None)
    if context and context_mark is not None and context_mark.line != mark.line:
        where += f" ({context.removeprefix('while ')} from line {context_mark.line + 1})"
    return where


def look_alike(data: dict[str, Any], model: type[BaseModel], look_alikes: Mapping[type[BaseModel], str]) -> str | None:
    """What the document is instead, when its top-level keys are none of ``model``'s
    own but all of another's (a region file given as a recipe)."""
    keys = set(data)
    if not keys or keys & set(model.model_fields):
        return None
    return next((what for other, what in look_alikes.items() if keys <= set(other.model_fields)), None)


def read_yaml(path: Path) -> dict[str, Any]:
    import yaml

    try:
        with path.open() as handle:  # a named stream: YAML errors then name the file
            data = yaml.safe_load(handle)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML{yaml_problem(error)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, not {type(data).__name__}")
    return data


def load_model(
    model: type[Model],
    path: Path | None,
    overrides: Sequence[str] = (),
    default_name: str = "defaults",
    look_alikes: Mapping[type[BaseModel], str] | None = None,
) -> Model:
    """Validate a YAML file (or the defaults when ``path`` is None) plus overrides.
    ``look_alikes``: other kinds of file a user may give here by mistake, each with what
    to say (``a region file, not a recipe: give it with --regions``)."""
    data = read_yaml(path) if path is not None else {}
    if path is not None and (mistaken := look_alike(data, model, look_alikes or {})):
        raise ConfigError(f"{path} (keys: {', '.join(data)}) looks like {mistaken}")
    data = apply_overrides(data, overrides)
    source = str(path) if path is not None else default_name
    if overrides:
        source += " with --set " + " ".join(overrides)
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise ConfigError(describe_validation_error(error, model, source)) from None
