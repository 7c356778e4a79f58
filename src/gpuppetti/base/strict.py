"""The one strict pydantic base, and the one way its errors are told: a key path and what is wrong with it.

The config file and the DRA driver's opaque GpuConfig both use it, so a mistake reads the same wherever it is made.
"""

from __future__ import annotations

import difflib
import reprlib
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic.alias_generators import to_camel


class Strict(BaseModel):
    # Strict types: YAML's `replicas: "4"` is a mistake worth reporting, not something to coerce. Unknown keys are
    # mistakes too (a typo would otherwise silently fall back to a default).
    model_config = ConfigDict(
        extra="forbid", strict=True, frozen=True, alias_generator=to_camel, populate_by_name=False
    )


# What an error may echo of the input: a few items of a few levels, a string's first characters. An input can be
# anything a file held, an alias bomb's expansion included, and a message is one log line.
# (Repr takes its limits as attributes: Python 3.11's takes no arguments.)
_SHORT = reprlib.Repr()
_SHORT.maxlevel = 2
_SHORT.maxtuple = _SHORT.maxlist = _SHORT.maxarray = _SHORT.maxdict = 4
_SHORT.maxset = _SHORT.maxfrozenset = _SHORT.maxdeque = 4
_SHORT.maxstring = _SHORT.maxother = 60
_SHORT.maxlong = 40
SHOWN_CHARS = 200


def shown(value: object) -> str:
    """``repr(value)``, cut to at most SHOWN_CHARS characters whatever ``value`` holds."""
    text = _SHORT.repr(value)
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS - 3]}..."


def key_path(loc: tuple[int | str, ...]) -> str:
    """pydantic's location as the user wrote it: ``sharing.timeSlicing.resources[0].replicas``."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in ("str", "int") or part.startswith(("function-", "literal[")):
            # pydantic names the union branch it tried; the user only cares about the key.
            continue
        else:
            path += f".{part}" if path else part
    return path


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The models an annotation holds, through lists, dicts, unions, optionals and Annotated."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    for argument in typing.get_args(annotation):
        found += _models_in(argument)
    return found


def _keys_at(model: type[BaseModel], loc: tuple[int | str, ...]) -> set[str]:
    """The keys a mapping at ``loc`` (under ``model``) may hold, as the user writes them."""
    models = [model]
    for part in loc:
        if isinstance(part, int) or not models:
            continue
        fields = {(field.alias or name): field for candidate in models
                  for name, field in candidate.model_fields.items()}
        if part in fields:
            models = _models_in(fields[part].annotation)
        # Else a dict's key or a union branch's name: the same models go on.
    return {field.alias or name for candidate in models for name, field in candidate.model_fields.items()
            if not (field.alias or name).startswith("_")}


def describe(error: Any, model: type[BaseModel] | None = None) -> str:
    kind = error["type"]
    if kind == "extra_forbidden":
        loc = tuple(error["loc"])
        if model is not None and loc and isinstance(loc[-1], str):
            close = difflib.get_close_matches(loc[-1], sorted(_keys_at(model, loc[:-1])), n=1, cutoff=0.6)
            if close:
                return f"unknown key; did you mean {close[0]}?"
        return "unknown key"
    if kind == "missing":
        return "required key is missing"
    message = str(error["msg"]).removeprefix("Value error, ")
    if kind not in ("value_error", "assertion_error"):
        message = f"{message[0].lower()}{message[1:]} (got {shown(error['input'])})"
    return message


def problems(exc: ValidationError, model: type[BaseModel] | None = None) -> list[tuple[str, str]]:
    """One (key path, what is wrong) per error; an unknown key of ``model`` names the key that was likely meant."""
    return [(key_path(tuple(error["loc"])), describe(error, model)) for error in exc.errors()]
