"""Config dataclasses <-> command-line flags <-> YAML, on jsonargparse (re-exported by :mod:`peftlab.config`).

jsonargparse (as in litgpt) reads the schema from the dataclasses themselves: each field's ``--help`` text is the
docstring under it (``docstring_parse_attribute_docstrings``, through docstring-parser), and it turns a flag's or
a YAML file's value into the field's type (``int``, ``float``, ``bool``, ``X | None``: ``"1e-4"``, ``"yes"``,
``"null"``). What a value may be beyond its type (a choice, a range, a pattern) is the field's declaration
(:mod:`peftlab.config_roles`), checked when the config is built: here every value is only typed, so a value out
of range is refused by the same line whether it came from a flag, a YAML file, a sweep or tune spec or Python.
Precedence: defaults < ``--config`` YAML < ``overrides`` < flags; every bad input is a one-line
:class:`~peftlab.errors.PeftlabError` naming the key or flag.

What stays hand-written, and why (measured with jsonargparse 4.53.0):

- The flags are argparse's: ``peftlab train`` is a subcommand of the plain argparse parser of
  :mod:`peftlab.cli.main` (a jsonargparse parser cannot hang there: it has no ``parse_known_args``), and
  jsonargparse names its options after the attributes only (``--lr-ratio 3``: "unrecognized arguments"; a bare
  ``--overwrite``: "expected one argument"). So :func:`add_dataclass_flags` keeps the dashed flags and
  ``--x/--no-x`` switches (``Literal`` choices shown as ``{a,b}``) and passes the raw strings on.
- Its errors are several lines ('Parser key "rank":\\n  Expected a <class 'int'>...', unknown keys without a
  suggestion), so the messages are ours, with ``errors.closest``.
- :func:`_peftlab_spelling` keeps the spellings peftlab has always accepted that jsonargparse rejects: ``q,k,v``
  for a tuple, ``8.0`` for an int, a YAML number for a text option, Python's ``nan``/``inf`` for a float (then
  refused by the declaration's "finite"); text and choices keep their text as given (jsonargparse reads ``~``,
  ``null`` or ``#x`` given to a ``str | None`` as null).
- Option groups (``MethodConfig.kasa``, ``TrainConfig.optim``) are nested in Python only: every other spelling
  is flat (``--kasa-beta``, ``kasa_beta:``, ``--lr``; :mod:`peftlab.config_roles` names them); a YAML file may
  also nest a prefixed group (``kasa: {beta: 0.01}``).
- ``config.yaml`` is ``yaml.safe_dump`` of ``to_dict()`` (jsonargparse's ``dump`` re-validates, rejecting the
  ``targets: q,v`` spelling, and writes non-ASCII text unescaped): the bytes stay the same.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

import yaml
from jsonargparse import ArgumentError, ArgumentParser, set_parsing_settings

from peftlab.config_roles import (checked_value, choices_of, flat_dict, from_flat, hints, kind_of, option_defaults,
                                  option_groups, option_names, options)
from peftlab.errors import PeftlabError, closest

# The string literal under each field is its documentation (the litgpt convention); jsonargparse parses it.
set_parsing_settings(docstring_parse_attribute_docstrings=True)


# --------------------------------------------------------------------------- schema (jsonargparse)


@functools.lru_cache(maxsize=None)
def schema_parser(cls) -> ArgumentParser:
    """jsonargparse's parser of ``cls``: one typed option per field, its help from the field's docstring."""
    parser = ArgumentParser(exit_on_error=False, prog=cls.__name__)
    parser.add_class_arguments(cls, None, as_group=False, instantiate=False)
    return parser


@functools.lru_cache(maxsize=None)
def _own_docs(cls) -> dict[str, str]:
    return {action.dest: " ".join(str(action.help).split()) for action in schema_parser(cls)._actions
            if action.dest in cls.__dataclass_fields__ and action.help}


def field_docs(cls) -> dict[str, str]:
    """The docstring under each option of ``cls`` (its bases and option groups included), by flat name."""
    return {flat: _own_docs(o.owner)[o.name] for flat, o in options(cls).items() if o.name in _own_docs(o.owner)}


@functools.lru_cache(maxsize=None)
def field_types(cls) -> dict[str, Any]:
    """Each option's resolved type hint, by flat name (``kasa_beta``: ``KasaOptions.beta``'s)."""
    return {flat: hints(o.owner)[o.name] for flat, o in options(cls).items()}


# --------------------------------------------------------------------------- argparse flags


def _section(cls, where) -> str:
    """The ``--help`` section of an option: its declaration's ``section``, else its class's ``SECTION`` (a
    group's option: the group's; a field: the dataclass that declares it), titled by ``cls.SECTIONS``."""
    spec = where.owner.__dataclass_fields__[where.name]
    declaring = where.owner if where.group else next(
        k for k in reversed(cls.__mro__) if where.name in k.__dict__.get("__annotations__", {}))
    key = spec.metadata.get("section") or getattr(declaring, "SECTION", None)
    titles = getattr(cls, "SECTIONS", {})
    return titles.get(key) or (declaring.__doc__ or declaring.__name__).strip().splitlines()[0]


def _flag_type(cls, name: str) -> Callable[[str], Any]:
    """argparse ``type=`` of option ``name`` on another subcommand's parser: typed and checked by its
    declaration (:func:`coerce`, :func:`~peftlab.config_roles.checked_value`), so argparse says the one line."""
    where = options(cls)[name]
    spec = where.owner.__dataclass_fields__[where.name]
    example = None if spec.default is dataclasses.MISSING else spec.default

    def typed(text: str) -> Any:
        try:
            return checked_value(field_types(cls)[name], spec.metadata, coerce(cls, name, text, "command line"),
                                 "--" + name.replace("_", "-"), example)
        except PeftlabError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    typed.__name__ = name  # argparse names the type in its "invalid <type> value" fallback
    return typed


def add_dataclass_flags(parser: argparse.ArgumentParser, cls, *, only: tuple[str, ...] | None = None,
                        defaults: Mapping[str, Any] | None = None) -> None:
    """One kebab-case flag per option (flat names: ``--kasa-beta`` for ``cls.kasa.beta``), in ``--help``
    sections that say where they apply, the help text its field's docstring.

    ``peftlab train`` (``only`` None): every option, defaults None so that only the flags given override YAML,
    values left as text for :func:`build_config` to type and the dataclass to check. Another subcommand
    (``only``: the options it takes, ``defaults``: its own): those flags alone, each typed and checked by its
    declaration while the arguments are parsed (no TrainConfig is built there), defaults as given."""
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


def _peftlab_spelling(hint, value: Any) -> Any:
    """Spellings peftlab has always accepted that jsonargparse 4.53 rejects, turned into what it accepts."""
    kind = kind_of(hint)
    if kind is tuple and isinstance(value, str):  # --targets q,k,v and config.yaml's `targets: q,v`
        return tuple(value.split(","))
    if kind is tuple and isinstance(value, list):  # YAML lists: hashable for the cache below
        return tuple(value)
    if kind is int and isinstance(value, float) and value.is_integer():  # pandas makes int columns with gaps float
        return int(value)
    if kind in (str, typing.Literal) and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # YAML reads `layers: 6` and `save: 1` as numbers
    if kind is float and isinstance(value, str):
        try:  # Python's nan/inf (jsonargparse reads only YAML's .nan/.inf): the declaration says "finite"
            number = float(value)
        except ValueError:
            return value
        return value if math.isfinite(number) else number
    return value


def coerce(cls, name: str, value: Any, where: str) -> Any:
    """A flag string or YAML value of option ``name`` (flat: ``kasa_beta``) in its type; one line naming the
    flag when it has none. Choices, ranges and patterns are the declaration's, checked when the config is built."""
    if value is None:
        return None
    hint = field_types(cls)[name]
    value = _peftlab_spelling(hint, value)
    kind = kind_of(hint)
    if kind is typing.Literal or (kind is str and isinstance(value, str)):
        return value  # text as given: jsonargparse would read `~`, `null` or `#x` of a `str | None` as null
    if kind is tuple:  # a set of choices: each one checked by the declaration (unknown projection 'x')
        if not isinstance(value, tuple):
            raise PeftlabError(f"--{name.replace('_', '-')} must be tuple, got {value!r}", where=where)
        return tuple(str(v) for v in value)
    owner, field_name, _ = options(cls)[name]  # a group's option is typed by its own dataclass
    try:
        hash(value)
    except TypeError:
        return _validated.__wrapped__(owner, field_name, value, where, name)
    # Sweeps type every cell's values again for each run: typing is cached per (field, value, type).
    return _validated(owner, field_name, value, where, name)


@functools.lru_cache(maxsize=4096, typed=True)
def _validated(cls, name: str, value: Any, where: str, option: str) -> Any:
    try:
        return schema_parser(cls).parse_object({name: value}, defaults=False)[name]
    except ArgumentError:
        pass
    kind = kind_of(hints(cls)[name])
    raise PeftlabError(f"--{option.replace('_', '-')} must be {getattr(kind, '__name__', kind)}, got {value!r}",
                       where=where)


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
    """A YAML mapping; a file that is not one (unreadable, not UTF-8, bad syntax, a key twice) is one line
    naming the file and the line."""
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
    """Keys with dashes or underscores (``lr-ratio`` = ``lr_ratio``) -> typed values, by flat option name.

    A prefixed option group may also be nested (``kasa: {beta: 0.01}`` = ``kasa_beta: 0.01``); one option spelled
    two ways in the same mapping is an error, as is an unknown key, which names the closest one (jsonargparse's
    own message, "Option 'x' is not accepted", suggests none)."""
    names = option_names(cls)
    nested = {name: group for name, group in option_groups(cls).items() if group.PREFIX}
    out: dict[str, Any] = {}
    spelled: dict[str, str] = {}

    def put(name: str, value: Any, spelling: str) -> None:
        if name in out:
            raise PeftlabError(f"config key '{name}' is given twice, as '{spelled[name]}' and as '{spelling}'",
                               where=where, fix="keep one of them")
        out[name], spelled[name] = coerce(cls, name, value, where), spelling

    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name in nested:
            for sub_key, sub_value in _group_items(nested[name], key, value, where).items():
                put(f"{name}_{str(sub_key).replace('-', '_')}", sub_value, f"{key}: {{{sub_key}: ...}}")
        elif name in names:
            put(name, value, str(key))
        else:
            raise PeftlabError(f"unknown config key '{key}'{closest(name, names)}", where=where,
                               fix="remove it or use a key from `peftlab train --help`")
    return out


def _group_items(group_cls, key, value, where: str) -> dict[str, Any]:
    """The options of a nested group as given (``kasa: {beta: 0.01}``), each checked to exist in it."""
    subs = [f.name for f in dataclasses.fields(group_cls)]
    if value is None:
        return {}  # `kasa:` with nothing under it sets nothing
    if isinstance(value, group_cls):
        return {sub: getattr(value, sub) for sub in subs}
    if not isinstance(value, Mapping):
        raise PeftlabError(f"config key '{key}' must be a mapping of its options, got {value!r}", where=where,
                           fix=f"e.g. {key}: {{{subs[0]}: ...}}, or the flat key {key}_{subs[0]}: ...")
    for sub_key in value:
        sub = str(sub_key).replace("-", "_")
        if sub not in subs:
            raise PeftlabError(f"unknown config key '{key}.{sub_key}'{closest(sub, subs)}", where=where,
                               fix=f"{key} has: {', '.join(subs)}")
    return dict(value)


def build_config(cls, *, yaml_path: str | None = None, overrides: dict[str, Any] | None = None,
                 flag_values: dict[str, Any] | None = None,
                 check_explicit: Callable[[Any, set[str]], None] | None = None):
    """defaults < YAML file < ``overrides`` (already typed, e.g. a sweep cell) < command-line flags.

    ``check_explicit(cfg, names)``: called with the options set in the YAML or by a flag (``peftlab train``
    refuses one its method would ignore: :func:`peftlab.methods.table.check_explicit_options`). Every value is
    checked against its declaration by the dataclass's ``__post_init__``. The result is the schema: a run's
    method and task defaults are :func:`peftlab.resolve.resolve_config`'s."""
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
            values[name] = coerce(cls, name, value, "command line")
            explicit.add(name)
    cfg = from_flat(cls, values)
    if check_explicit is not None:
        check_explicit(cfg, explicit)
    return cfg


def config_yaml(cfg) -> str:
    """The config as YAML: what ``config.yaml`` holds and ``peftlab train --print-config`` prints."""
    data = cfg.to_dict() if hasattr(cfg, "to_dict") else flat_dict(cfg)
    return yaml.safe_dump(data, sort_keys=False)


def save_config(cfg, path: str | Path) -> None:
    Path(path).write_text(config_yaml(cfg))
