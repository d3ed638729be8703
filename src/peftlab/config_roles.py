"""One declaration per config field: its type, default, help, valid values, ``--help`` section and roles.

    seed: int = option(0, Range(0, 2**32, high_open=True), key_v1=True, searchable=False, report_row=False)
    \"\"\"Training seed: head init, adapter init, ...\"\"\"

The type is the annotation (``Literal``: a choice; ``tuple[Literal[...], ...]``: a set of them), the help the
docstring under the field. :func:`checked_value` is a value's one check, wherever it enters (a flag, YAML, a spec:
:func:`peftlab.config_cli.coerce`; Python: :func:`check_fields`); :func:`role_sets` derives each consumer's
option list from the :class:`Roles`. :class:`File` / :class:`Folder` are checked when a run is resolved.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

from peftlab.errors import PeftlabError, closest, unknown

INT64_MAX = 2**63 - 1  # what torch, numpy and the tokenizers take as an integer (a length, a count, a step)
NOT_HASHED = object()  # Roles.hashed_as: not hashed at all


@dataclass(frozen=True)
class Range:
    """Numbers from ``low`` to ``high`` (None: unbounded on that side; ``*_open``: the bound itself excluded)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    why: str = ""  # whose limit it is, when it is a library's (shown in the message)

    def admits(self, value) -> bool:
        low_ok = self.low is None or (value > self.low if self.low_open else value >= self.low)
        high_ok = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return low_ok and high_ok

    def describe(self, integer: bool) -> str:
        shown = (lambda x: str(int(x))) if integer else (lambda x: f"{x:g}")
        bounds = [f"{sign[is_open]} {shown(bound)}" for bound, is_open, sign in (
            (self.low, self.low_open, (">=", ">")), (self.high, self.high_open, ("<=", "<"))) if bound is not None]
        if integer and self.low == 1 and not self.low_open:
            text = "a positive integer" + (f" {bounds[1]}" if len(bounds) > 1 else "")
        else:
            text = ("an integer" if integer else "a finite number") + (" " + " and ".join(bounds) if bounds else "")
        return text + (f" ({self.why})" if self.why else "")


POSITIVE = Range(0, low_open=True)  # a finite number > 0 (rates, scales, seconds)
# numpy's seeds are < 2**32 (accelerate's set_seed seeds numpy, random and torch with --seed)
SEED = Range(0, 2**32, high_open=True, why="numpy's seed range")


@dataclass(frozen=True)
class Text:
    """Text that is not blank; with ``pattern``, text that fully matches it (``meaning`` says what it is)."""

    pattern: str | None = None
    meaning: str = "non-empty text"


@dataclass(frozen=True)
class File:
    """A path to an existing file (not a folder); checked when the config is resolved for a run."""


@dataclass(frozen=True)
class Folder:
    """A path to a folder: ``exists`` (it must be there), else it may be missing but is no file."""

    exists: bool = True


@dataclass(frozen=True)
class Roles:
    """What a field is for, beyond its value; :func:`role_sets` makes each consumer's list out of these."""

    key_v1: bool = False  # an option of run-key schema 1: hashed at every value (later ones only off default)
    resumable: bool = False  # may differ between a run and its --resume, so it never changes the run key
    hashed_as: Any = NOT_HASHED  # a resumable field that key schema 1 hashed: hashed as this constant (old keys)
    run_managed: bool = False  # set per run by sweep / tune (its folder, resume): never in a spec
    searchable: bool = True  # peftlab tune may search it
    report_row: bool = True  # reports, figures and run identities tell configs apart by it (not: bookkeeping)
    training_only: bool = False  # cannot change an untrained model's metrics (before-training rows pool over it)
    label: int | None = None  # its place among the label columns of reports when it varies
    adapter_identity: bool = False  # an adapter trained with another value must not be evaluated on this run


def option(default: Any, check: Range | Text | File | Folder | None = None, *, noun: str | None = None,
           lower: bool = False, normalise: Callable[[Any], Any] | None = None, section: str | None = None,
           **roles) -> Any:
    """A dataclass field declared with its check and roles. ``noun`` names a choice's kind in the "unknown
    <noun> 'x'" message (default: the flag); ``lower``: a choice is matched in lower case; ``normalise``: the
    canonical form of a text value (``--layers 6-8`` -> 6,7,8); ``section``: its ``--help`` section (a key of the
    config's ``SECTIONS``; default: its class's ``SECTION``)."""
    metadata = {"check": check, "noun": noun, "lower": lower, "normalise": normalise, "section": section,
                "roles": Roles(**roles)}
    return dataclasses.field(default=default, metadata=metadata)


# --------------------------------------------------------------------------- the type of a hint


@functools.lru_cache(maxsize=None)
def hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)  # resolves the postponed annotations


def optional(hint) -> bool:  # Optional[X] / X | None
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)


def without_none(hint) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if optional(hint) and len(args) == 1 else hint


def choices_of(hint) -> tuple | None:
    """A ``Literal[...]`` field's allowed values, else None."""
    hint = without_none(hint)
    return typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else None


def kind_of(hint) -> Any:
    """``int`` for ``int | None``, ``tuple`` for ``tuple[...]``, ``typing.Literal`` for a choice."""
    hint = without_none(hint)
    return typing.get_origin(hint) or hint


def flag_of(cls, name: str) -> str:
    prefix = getattr(cls, "PREFIX", "")
    return "--" + (f"{prefix}_{name}" if prefix else name).replace("_", "-")


# --------------------------------------------------------------------------- checks


def check_fields(obj) -> None:
    """Each field of the dataclass ``obj``: its declared type, choice and range, normalised in place (a mapping
    given for an option group becomes the group). One-line :class:`PeftlabError` naming the flag."""
    cls = type(obj)
    for spec in dataclasses.fields(cls):
        hint = hints(cls)[spec.name]
        value = getattr(obj, spec.name)
        if dataclasses.is_dataclass(hint):  # an option group: an instance as is, a mapping built into one
            value = value if isinstance(value, hint) else hint(**group_items(hint, spec.name, value))
        else:
            default = None if spec.default is dataclasses.MISSING else spec.default
            value = checked_value(hint, spec.metadata, value, flag_of(cls, spec.name), default)
        object.__setattr__(obj, spec.name, value)  # option groups are frozen: normalised once, here


# Frozen: a config copied with dataclasses.replace shares its groups, so none may change under the other.
@dataclass(frozen=True)
class OptionGroup:
    """An option group (``cfg.kasa``, ``cfg.optim``): its fields checked against their declarations when it is
    built. ``PREFIX``: its flat names' prefix and its field's name (``kasa``: ``kasa_beta``; ``""``: ``lr``)."""

    PREFIX = ""

    def __post_init__(self):
        check_fields(self)


def group_items(group_cls, name: str, value, where: str | None = None) -> dict[str, Any]:
    """The options of group ``name`` given as a mapping (``kasa: {beta: 0.01}``), each checked to exist in it."""
    subs = [f.name for f in dataclasses.fields(group_cls)]
    if not isinstance(value, Mapping):
        raise PeftlabError(f"config key '{name}' must be a mapping of its options, got {value!r}", where=where,
                           fix=f"e.g. {name}: {{{subs[0]}: ...}}, or the flat key {name}_{subs[0]}: ...")
    given = {str(k).replace("-", "_"): v for k, v in value.items()}
    for sub in given:
        if sub not in subs:
            raise PeftlabError(f"unknown config key '{name}.{sub}'{closest(sub, subs)}", where=where,
                               fix=f"{name} has: {', '.join(subs)}")
    return given


def checked_value(hint, metadata: Mapping, value, flag: str, example=None):
    """``value`` of a field typed ``hint`` and declared with ``metadata``, checked and normalised (``example``:
    a valid value the message may suggest, the field's default)."""
    if value is None:
        if optional(hint):
            return None
        raise PeftlabError(f"{flag} must be set, got None", fix=f"give {flag} a value or leave it at its default")
    choices, kind, check = choices_of(hint), kind_of(hint), metadata.get("check")
    if choices is not None:
        return _choice(value, choices, metadata, flag)
    if kind is tuple:
        return _choice_set(value, typing.get_args(without_none(hint))[0], metadata, flag)
    if kind is bool:
        if not isinstance(value, bool):
            raise PeftlabError(f"{flag} must be bool, got {value!r}", fix=f"give {flag} true or false")
        return value
    if kind in (int, float):
        return _number(value, kind is int, check or Range(), flag, example)
    if kind is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)  # as the YAML layer reads `layers: 6`
        if not isinstance(value, str):
            raise PeftlabError(f"{flag} must be str, got {value!r}")
        if metadata.get("normalise"):
            value = metadata["normalise"](value)
        if isinstance(check, Text) and value is not None:
            _text(value, check, flag)
        return value
    return value


def _choice(value, choices: tuple, metadata: Mapping, flag: str):
    text = str(value).strip()
    text = text.lower() if metadata.get("lower") else text
    if isinstance(value, bool) or text not in choices:
        noun = metadata.get("noun")
        raise unknown(noun or flag, text, [str(c) for c in choices], where=flag if noun else None)
    return text


def _choice_set(value, item_hint, metadata: Mapping, flag: str) -> tuple:
    """A comma list or sequence of choices, as a tuple in the order the ``Literal`` declares them."""
    items = value.split(",") if isinstance(value, str) else value
    if isinstance(items, Mapping) or not isinstance(items, (list, tuple)):
        raise PeftlabError(f"{flag} must be tuple, got {value!r}", fix=f"give {flag} a comma list, e.g. q,v")
    choices = typing.get_args(item_hint)
    picked = {_choice(item, choices, metadata, flag) for item in items if str(item).strip()}
    return tuple(c for c in choices if c in picked)


def _number(value, integer: bool, check: Range, flag: str, example=None):
    if integer and (isinstance(value, bool) or not isinstance(value, int)):
        raise PeftlabError(f"{flag} must be int, got {value!r}")
    if not integer and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise PeftlabError(f"{flag} must be float, got {value!r}")
    if not check.admits(value) or (not integer and not math.isfinite(value)):
        raise PeftlabError(f"{flag} must be {check.describe(integer)}, got {value!r}",
                           fix=f"e.g. {flag} {example}" if example is not None and check.admits(example) else None)
    if integer and abs(value) > INT64_MAX:
        raise PeftlabError(f"{flag} must fit in 64 bits (at most {INT64_MAX}), got {value}")
    return value


def _text(value: str, check: Text, flag: str) -> None:
    if not value.strip() or (check.pattern and not re.fullmatch(check.pattern, value)):
        raise PeftlabError(f"{flag} must be {check.meaning}, got {value!r}")


# --------------------------------------------------------------------------- flat option names


class Option(NamedTuple):
    """Where the option of a flat name lives: ``owner``'s field ``name``, inside the field ``group`` (or None)."""

    owner: type
    name: str
    group: str | None


@functools.lru_cache(maxsize=None)
def option_groups(cls) -> dict[str, type]:
    """The fields of ``cls`` that hold an option group (``kasa: KasaOptions``): name -> class."""
    return {f.name: hints(cls)[f.name] for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints(cls)[f.name])}


@functools.lru_cache(maxsize=None)
def options(cls) -> dict[str, Option]:
    """Every option of ``cls`` by its flat name: a plain field by its own name, a group's option as
    ``<PREFIX>_<option>`` (``kasa_beta`` for ``cls.kasa.beta``) or, for a group without a prefix, by its own name
    (``lr`` for ``cls.optim.lr``): the way flags, YAML, config.yaml and run keys spell them. Field order, except
    that a group without a prefix comes first (``lr, lr_ratio, head_lr, weight_decay`` lead config.yaml, as they
    did when TrainConfig inherited them)."""
    groups = option_groups(cls)
    out: dict[str, Option] = {}
    for spec in sorted(dataclasses.fields(cls), key=lambda f: not (f.name in groups and not groups[f.name].PREFIX)):
        group = groups.get(spec.name)
        if group is not None and group.PREFIX not in ("", spec.name):
            raise TypeError(f"{cls.__name__}.{spec.name}: its group's PREFIX is '{group.PREFIX}'")
        inner = [(f"{group.PREFIX}_{g.name}" if group.PREFIX else g.name, Option(group, g.name, spec.name))
                 for g in dataclasses.fields(group)] if group else [(spec.name, Option(cls, spec.name, None))]
        for flat, where in inner:
            if flat in out:
                raise TypeError(f"{cls.__name__}: option name '{flat}' is declared twice")
            out[flat] = where
    return out


def option_names(cls) -> list[str]:
    return list(options(cls))


def option_defaults(cls) -> dict[str, Any]:
    return {flat: option_spec(cls, flat).default for flat in options(cls)}


def option_spec(cls, flat: str) -> dataclasses.Field:
    where = options(cls)[flat]
    return where.owner.__dataclass_fields__[where.name]


def from_flat(cls, values: Mapping[str, Any]):
    """``cls`` built from options keyed by flat name (``kasa_beta``: a sweep cell, ``to_dict()``), the groups
    nested (``kasa=KasaOptions(beta=...)``). A whole group (an instance or a mapping) passes through, but not
    together with its own flat options."""
    known = options(cls)
    kwargs: dict[str, Any] = {}
    grouped: dict[str, dict[str, Any]] = {}
    for name, value in values.items():
        where = known.get(name)
        if where is None or where.group is None:  # a plain field, a whole group, or unknown (cls says so)
            kwargs[name] = value
        else:
            grouped.setdefault(where.group, {})[where.name] = value
    for group, given in grouped.items():
        if group in kwargs:
            flat = ", ".join(n for n, o in known.items() if o.group == group and o.name in given)
            raise PeftlabError(f"'{group}' is given as a whole and by its options ({flat})", fix=f"give {group} one way")
        kwargs[group] = option_groups(cls)[group](**given)
    return cls(**kwargs)


def flat_dict(cfg) -> dict[str, Any]:
    """``cfg`` keyed by flat option name (``kasa_beta`` for ``cfg.kasa.beta``), tuples of text as comma lists
    (``targets: q,v``, as the YAML layer reads them back): what config.yaml holds."""
    out = {}
    for flat, where in options(type(cfg)).items():
        value = getattr(getattr(cfg, where.group), where.name) if where.group else getattr(cfg, flat)
        if isinstance(value, tuple) and all(isinstance(v, str) for v in value):
            value = ",".join(value)
        out[flat] = value
    return out


# --------------------------------------------------------------------------- the lists derived from the roles


@dataclass(frozen=True)
class RoleSets:
    """Each consumer's list of flat option names, in field order (derived from :class:`Roles`)."""

    key_v1: frozenset  # lab/store.KEY_FIELDS_V1: hashed at every value
    resumable: frozenset  # training/guards.RESUME_FREE_KEYS: never in the run key
    hashed_as: dict  # lab/store.KEY_PINNED: resumable, but hashed as this constant (as key schema 1 did)
    run_managed: tuple  # lab/spec.RUN_MANAGED_KEYS
    not_searchable: tuple  # lab/tune/spec.NOT_SEARCHABLE
    not_report_rows: tuple  # lab/records.NON_RESULT_KEYS
    training_only: tuple  # lab/records.TRAINING_ONLY_KEYS
    label_order: tuple  # lab/records.LABEL_ORDER
    adapter_identity: tuple  # training/evaluation.ADAPTER_IDENTITY_KEYS


def _contradiction(r: Roles) -> str | None:
    if r.resumable and r.report_row:
        return "is resumable but tells report rows apart"
    if r.hashed_as is not NOT_HASHED and not (r.resumable and r.key_v1):
        return "has hashed_as but is not a resumable key-schema-1 option"
    if r.resumable and r.key_v1 and r.hashed_as is NOT_HASHED and not r.run_managed:
        return "is resumable and in key schema 1: give it hashed_as, or old run keys change"
    if r.run_managed and (r.searchable or not r.resumable):
        return "is run-managed but searchable or not resumable"
    return None


@functools.lru_cache(maxsize=None)
def role_sets(cls) -> RoleSets:
    """The lists of ``cls``'s options by role; a contradiction between roles is a TypeError (a bug, not input)."""
    roles = {flat: option_spec(cls, flat).metadata.get("roles", Roles()) for flat in options(cls)}
    for name, r in roles.items():
        problem = _contradiction(r)
        if problem:
            raise TypeError(f"{cls.__name__}: option '{name}' {problem}")

    def having(test) -> tuple:
        return tuple(name for name, r in roles.items() if test(r))

    labelled = sorted((r.label, name) for name, r in roles.items() if r.label is not None)
    return RoleSets(
        key_v1=frozenset(having(lambda r: r.key_v1)), resumable=frozenset(having(lambda r: r.resumable)),
        hashed_as={n: r.hashed_as for n, r in roles.items() if r.hashed_as is not NOT_HASHED},
        run_managed=having(lambda r: r.run_managed),
        not_searchable=having(lambda r: not r.searchable or r.run_managed),
        not_report_rows=having(lambda r: not r.report_row), training_only=having(lambda r: r.training_only),
        label_order=tuple(name for _, name in labelled), adapter_identity=having(lambda r: r.adapter_identity))
