"""Config dataclasses <-> command-line flags <-> YAML, on jsonargparse (re-exported by :mod:`peftlab.config`).

jsonargparse (as in litgpt) reads the schema from the dataclasses themselves: each field's ``--help`` text is the
docstring under it (``docstring_parse_attribute_docstrings``, through docstring-parser), and every value, from a
flag, a ``--config`` YAML file, a sweep spec or a ``key=value`` filter, is converted and validated by its type
hint there (one validation style: ``int``, ``float``, ``bool``, ``X | None``, ``Literal[...]`` choices, tuples).
Nothing here evaluates annotations or parses source by hand. Precedence: defaults < ``--config`` YAML <
``overrides`` < flags; every bad input is a one-line :class:`~peftlab.errors.PeftlabError` naming the key or flag.

What stays hand-written, and why (measured with jsonargparse 4.53.0):

- The flags are argparse's: ``peftlab train`` is a subcommand of the plain argparse parser of
  :mod:`peftlab.cli.main` (a jsonargparse parser cannot hang there: it has no ``parse_known_args``), and
  jsonargparse names its options after the attributes only: ``--lr-ratio 3`` gave "unrecognized arguments",
  and a bare ``--overwrite`` gave "argument --overwrite: expected one argument" (it wants ``--overwrite true``).
  So :func:`add_dataclass_flags` keeps today's dashed flags and ``--x/--no-x`` switches (``Literal`` choices
  shown as ``{a,b}``) and passes the raw strings to jsonargparse.
- Its errors are several lines ('Parser key "rank":\\n  Expected a <class 'int'>. Got value: x', unknown keys
  "Option 'lr_rato' is not accepted" without a suggestion), so the messages are ours, with ``errors.closest``.
- :func:`_peftlab_spelling` keeps the spellings peftlab has always accepted that jsonargparse rejects: ``q,k,v``
  for a tuple, ``8.0`` for an int, a YAML number for a text option, Python's ``nan``/``inf`` for a float (then
  refused by the config's own "finite" check); text options keep their text as given (jsonargparse reads
  ``~``, ``null`` or ``#x`` given to a ``str | None`` as null).
- Option groups (``MethodConfig.kasa: KasaOptions``, nested like peft's ``LoraConfig(kasa_config=...)``) are
  nested in Python only: every other spelling is flat, ``<group>_<option>`` (``--kasa-beta``, ``kasa_beta:``,
  config.yaml, result.json, run keys), as before the groups existed. :func:`option_names` lists the flat
  names, :func:`flat_dict` / :func:`from_flat` convert; a YAML file may also nest (``kasa: {beta: 0.01}``).
- ``config.yaml`` is ``yaml.safe_dump`` of ``to_dict()`` as before (jsonargparse's ``dump`` re-validates,
  rejecting the ``targets: q,v`` spelling, and writes non-ASCII text unescaped): the bytes stay the same.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any, NamedTuple

import yaml
from jsonargparse import ArgumentError, ArgumentParser, set_parsing_settings

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
def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)  # resolves the postponed annotations


class Option(NamedTuple):
    """Where the option of a flat name lives: ``owner``'s field ``name``, inside the field ``group`` (or None)."""

    owner: type
    name: str
    group: str | None


@functools.lru_cache(maxsize=None)
def option_groups(cls) -> dict[str, type]:
    """The fields of ``cls`` that hold a nested dataclass of options (``kasa: KasaOptions``): name -> class."""
    return {f.name: _hints(cls)[f.name] for f in fields(cls) if dataclasses.is_dataclass(_hints(cls)[f.name])}


@functools.lru_cache(maxsize=None)
def options(cls) -> dict[str, Option]:
    """Every option of ``cls`` by its flat name, in field order: a plain field by its own name, a group's
    option as ``<group>_<option>`` (``kasa_beta`` for ``cls.kasa.beta``), the way flags, YAML and
    config.yaml spell it."""
    groups = option_groups(cls)
    out: dict[str, Option] = {}
    for f in fields(cls):
        inner = [(f"{f.name}_{g.name}", Option(groups[f.name], g.name, f.name)) for g in fields(groups[f.name])] \
            if f.name in groups else [(f.name, Option(cls, f.name, None))]
        for flat, option in inner:
            if flat in out:
                raise TypeError(f"{cls.__name__}: option name '{flat}' is declared twice (flat and in a group)")
            out[flat] = option
    return out


def option_names(cls) -> list[str]:
    """The flat option names of ``cls`` (the keys of ``to_dict()``, YAML and sweep specs; flags dashed)."""
    return list(options(cls))


def option_defaults(cls) -> dict[str, Any]:
    """Each option's default by flat name (options without a default are left out)."""
    out = {}
    for flat, option in options(cls).items():
        spec = option.owner.__dataclass_fields__[option.name]
        if spec.default is not dataclasses.MISSING:
            out[flat] = spec.default
        elif spec.default_factory is not dataclasses.MISSING:
            out[flat] = spec.default_factory()
    return out


@functools.lru_cache(maxsize=None)
def _own_docs(cls) -> dict[str, str]:
    return {action.dest: " ".join(str(action.help).split()) for action in schema_parser(cls)._actions
            if action.dest in cls.__dataclass_fields__ and action.help}


def field_docs(cls) -> dict[str, str]:
    """The docstring under each option of ``cls`` (its dataclass bases and option groups included), by flat
    name, as jsonargparse read it."""
    return {flat: _own_docs(o.owner)[o.name] for flat, o in options(cls).items() if o.name in _own_docs(o.owner)}


@functools.lru_cache(maxsize=None)
def field_types(cls) -> dict[str, Any]:
    """Each option's resolved type hint, by flat name (``kasa_beta``: ``KasaOptions.beta``'s)."""
    return {flat: _hints(o.owner)[o.name] for flat, o in options(cls).items()}


def _without_none(hint) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return hint


def _kind(hint) -> Any:
    """``int`` for ``int | None``, ``tuple`` for ``tuple[str, ...]``, ``typing.Literal`` for choices."""
    hint = _without_none(hint)
    origin = typing.get_origin(hint)
    return origin if origin is not None else hint


def choices_of(hint) -> tuple | None:
    """A ``Literal[...]`` field's allowed values, else None."""
    hint = _without_none(hint)
    return typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else None


# --------------------------------------------------------------------------- argparse flags


def add_dataclass_flags(parser: argparse.ArgumentParser, cls, *, skip: tuple[str, ...] = ()) -> None:
    """One kebab-case flag per option (flat names: ``--kasa-beta`` for ``cls.kasa.beta``), grouped by the
    dataclass that declares the field; defaults are None so that only the flags given override YAML. Values
    stay strings here: :func:`coerce` types them."""
    docs = field_docs(cls)
    hints = field_types(cls)
    defaults = option_defaults(cls)
    flat_of: dict[str, list[str]] = {}  # field -> its flat option names (a group has several)
    for flat, option in options(cls).items():
        flat_of.setdefault(option.group or flat, []).append(flat)
    done: set[str] = set()  # a field redeclared in a subclass (e.g. lr) gets the subclass's flag only
    for klass in [k for k in cls.__mro__ if dataclasses.is_dataclass(k)]:
        title = (klass.__doc__ or klass.__name__).strip().splitlines()[0]
        group = parser.add_argument_group(title)
        declared = [name for name in klass.__dict__.get("__annotations__", {}) if name in flat_of and name not in done]
        done.update(declared)
        for name in [flat for field_name in declared for flat in flat_of[field_name]]:
            if name in skip:
                continue
            default = defaults.get(name)
            shown = ",".join(default) if isinstance(default, tuple) else default
            help_text = docs.get(name, "") + (f" (default: {shown})" if shown is not None else "")
            help_text = help_text.replace("%", "%%")  # argparse %-formats help strings
            flag = "--" + name.replace("_", "-")
            if _kind(hints[name]) is bool:
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
                continue
            choices = choices_of(hints[name])
            metavar = "{" + ",".join(map(str, choices)) + "}" if choices else name.upper()
            # no argparse `choices=`: a wrong value must be one line with a suggestion (coerce), not a usage dump
            group.add_argument(flag, type=str, default=None, metavar=metavar, help=help_text, dest=name)


# --------------------------------------------------------------------------- values


def _peftlab_spelling(hint, value: Any) -> Any:
    """Spellings peftlab has always accepted that jsonargparse 4.53 rejects, turned into what it accepts."""
    kind = _kind(hint)
    if kind is tuple and isinstance(value, str):  # --targets q,k,v and config.yaml's `targets: q,v`
        return tuple(value.split(","))
    if kind is tuple and isinstance(value, list):  # YAML lists: hashable for the cache below
        return tuple(value)
    if kind is int and isinstance(value, float) and value.is_integer():  # pandas makes int columns with gaps float
        return int(value)
    if kind is str and isinstance(value, (int, float)) and not isinstance(value, bool):  # YAML reads `layers: 6`
        return str(value)
    if kind is float and isinstance(value, str):
        try:  # Python's nan/inf (jsonargparse reads only YAML's .nan/.inf): the config's check says "finite"
            number = float(value)
        except ValueError:
            return value
        return value if math.isfinite(number) else number
    return value


def coerce(cls, name: str, value: Any, where: str) -> Any:
    """Turn a flag string or YAML value of option ``name`` (flat: ``kasa_beta``) into its type (jsonargparse);
    one-line error naming the flag when it can't."""
    if value is None:
        return None
    hint = field_types(cls)[name]
    value = _peftlab_spelling(hint, value)
    if _kind(hint) is str and isinstance(value, str):
        return value  # text as given: jsonargparse would read `~`, `null` or `#x` of a `str | None` as null
    owner, field_name, _ = options(cls)[name]  # a group's option is typed by its own dataclass
    try:
        hash(value)
    except TypeError:
        return _validated.__wrapped__(owner, field_name, value, where, name)
    # Sweeps type every cell's values again for each run: validation is cached per (field, value, type).
    return _validated(owner, field_name, value, where, name)


@functools.lru_cache(maxsize=4096, typed=True)
def _validated(cls, name: str, value: Any, where: str, option: str) -> Any:
    try:
        return schema_parser(cls).parse_object({name: value}, defaults=False)[name]
    except ArgumentError:
        pass
    flag = "--" + option.replace("_", "-")
    choices = choices_of(field_types(cls)[name])
    if choices:
        listed = [str(c) for c in choices]
        raise PeftlabError(f"unknown {flag} '{value}'{closest(str(value), listed)}", where=where,
                           fix=f"use one of: {', '.join(listed)}")
    kind = _kind(field_types(cls)[name])
    raise PeftlabError(f"{flag} must be {getattr(kind, '__name__', kind)}, got {value!r}", where=where)


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

    An option group may also be nested (``kasa: {beta: 0.01}`` = ``kasa_beta: 0.01``); one option spelled two
    ways in the same mapping is an error, as is an unknown key, which names the closest one (jsonargparse's
    own message, "Option 'x' is not accepted", suggests none)."""
    names = option_names(cls)
    groups = option_groups(cls)
    out: dict[str, Any] = {}
    spelled: dict[str, str] = {}

    def put(name: str, value: Any, spelling: str) -> None:
        if name in out:
            raise PeftlabError(f"config key '{name}' is given twice, as '{spelled[name]}' and as '{spelling}'",
                               where=where, fix="keep one of them")
        out[name], spelled[name] = coerce(cls, name, value, where), spelling

    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name in groups:
            for sub_key, sub_value in _group_items(groups[name], key, value, where).items():
                put(f"{name}_{str(sub_key).replace('-', '_')}", sub_value, f"{key}: {{{sub_key}: ...}}")
        elif name in names:
            put(name, value, str(key))
        else:
            raise PeftlabError(f"unknown config key '{key}'{closest(name, names)}", where=where,
                               fix="remove it or use a key from `peftlab train --help`")
    return out


def _group_items(group_cls, key, value, where: str) -> dict[str, Any]:
    """The options of a nested group as given (``kasa: {beta: 0.01}``), each checked to exist in it."""
    subs = [f.name for f in fields(group_cls)]
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


def from_flat(cls, values: Mapping[str, Any]):
    """``cls`` built from options keyed by flat name (``kasa_beta``, already typed: :func:`normalise_keys`, a
    sweep cell, ``to_dict()``), the groups nested (``kasa=KasaOptions(beta=...)``). A whole group
    (``kasa=KasaOptions(...)`` or a mapping) passes through, but not together with its own flat options."""
    known = options(cls)
    kwargs: dict[str, Any] = {}
    grouped: dict[str, dict[str, Any]] = {}
    for name, value in values.items():
        option = known.get(name)
        if option is None or option.group is None:  # a plain field, a whole group, or unknown (cls says so)
            kwargs[name] = value
        else:
            grouped.setdefault(option.group, {})[option.name] = value
    for group, given in grouped.items():
        if group in kwargs:
            flat = ", ".join(f"{group}_{k}" for k in given)
            raise PeftlabError(f"'{group}' is given as a whole and by its options ({flat})",
                               fix=f"give {group} one way")
        kwargs[group] = option_groups(cls)[group](**given)
    return cls(**kwargs)


def flat_dict(cfg) -> dict[str, Any]:
    """``cfg`` keyed by flat option name in field order (``kasa_beta`` for ``cfg.kasa.beta``), tuples of text
    as comma lists (``targets: q,v``, as :func:`coerce` reads them back): what config.yaml holds."""
    out = {}
    for flat, option in options(type(cfg)).items():
        value = getattr(getattr(cfg, option.group), option.name) if option.group else getattr(cfg, flat)
        if isinstance(value, tuple) and all(isinstance(v, str) for v in value):
            value = ",".join(value)
        out[flat] = value
    return out


def build_config(cls, *, yaml_path: str | None = None, overrides: dict[str, Any] | None = None,
                 flag_values: dict[str, Any] | None = None, check_explicit: bool = False):
    """defaults < YAML file < ``overrides`` (already typed, e.g. a sweep cell) < command-line flags.

    ``check_explicit`` (``peftlab train``): an option set in the YAML or by a flag that the run would ignore
    (e.g. ``--alpha`` with VeRA) is an error (:func:`peftlab.methods.table.check_explicit_options`).
    The cross-field checks are the dataclass's own ``__post_init__``."""
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
    if check_explicit:
        from peftlab.methods.table import check_explicit_options

        check_explicit_options(cfg, explicit)
    return cfg


def config_yaml(cfg) -> str:
    """The resolved config as YAML: what ``config.yaml`` holds and ``peftlab train --print-config`` prints."""
    data = cfg.to_dict() if hasattr(cfg, "to_dict") else flat_dict(cfg)
    return yaml.safe_dump(data, sort_keys=False)


def save_config(cfg, path: str | Path) -> None:
    Path(path).write_text(config_yaml(cfg))
