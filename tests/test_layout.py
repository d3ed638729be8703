"""The package layout stays true: which sub-package may import which (every import, also inside functions),
no reaching into another sub-package's private names, small modules, and every shipped YAML valid.

The directions are in one table, :data:`RULES`. A sub-package is ``peftlab.<name>`` (a folder, or a
top-level module such as ``peftlab.config``); importing within one's own sub-package is always allowed.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "peftlab"
CONFIGS = ROOT / "configs"
MAX_LINES = 500

# lab/ modules that run training (the sweep and its runners); every other lab module only reads run records.
LAB_RUNNERS = ("peftlab.lab.sweep", "peftlab.lab.ray_backend", "peftlab.lab.tune")
LAB_READERS = "peftlab.lab.* except " + ", ".join(LAB_RUNNERS)

# (who imports, what it must not import, why). Prefixes of dotted module names; "*" is every module.
RULES: list[tuple[str, tuple[str, ...], str]] = [
    ("peftlab.tasks", ("peftlab.training", "peftlab.lab", "peftlab.cli"),
     "a task builds data and scores predictions; it never reads the run folder or the lab"),
    ("peftlab.methods", ("peftlab.training", "peftlab.lab", "peftlab.cli", "peftlab.tasks"),
     "a method adapts a model; it knows neither the loop, the lab, the CLI nor the tasks"),
    ("peftlab.models", ("peftlab.methods", "peftlab.tasks", "peftlab.training", "peftlab.lab", "peftlab.cli"),
     "the registry loads models; everything else builds on it"),
    (LAB_READERS, ("peftlab.methods", "peftlab.models", "peftlab.training"),
     "reports and plots read run records only (result.json has the method, targets, #Param, ...)"),
    ("* except peftlab.cli", ("peftlab.cli",), "the CLI is the entry point: nothing imports it"),
]


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name
    target: str  # dotted module (or package) imported
    names: tuple[str, ...]  # names taken from it (``from target import a, b``; attributes read off an alias)
    line: int


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def subpackage(module: str) -> str:
    return ".".join(module.split(".")[:2])


def is_module(dotted: str) -> bool:
    path = PACKAGE.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


@lru_cache(maxsize=None)
def package_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def resolve_from(importer: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


@lru_cache(maxsize=None)
def imports_of(module: str) -> tuple[Import, ...]:
    """Every import of ``module`` (module level, functions, TYPE_CHECKING blocks), and importlib.import_module
    calls with a literal name; attributes read off an imported peftlab module's alias count as its names."""
    path = package_modules()[module]
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[Import] = []
    aliases: dict[str, str] = {}  # local name -> the peftlab module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(module, alias.name, (), node.lineno))
                if alias.asname:
                    aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            target = resolve_from(module, node, path.name == "__init__.py")
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                if target.startswith("peftlab") and is_module(submodule):  # `from peftlab.lab import store`
                    found.append(Import(module, submodule, (), node.lineno))
                    aliases[alias.asname or alias.name] = submodule
                else:
                    found.append(Import(module, target, (alias.name,), node.lineno))
        elif (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))
              and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append(Import(module, node.args[0].value, (), node.lineno))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            found.append(Import(module, aliases[node.value.id], (node.attr,), node.lineno))
    return tuple(imp for imp in found if imp.target.startswith("peftlab"))


def applies(who: str, module: str) -> bool:
    if who == "*":
        return True
    if " except " in who:
        scope, _, exceptions = who.partition(" except ")
        excluded = [e.strip() for e in exceptions.split(",")]
        if any(module == e or module.startswith(e + ".") for e in excluded):
            return False
        return applies(scope.strip(), module)
    prefix = who.removesuffix(".*")
    return module == prefix or module.startswith(prefix + ".")


def under(target: str, prefix: str) -> bool:
    return target == prefix or target.startswith(prefix + ".")


def rule_violations(who: str, forbidden: tuple[str, ...]) -> list[str]:
    out = []
    for module in package_modules():
        if not applies(who, module):
            continue
        for imp in imports_of(module):
            if any(under(imp.target, f) for f in forbidden) and subpackage(imp.target) != subpackage(module):
                out.append(f"{package_modules()[module].relative_to(ROOT)}:{imp.line} imports {imp.target}")
    return sorted(set(out))


@pytest.mark.parametrize("who, forbidden, why", RULES, ids=[f"{who} -/-> {','.join(f)}" for who, f, _ in RULES])
def test_import_direction(who, forbidden, why):
    bad = rule_violations(who, forbidden)
    assert not bad, f"{why}:\n  " + "\n  ".join(bad)


def test_no_private_names_across_subpackages():
    bad = []
    for module in package_modules():
        for imp in imports_of(module):
            if subpackage(imp.target) == subpackage(module):
                continue
            private = [n for n in imp.names if n.startswith("_") and not n.startswith("__")]
            if imp.target.rsplit(".", 1)[-1].startswith("_") and not imp.target.endswith("__main__"):
                private.append(imp.target)
            bad += [f"{package_modules()[module].relative_to(ROOT)}:{imp.line} uses {imp.target}.{n}" for n in private]
    assert not bad, "another sub-package's private helper; make it public or move it:\n  " + "\n  ".join(sorted(bad))


def test_the_rules_see_imports_inside_functions():
    """The walker is no weaker than the rules need: a function-level import and an alias attribute count."""
    found = {(imp.target, imp.names) for imp in imports_of("peftlab.cli.main")}
    assert ("peftlab.errors", ("PeftlabError",)) in found
    assert any(imp.target == "peftlab.tasks.table" for imp in imports_of("peftlab.lab.records"))  # inside a function
    assert applies(LAB_READERS, "peftlab.lab.report") and not applies(LAB_READERS, "peftlab.lab.sweep")
    assert applies("* except peftlab.cli", "peftlab.lab.report") and not applies("* except peftlab.cli", "peftlab.cli.main")


def test_every_module_is_small():
    sizes = {module: len(path.read_text().splitlines()) for module, path in package_modules().items()}
    big = {module: n for module, n in sizes.items() if n > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines (split them by what they do): " + ", ".join(
        f"{m} ({n})" for m, n in sorted(big.items(), key=lambda item: -item[1]))


# --------------------------------------------------------------------------- shipped configs


def shipped_yaml() -> list[Path]:
    return sorted(p for p in CONFIGS.rglob("*") if p.suffix in (".yaml", ".yml"))


def kind_of(path: Path) -> str:
    """``tune`` (a search: space), ``sweep`` (base/grid/zip) or ``train`` (config keys for --config)."""
    import yaml

    data = yaml.safe_load(path.read_text()) or {}
    keys = set(data) if isinstance(data, dict) else set()
    return "tune" if "search" in keys else "sweep" if {"grid", "zip", "base"} & keys else "train"


def test_configs_are_shipped():
    kinds = {kind_of(p) for p in shipped_yaml()}
    assert len(shipped_yaml()) >= 10 and {"sweep", "train"} <= kinds


@pytest.mark.parametrize("path", shipped_yaml(), ids=lambda p: str(p.relative_to(CONFIGS)))
def test_shipped_yaml_loads_and_validates(path, tmp_path):
    """Through the code `peftlab sweep SPEC` / `peftlab tune SPEC` / `peftlab train --config FILE` run before
    anything trains."""
    if kind_of(path) == "sweep":
        from peftlab.lab.spec import load_spec

        sweep = load_spec(path, output_dir=str(tmp_path / "runs"))
        assert sweep.runs and all(run.config["output_dir"].startswith(str(tmp_path)) for run in sweep.runs)
        assert not (tmp_path / "runs").exists()  # validating writes nothing
    elif kind_of(path) == "tune":
        from peftlab.lab.tune_spec import load_tune_spec

        load_tune_spec(path, output_dir=str(tmp_path / "runs"))
        assert not (tmp_path / "runs").exists()
    else:
        from peftlab.cli.main import build_parser
        from peftlab.training.loop import config_from_args

        argv = ["train", "--config", str(path)]
        cfg = config_from_args(build_parser(argv).parse_args(argv))
        assert cfg.task and cfg.model and cfg.method
