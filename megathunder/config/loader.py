"""Load a YAML config, apply ``dotted.key=value`` overrides, validate, report by dotted path."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from megathunder.config.root import Config, check_paths


class _Loader(yaml.SafeLoader):
    """YAML 1.2's booleans: only true / false. PyYAML follows YAML 1.1, where off, on, yes and no
    are booleans too, so ``sandbox.cgroup: off`` or ``ledger.per_turn_scores=off`` would reach the
    config as False instead of the option's name."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))


def load_yaml(text: str | bytes) -> Any:
    """YAML as configs are read (``_Loader``: YAML 1.2 booleans)."""
    loader = _Loader(text)  # yaml.safe_load's own steps, with _Loader's resolvers
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


class ConfigError(ValueError):
    """A configuration that does not parse or validate; each line names a dotted field."""


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """``["a.b=1", "c=x"]`` -> nested dict; values are parsed as YAML scalars (1, 1e-3, true, null)."""
    tree: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r}: expected dotted.key=value")
        try:
            value = load_yaml(raw) if raw else ""
        except (yaml.YAMLError, RecursionError) as exc:
            raise ConfigError(f"{key}: cannot parse value {raw!r}: {_one_line(exc)}") from None
        node = tree
        parts = key.split(".")
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{'.'.join(parts[: depth + 1])}: is a value, not a section")
            node = child
        node[parts[-1]] = value
    return tree


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _show(part: Any) -> str:
    """A location part as text; a key that is empty, padded or holds control characters (a line
    break would split the message) is quoted."""
    text = str(part)
    return text if text and text.isprintable() and text.strip() == text else repr(text)


def _field_path(loc: tuple) -> tuple[list, str | None]:
    """``loc`` without the tags pydantic inserts after a discriminated union (``sandbox.docker.cli``
    is ``sandbox.cli`` to a person: the tag is the value of ``sandbox.backend``), and the innermost
    union choice it passed (``sandbox.backend=docker``), if any."""
    out: list = []
    choice = None
    model: Any = Config
    parts = list(loc)
    while parts:
        part = parts.pop(0)
        out.append(part)
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            model = None
            continue
        annotation = field.annotation
        if field.discriminator and parts:
            tag = parts.pop(0)
            choice = ".".join(str(p) for p in out + [field.discriminator]) + f"={tag}"
            model = next((m for m in get_args(annotation) if tag in get_args(m.model_fields[field.discriminator].annotation)), None)
            continue
        while get_origin(annotation) is not None and type(None) in get_args(annotation):  # X | None
            annotation = next(a for a in get_args(annotation) if a is not type(None))
        model = annotation
    return out, choice


def _format(err: ValidationError) -> str:
    """One line per error, each starting with the dotted path of the field at fault.

    Cross-field validators (``model_validator``) report at their section's location and start
    their message with the name of the field they blame, relative to that section.
    """
    lines = []
    for e in err.errors():
        path, choice = _field_path(tuple(e["loc"]))
        loc = ".".join(_show(p) for p in path)
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden" and choice is not None:
            msg = f"not a field of {choice}"
        elif e["type"] in ("union_tag_invalid", "union_tag_not_found"):
            ctx = e.get("ctx", {})
            key = str(ctx.get("discriminator", "")).strip("'")
            path, loc = path + [key], ".".join(_show(p) for p in path + [key])
            msg = (f"{ctx.get('tag')!r} is not one of {ctx.get('expected_tags')}" if e["type"] == "union_tag_invalid"
                   else f"required (one of {ctx.get('expected_tags', 'the kinds')})")
        names_field = e["type"] == "value_error" and ": " in msg
        if not loc:
            lines.append(msg)
        elif names_field:
            lines.append(f"{loc}.{msg}")
        else:
            lines.append(f"{loc}: {msg}")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (), *, paths: bool = False) -> Config:
    """The validated config of ``path`` (YAML) with ``overrides`` applied. ``paths``: also check that
    the files it names exist (``check_paths``), for commands that read them."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            loaded = load_yaml(path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        except (yaml.YAMLError, RecursionError) as exc:
            raise ConfigError(f"{path}: not valid YAML: {_one_line(exc)}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections")
        data = loaded or {}
    data = _merge(data, parse_overrides(overrides))
    try:
        cfg = Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format(err)) from None
    if paths:
        try:
            check_paths(cfg)
        except ValueError as err:
            raise ConfigError(f"invalid configuration:\n  {err}") from None
    return cfg
