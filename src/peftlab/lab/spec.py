"""Sweep specs: a YAML grid expanded into runs, each with its resolved config, key and output folder.

A spec is YAML::

    output_dir: runs/my-sweep        # root of the runs (default runs/<spec file stem>), relative to the cwd
    store: runs/my-sweep/results.sqlite   # default <output_dir>/results.sqlite
    base:                            # config keys shared by every run (any `peftlab train` key)
      model: minilm-l6
      epochs: 3
    grid:                            # key -> list of values; the sweep is the cartesian product
      lr_ratio: [1, 2, 4, 8]
      targets: ["q,v", "q,k,v"]
      seed: [0, 1, 2]
    zip:                             # optional: groups of keys whose lists vary together (equal lengths)
      - task: [rte, mrpc]
        max_train_samples: [500, 500]
        weight_decay: [0.0, null]    # null: that run leaves the key at base / its default

Axes vary in the order written (grid keys, then zip groups), the last fastest. Each run's output folder is
``<output_dir>/<readable name>-<first 12 hex digits of its key>``, e.g. ``rte-lora-qv-l4-s0-3f2a9c1b7d0e``.
:func:`load_spec` builds and checks every run's ``TrainConfig`` before anything trains, and writes nothing.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peftlab.argtypes import output_file, output_folder
from peftlab.config import ROLES
from peftlab.errors import PeftlabError, closest
from peftlab.lab.store import STORE_NAME, config_key, short_key
from peftlab.resolve import refuse_unused_options

SPEC_KEYS = ("base", "grid", "zip", "output_dir", "store", "description")
# Set per run by the sweep itself (the config's `run_managed` role).
RUN_MANAGED_KEYS = ROLES.run_managed


@dataclass
class Run:
    """A run of a sweep or a tune, as the executors train it."""

    key: str
    config: dict[str, Any]  # resolved TrainConfig.to_dict(), output_dir included
    index: int = 0  # a sweep's: 1-based position in the grid
    cell: dict[str, Any] = field(default_factory=dict)  # a sweep's: the grid/zip values of this run (what varies)
    attempt: int = 1  # which start of the run this is (the store's attempts once claimed): its log's header says so

    @property
    def output_dir(self) -> str:
        return self.config["output_dir"]

    def describe(self) -> str:
        return " ".join(f"{k}={_fmt_value(v)}" for k, v in self.cell.items()) or "(base config)"


@dataclass
class Sweep:
    spec_path: Path
    output_root: Path
    store_path: Path
    axes: list[str]  # keys that vary
    runs: list[Run] = field(default_factory=list)
    duplicates: int = 0  # grid cells that resolved to a run already in the grid

    @property
    def keys(self) -> list[str]:
        return [run.key for run in self.runs]

    @property
    def log_dir(self) -> Path:
        return self.output_root / "logs"


def _fmt_value(value) -> str:
    if isinstance(value, (tuple, list)):
        return ",".join(map(str, value))
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


# --------------------------------------------------------------------------- spec -> runs


def expand(base: dict[str, Any], grid: dict[str, list], zip_groups: list[dict[str, list]] | None = None,
           *, where: str = "sweep spec") -> list[dict[str, Any]]:
    """The runs of a grid: one dict per cell, ``base`` updated by one value of each grid key and one
    position of each zip group. Cell dicts keep the axis order (grid keys, then zip groups)."""
    axes: list[tuple[tuple[str, ...], list[tuple]]] = []
    seen: dict[str, str] = {}

    def claim_key(key: str, section: str) -> None:
        if key in seen:
            raise PeftlabError(f"key '{key}' is swept twice (in {seen[key]} and {section})", where=where,
                               fix="sweep each key in one place only")
        seen[key] = section

    for key, values in (grid or {}).items():
        claim_key(key, "grid")
        values = _check_list(values, f"grid.{key}", where)
        axes.append(((key,), [(v,) for v in values]))
    for i, group in enumerate(zip_groups or []):
        section = f"zip[{i}]"
        if not isinstance(group, dict) or not group:
            raise PeftlabError(f"{section} must be a non-empty mapping of keys to equal-length lists", where=where,
                               fix="e.g. zip: [{task: [rte, mrpc], epochs: [10, 5]}]")
        lengths = {}
        for key, values in group.items():
            claim_key(key, section)
            lengths[key] = len(_check_list(values, f"{section}.{key}", where))
        if len(set(lengths.values())) != 1:
            detail = ", ".join(f"{k}: {n}" for k, n in lengths.items())
            raise PeftlabError(f"the lists of {section} have different lengths ({detail})", where=where,
                               fix="zip groups vary their keys together, so their lists must be equally long")
        keys = tuple(group)
        axes.append((keys, list(zip(*(group[k] for k in keys)))))
    cells = []
    for combo in itertools.product(*(values for _, values in axes)):
        cell = dict(base or {})
        for (keys, _), values in zip(axes, combo):
            # null in a list: this run leaves the key at base / its default (a zip row that does not set it)
            cell.update((key, value) for key, value in zip(keys, values) if value is not None)
        cells.append(cell)
    return cells


def _check_list(values, name: str, where: str) -> list:
    if not isinstance(values, list):
        raise PeftlabError(f"{name} must be a list of values, got {values!r}", where=where,
                           fix=f"write {name.split('.')[-1]}: [{values!r}] or move it under base:")
    if not values:
        raise PeftlabError(f"{name} is an empty list: the sweep would have no runs", where=where,
                           fix="give it at least one value, or remove it")
    return values


def check_spec_keys(keys, where: str, section: str) -> None:
    from peftlab.config import TrainConfig, normalise_keys

    for key in keys:
        name = str(key).replace("-", "_")
        if name in RUN_MANAGED_KEYS:
            fix = ("set the runs' root as output_dir: at the top level of the spec" if name == "output_dir"
                   else "the sweep resumes unfinished runs itself; use --retry-failed to rerun failed ones")
            raise PeftlabError(f"'{key}' cannot be set in {section}: the sweep sets it for each run", where=where,
                               fix=fix)
        # Names only (values are checked per run): raises with the closest valid key (flat names, or a method's
        # option group nested: kasa)
        normalise_keys(TrainConfig, {key: None}, f"{where}: {section}")


def typed_base(spec: dict, where: str) -> dict[str, Any]:
    """A sweep's or tune's ``base:`` (config keys every run shares): its keys checked, its values typed and checked."""
    from peftlab.config import TrainConfig, normalise_keys

    base = spec.get("base") or {}
    if not isinstance(base, dict):
        raise PeftlabError("base: must be a mapping of config keys to values", where=where)
    check_spec_keys(base, where, "base")
    return normalise_keys(TrainConfig, base, f"{where}: base")


def typed_value(key: str, value, what: str):
    """``value`` typed and checked as config key ``key`` would be; an error names ``what``."""
    from peftlab.config import TrainConfig, normalise_keys

    return next(iter(normalise_keys(TrainConfig, {key: value}, what).values()))


def _typed_axes(axes: dict, where: str, section: str) -> dict[str, Any]:
    """A grid or zip group: its keys checked, each list's values typed like their config field (once here, not
    once per run: a 768-run grid stays instant); non-lists are left to expand() to reject."""
    check_spec_keys(axes, where, section)
    typed = {}
    for key, values in axes.items():
        if isinstance(values, list):
            values = [None if v is None else typed_value(key, v, f"{where}: {section}.{key}") for v in values]
        typed[str(key).replace("-", "_")] = values
    return typed


def read_spec(path: str | os.PathLike, kind: str, keys: tuple[str, ...], *, examples: str,
              config_keys: str) -> tuple[Path, dict]:
    """A ``kind`` (sweep, tune) spec YAML and its mapping, every top-level key one of ``keys``; writes nothing."""
    from peftlab.config import load_yaml

    path = Path(path)
    if not path.is_file():
        raise PeftlabError(f"{kind} spec not found: {path}", fix=f"pass the path of a {kind} YAML (see {examples})")
    spec = load_yaml(path)  # a bad file (syntax, encoding, a key twice) is one line naming its line
    if not spec:
        raise PeftlabError(f"the {kind} spec is empty", where=str(path),
                           fix=f"give its config keys under {config_keys} (see {examples})")
    for key in spec:
        if key not in keys:
            raise PeftlabError(f"unknown {kind} spec key '{key}'{closest(str(key), keys)}", where=str(path),
                               fix=f"top-level keys are {', '.join(keys)}; config keys go under {config_keys}")
    return path, spec


def output_paths(path: Path, spec: dict, output_dir: str | None, store: str | None) -> tuple[Path, Path]:
    """The runs' root and the results store of a spec: the flags, else the spec's keys, else
    ``runs/<spec file stem>`` and ``<root>/results.sqlite``."""
    root = Path(output_dir or spec.get("output_dir") or Path("runs") / path.stem)
    return root, Path(store or spec.get("store") or root / STORE_NAME)


def add_spec_flags(parser, *, dry_run: str) -> None:
    """``--dry-run`` (``dry_run``: its help), where a spec's runs, store and logs go, and the backend flags (sweep
    and tune)."""
    from peftlab.lab.ray_backend import add_backend_flags

    parser.add_argument("--dry-run", action="store_true", help=dry_run)
    parser.add_argument("--output-dir", type=output_folder, default=None,
                        help="root of the runs (default: the spec's output_dir, else runs/<spec stem>)")
    parser.add_argument("--store", type=output_file, default=None,
                        help="results store (default <output dir>/results.sqlite)")
    parser.add_argument("--verbose", action="store_true",
                        help="show each run's output here instead of in <output dir>/logs/<key>.log")
    add_backend_flags(parser)


def load_spec(path: str | os.PathLike, *, output_dir: str | None = None, store: str | None = None) -> Sweep:
    """Read and validate a spec; every run's config is built (so any bad value fails before training)."""
    path, spec = read_spec(path, "sweep", SPEC_KEYS, examples="configs/sweeps/", config_keys="base: or grid:")
    where = str(path)
    base = typed_base(spec, where)
    grid = spec.get("grid") or {}
    zips = spec.get("zip") or []
    if not isinstance(grid, dict):
        raise PeftlabError("grid: must be a mapping of config keys to lists", where=where)
    if isinstance(zips, dict):
        zips = [zips]
    if not isinstance(zips, list):
        raise PeftlabError("zip: must be a list of groups (mappings of keys to equal-length lists)", where=where)
    grid = _typed_axes(grid, where, "grid")
    zips = [_typed_axes(g, where, f"zip[{i}]") if isinstance(g, dict) else g for i, g in enumerate(zips)]

    root, store_path = output_paths(path, spec, output_dir, store)
    cells = expand(base, grid, zips, where=where)
    sweep = Sweep(spec_path=path, output_root=root, store_path=store_path,
                  axes=list(grid) + [k for g in zips for k in g])
    seen: set[str] = set()
    for cell in cells:
        varying = {k: cell[k] for k in sweep.axes if k in cell}  # a null left the key unset
        desc = " ".join(f"{k}={_fmt_value(v)}" for k, v in varying.items())
        run = resolved_run(cell, root, label=f"run {{{desc}}}" if desc else "", where=where)
        if run.key in seen:
            sweep.duplicates += 1
            continue
        seen.add(run.key)
        run.index, run.cell = len(sweep.runs) + 1, varying
        sweep.runs.append(run)
    refuse_unused_options({*base, *sweep.axes}, {run.config["method"] for run in sweep.runs}, where=where)
    return sweep


def resolved_run(values: dict[str, Any], root: Path, *, label: str, where: str) -> Run:
    """The run of config ``values`` (typed): its key and resolved config (``TrainConfig.to_dict()``), resolved as the
    run will be, with its output folder ``<root>/<run name>-<short key>``; an error names the run by ``label``."""
    from peftlab.config import TrainConfig
    from peftlab.resolve import resolve_config

    try:
        config = resolve_config(TrainConfig.from_dict(values)).to_dict()
    except PeftlabError as err:
        raise PeftlabError(f"{label}: {err.what}" if label else err.what, where=where, fix=err.fix) from None
    key = config_key(config)
    config["output_dir"] = str(root / f"{run_name(config)}-{short_key(key)}")
    return Run(key, config)


def run_name(config: dict) -> str:
    """A readable folder-name prefix: ``rte-lora-qv-l4-s0``; the key's hash that follows keeps it unique."""
    targets = config.get("targets") or ""
    targets = "".join(targets.split(",")) if isinstance(targets, str) else "".join(targets)
    method = "before" if int(config.get("epochs") or 0) == 0 else str(config.get("method"))
    parts = [str(config.get("task")), method, targets, f"l{_fmt_value(config.get('lr_ratio'))}",
             f"s{config.get('seed')}"]
    return "-".join(p.replace("/", "_").replace(" ", "") for p in parts if p)

