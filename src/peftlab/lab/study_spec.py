"""A study's design as data: the spec files `peftlab study` reads (the shipped ``studies/*.yaml`` beside this
module, or ``--spec my.yaml``), checked once into a :class:`StudySpec`. The runner and the report read only this:
nothing in them names a method or a row.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from peftlab.errors import PeftlabError, unknown

SHIPPED = Path(__file__).parent / "studies"
SHIPPED_EXAMPLE = "src/peftlab/lab/studies/kasa.yaml"  # what a bad spec is pointed to
TOP_KEYS = {"name", "help", "paper_settings", "fair"}
COMPARES = ("pairs", "baseline", "key_ablation")


@dataclass(frozen=True)
class Family:
    """Paired comparisons (a − b, named) on the held-out seeds, Holm within the family."""

    name: str
    intro: str  # the report's heading
    family: str  # what Holm ran over, as verdicts.json names it
    pairs: tuple[tuple[str, str, str], ...] = ()
    verdict: str | None = None  # kasa | lambda: the sentence written after the family
    # pairs: the listed ones; baseline: each swept row − the baseline, the best swept row − each control;
    # key_ablation: the baseline's pick with W_k frozen − with W_k trained
    compare: str = "pairs"


@dataclass(frozen=True)
class PaperArm:
    """A fixed arm at the task's paper rate, with ``paper`` keys taken from the task's paper settings."""

    name: str
    keys: dict[str, Any]
    paper: tuple[str, ...] = ()


@dataclass(frozen=True)
class Section:
    """The fair protocol's part of a spec."""

    title: str
    options: dict[str, Any]  # option dest -> default: the options this design takes
    rows: dict[str, dict] = field(default_factory=dict)  # name -> train keys
    swept: dict | None = None  # {key, option, baseline, name}: a row per value of the option
    paper_arms: tuple[PaperArm, ...] = ()
    controls: tuple[str, ...] = ()  # names of the baseline's arms at the best swept row's eta_QK and eta_V
    key_ablation: bool = False
    families: tuple[Family, ...] = ()


@dataclass(frozen=True)
class StudySpec:
    name: str
    help: str  # a line of `peftlab study --help`
    path: Path
    section: Section
    paper_settings: dict[str, dict] = field(default_factory=dict)

    def command(self) -> str:
        shipped_path = shipped().get(self.name)
        if shipped_path is not None and shipped_path.resolve() == self.path.resolve():
            return f"peftlab study {self.name}"
        return f"peftlab study --spec {self.path}"

    def paper(self, task: str) -> dict[str, Any]:
        """The task's paper settings (``default`` for a task the authors did not run)."""
        settings = self.paper_settings.get(task, self.paper_settings.get("default"))
        if settings is None:
            raise PeftlabError(f"study '{self.name}' has no paper settings for {task} (and no default)",
                               where=str(self.path), fix="add paper_settings: {default: {lr: ...}}")
        return settings


def shipped() -> dict[str, Path]:
    """The shipped specs by name (``peftlab study <name>``)."""
    return {path.stem: path for path in sorted(SHIPPED.glob("*.yaml"))}


def load_study_spec(path: str | Path) -> StudySpec:
    """A spec file, checked: unknown keys, a missing name or section, a bad family are one-line errors."""
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise PeftlabError(f"cannot read the study spec: {err}", where=str(path)) from None
    if not isinstance(data, dict) or not data.get("name"):
        raise PeftlabError("a study spec is a mapping with a name", where=str(path), fix=f"see {SHIPPED_EXAMPLE}")
    if "fixed-rate" in data:  # a copy of a shipped spec from before that protocol left the package
        raise PeftlabError("the study spec has a 'fixed-rate' section: that protocol moved out of the installed "
                           "package (python -m studies.fixed_rate in a source checkout)", where=str(path),
                           fix="delete the section; peftlab study runs the 'fair' one")
    _known(data, TOP_KEYS, path, "study spec")
    if "fair" not in data:
        raise PeftlabError("the study spec has no 'fair' section", where=str(path), fix=f"see {SHIPPED_EXAMPLE}")
    return StudySpec(str(data["name"]), str(data.get("help") or data["name"]), path, _section(data["fair"], path),
                     dict(data.get("paper_settings") or {}))


def _section(data: Any, path: Path) -> Section:
    if not isinstance(data, dict):
        raise PeftlabError("'fair' must be a mapping", where=str(path))
    _known(data, Section, path, "fair")
    rows = dict(data.get("rows") or {})
    swept = data.get("swept")
    if bool(rows) == bool(swept):
        raise PeftlabError("'fair' needs either rows (name: keys) or swept (one key over an option's values)",
                           where=str(path))
    arms = tuple(PaperArm(str(a["name"]), dict(a.get("keys") or {}), tuple(a.get("paper") or ()))
                 for a in data.get("paper_arms") or ())
    families = tuple(_family(f, path) for f in data.get("families") or ())
    named = {*rows, *(arm.name for arm in arms)}  # a row at another rate (`kasa@...`) is its row's
    for family in families:
        strangers = [n for a, b, _ in family.pairs for n in (a, b) if n not in named and n.split("@")[0] not in rows]
        if strangers:
            raise PeftlabError(f"family '{family.name}' compares '{strangers[0]}', which is no row or arm",
                               where=str(path))
    return Section(str(data.get("title") or ""), dict(data.get("options") or {}), rows, swept, arms,
                   tuple(data.get("controls") or ()), bool(data.get("key_ablation")), families)


def _family(data: Any, path: Path) -> Family:
    if not isinstance(data, dict) or not data.get("name"):
        raise PeftlabError("a family is a mapping with a name", where=str(path))
    _known(data, Family, path, f"family {data['name']}")
    pairs = []
    for pair in data.get("pairs") or ():
        if not isinstance(pair, list) or len(pair) not in (2, 3):
            raise PeftlabError(f"family {data['name']}: a pair is [a, b] or [a, b, name], got {pair!r}",
                               where=str(path))
        pairs.append((str(pair[0]), str(pair[1]), str(pair[2]) if len(pair) == 3 else f"{pair[0]} − {pair[1]}"))
    compare = data.get("compare", "pairs")
    if compare not in COMPARES:
        raise unknown(f"compare of family {data['name']}", str(compare), COMPARES, where=str(path))
    return Family(str(data["name"]), str(data.get("intro") or data["name"]), str(data.get("family") or ""),
                  tuple(pairs), data.get("verdict"), compare)


def _known(data: dict, allowed, path: Path, what: str) -> None:
    """``allowed``: the keys, or the dataclass whose fields they are."""
    allowed = {f.name for f in fields(allowed)} if isinstance(allowed, type) else allowed
    extra = sorted(set(data) - allowed)
    if extra:
        raise unknown(f"key of the {what}", extra[0], sorted(allowed), where=str(path))


def spec_for(kind: str | None, spec_file: str | None) -> StudySpec:
    """``peftlab study KIND`` (a shipped spec) or ``--spec FILE``: exactly one of them."""
    if (kind is None) == (spec_file is None):
        raise PeftlabError("name a study: peftlab study lambda|kasa, or peftlab study --spec my.yaml",
                           fix="give one of them")
    return load_study_spec(spec_file if spec_file is not None else shipped()[kind])
