"""Config dataclasses <-> command-line flags <-> YAML (re-exported by :mod:`peftlab.config`). A field's ``--help``
is the docstring under it, read by docstring_parser (as jsonargparse and litgpt read it); a value is typed and
checked by its declaration where it enters (:func:`coerce`): a flag, a ``--config`` file, a sweep or tune spec.

Why not jsonargparse's parser (4.53.0): it has no ``parse_known_args`` (``peftlab train`` is a subcommand of a
plain argparse parser); it names options after the attributes only (``--lr-ratio 3``: "unrecognized arguments";
a bare ``--overwrite``: "expected one argument"); its errors span several lines; and it rejects spellings peftlab
has always accepted (``q,k,v`` for a tuple, ``8.0`` for an int).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

import docstring_parser
import yaml

from peftlab.config_roles import (checked_value, choices_of, flat_dict, from_flat, group_items, hints, kind_of,
                                  option_defaults, option_groups, option_names, option_spec, optional, options)
from peftlab.errors import PeftlabError, closest

# --------------------------------------------------------------------------- schema


@functools.lru_cache(maxsize=None)
def _own_docs(cls) -> dict[str, str]:
    """The string literal under each field of ``cls`` and of its dataclass bases (the litgpt convention)."""
    docs: dict[str, str] = {}
    for klass in filter(dataclasses.is_dataclass, reversed(cls.__mro__)):
        docs.update({p.arg_name: " ".join(p.description.split())
                     for p in docstring_parser.parse_from_object(klass).params if p.description})
    return docs


def field_docs(cls) -> dict[str, str]:
    """The docstring under each option of ``cls``, by flat name."""
    return {flat: _own_docs(o.owner)[o.name] for flat, o in options(cls).items() if o.name in _own_docs(o.owner)}


@functools.lru_cache(maxsize=None)
def field_types(cls) -> dict[str, Any]:
    """Each option's resolved type hint, by flat name."""
    return {flat: hints(o.owner)[o.name] for flat, o in options(cls).items()}


# --------------------------------------------------------------------------- argparse flags


def _section(cls, where) -> str:
    """The ``--help`` section of an option: its declaration's ``section``, else its group's field name (``kasa``,
    ``optim``), else the ``SECTION`` of the dataclass that declares it; titled by ``cls.SECTIONS``."""
    spec = where.owner.__dataclass_fields__[where.name]
    declaring = where.owner if where.group else next(
        k for k in reversed(cls.__mro__) if where.name in k.__dict__.get("__annotations__", {}))
    key = spec.metadata.get("section") or where.group or getattr(declaring, "SECTION", None)
    titles = getattr(cls, "SECTIONS", {})
    return titles.get(key) or (declaring.__doc__ or declaring.__name__).strip().splitlines()[0]


def _flag_type(cls, name: str) -> Callable[[str], Any]:
    """argparse ``type=`` of option ``name`` on another subcommand's parser: :func:`coerce`."""
    def typed(text: str) -> Any:
        try:
            return coerce(cls, name, text)
        except PeftlabError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    typed.__name__ = name  # argparse names the type in its "invalid <type> value" fallback
    return typed


def add_dataclass_flags(parser: argparse.ArgumentParser, cls, *, only: tuple[str, ...] | None = None,
                        defaults: Mapping[str, Any] | None = None) -> None:
    """One kebab-case flag per option (``--kasa-beta`` for ``cls.kasa.beta``), its help its docstring, in
    ``--help`` sections that say where they apply. ``peftlab train`` (``only`` None): every option, default None
    (only the flags given override YAML), text for :func:`build_config` to type. Another subcommand (``only``,
    its own ``defaults``): those flags, each typed and checked by its declaration while parsing (:func:`coerce`)."""
    docs, types_, declared = field_docs(cls), field_types(cls), option_defaults(cls)
    names = [n for n in options(cls) if only is None or n in only]
    unknown = set(only or ()) - set(names)
    if unknown:
        raise TypeError(f"{cls.__name__} has no option {', '.join(sorted(unknown))}")
    titles = {name: _section(cls, options(cls)[name]) for name in names}
    order = list(getattr(cls, "SECTIONS", {}).values())
    sections = {t: parser.add_argument_group(t) for t in sorted(set(titles.values()), key=lambda t: (
        order.index(t) if t in order else len(order), list(titles.values()).index(t)))}
    for name in names:
        default = (defaults or {}).get(name, declared.get(name))
        shown = ",".join(default) if isinstance(default, tuple) else default
        help_text = (docs.get(name, "") + (f" (default: {shown})" if shown is not None else "")).replace("%", "%%")
        flag, group, value = "--" + name.replace("_", "-"), sections[titles[name]], None if only is None else default
        if kind_of(types_[name]) is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=value, help=help_text)
            continue
        choices = choices_of(types_[name])
        metavar = "{" + ",".join(map(str, choices)) + "}" if choices else name.upper()
        # no argparse `choices=`: a wrong value is the declaration's one line with a suggestion, not a usage dump
        group.add_argument(flag, type=str if only is None else _flag_type(cls, name), default=value,
                           metavar=metavar, help=help_text, dest=name)


# --------------------------------------------------------------------------- values


BOOL_WORDS = {"true": True, "yes": True, "on": True, "false": False, "no": False, "off": False}
NULL_WORDS = ("null", "none", "~")


def spelled(hint, value):
    """A value as a flag or YAML spells it, in the field's type where it has one (``"8"``, ``"1e-4"``, ``"yes"``,
    ``"null"``; YAML's ``8`` for a float, ``8.0`` for an int, as pandas reads an int column with gaps); anything
    else as given, for :func:`~peftlab.config_roles.checked_value` to refuse. Text stays text (``~`` too)."""
    kind, text = kind_of(hint), value.strip().lower() if isinstance(value, str) else None
    if text in NULL_WORDS and optional(hint) and kind is not str:
        return None
    if kind is bool and text in BOOL_WORDS:
        return BOOL_WORDS[text]
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if kind in (int, float) and text is not None:
        with contextlib.suppress(ValueError):
            return kind(value)  # float("nan") too: then refused as not finite
    return float(value) if kind is float and isinstance(value, int) and not isinstance(value, bool) else value


def coerce(cls, name: str, value: Any, where: str | None = None) -> Any:
    """Option ``name`` of ``cls`` (flat: ``kasa_beta``) as a flag, YAML file or spec gives it, typed
    (:func:`spelled`) and checked by its declaration; a bad value is one line naming the flag (and ``where``)."""
    if value is None:
        return None
    spec, hint = option_spec(cls, name), field_types(cls)[name]
    try:
        return checked_value(hint, spec.metadata, spelled(hint, value), "--" + name.replace("_", "-"), spec.default)
    except PeftlabError as err:
        where = ", ".join(w for w in (err.where, where) if w) or None  # the flag a choice's noun hides, the source
        raise PeftlabError(err.what, where=where, fix=err.fix) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (``safe_load`` keeps the last one)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep) if key_node.tag != "tag:yaml.org,2002:merge" else None
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key '{key}' is given twice (first on line "
                                                        f"{seen[key] + 1})", key_node.start_mark)
            seen.setdefault(key, key_node.start_mark.line)
        return super().construct_mapping(node, deep)


def load_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """A YAML mapping; anything else (unreadable, not UTF-8, bad syntax, a key twice) is one line naming the file
    and the line."""
    path = Path(path)
    if not path.is_file():
        raise PeftlabError(f"config file not found: {path}", fix="check the --config path")
    try:
        raw = path.read_bytes()
        data = yaml.load(raw.decode("utf-8"), Loader=_UniqueKeyLoader) or {}  # noqa: S506 - a SafeLoader
    except OSError as err:
        raise PeftlabError(f"cannot read {path}: {err.strerror or err}", fix="check the file's permissions") from None
    except UnicodeDecodeError as err:
        line = raw[:err.start].count(b"\n") + 1
        raise PeftlabError(f"not UTF-8 text (byte 0x{raw[err.start]:02x})", where=f"{path}:{line}",
                           fix="save the file as UTF-8") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise PeftlabError(f"invalid YAML: {getattr(err, 'problem', err)}", where=where,
                           fix="correct that line (indent with spaces, not tabs; quote a value holding ': ' or "
                               "'#'; give each key once)") from None
    if not isinstance(data, dict):
        raise PeftlabError("a config file must be a mapping of keys to values", where=str(path),
                           fix="write one 'key: value' per line")
    return data


def normalise_keys(cls, data: dict[str, Any], where: str) -> dict[str, Any]:
    """Keys with dashes or underscores (``lr-ratio`` = ``lr_ratio``) -> checked values (:func:`coerce`), by flat
    name; a prefixed group may nest (``kasa: {beta: 0.01}``). An option given twice, or an unknown key (the
    closest named), is one line."""
    names = option_names(cls)
    nested = {name: group for name, group in option_groups(cls).items() if group.PREFIX}
    out: dict[str, Any] = {}
    given_as: dict[str, str] = {}

    def put(name: str, value: Any, spelling: str) -> None:
        if name in out:
            raise PeftlabError(f"config key '{name}' is given twice, as '{given_as[name]}' and as '{spelling}'",
                               where=where, fix="keep one of them")
        out[name], given_as[name] = coerce(cls, name, value, where), spelling

    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name in nested:  # `kasa:` with nothing under it sets nothing; an instance gives all its options
            given = dataclasses.asdict(value) if isinstance(value, nested[name]) else value
            for sub, sub_value in (group_items(nested[name], name, given, where) if given is not None else {}).items():
                put(f"{name}_{sub}", sub_value, f"{key}: {{{sub}: ...}}")
        elif name in names:
            put(name, value, str(key))
        else:
            raise PeftlabError(f"unknown config key '{key}'{closest(name, names)}", where=where,
                               fix="remove it or use a key from `peftlab train --help`")
    return out


def build_config(cls, *, yaml_path: str | None = None, overrides: dict[str, Any] | None = None,
                 flag_values: dict[str, Any] | None = None,
                 check_explicit: Callable[[Any, set[str]], None] | None = None):
    """defaults < YAML file < ``overrides`` (e.g. a sweep cell) < command-line flags, each value through
    :func:`coerce`; ``check_explicit(cfg, names)`` gets the options the YAML or a flag set. Unresolved."""
    values: dict[str, Any] = {}
    explicit: set[str] = set()
    if yaml_path:
        from_yaml = normalise_keys(cls, load_yaml(yaml_path), str(yaml_path))
        values.update(from_yaml)
        explicit.update(k for k, v in from_yaml.items() if v is not None)
    if overrides:
        values.update(normalise_keys(cls, overrides, "sweep spec"))
    for name, value in (flag_values or {}).items():
        if value is not None:
            values[name] = coerce(cls, name, value)  # the message names the flag
            explicit.add(name)
    cfg = from_flat(cls, values)
    if check_explicit is not None:
        check_explicit(cfg, explicit)
    return cfg


def config_yaml(cfg) -> str:
    """What ``config.yaml`` holds and ``peftlab train --print-config`` prints."""
    return yaml.safe_dump(flat_dict(cfg), sort_keys=False)


def save_config(cfg, path: str | Path) -> None:
    Path(path).write_text(config_yaml(cfg))
