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
MAX_LINES = 400
MAX_FUNCTION_LINES = 60
# src/peftlab's size ceiling: lowered as the package shrinks, never raised (issue #37 aims at 18,000).
MAX_PACKAGE_LINES = 20_609
REPEAT_LINES = 6  # a block of this many lines written twice is one function waiting to be written

# lab/ modules that run training (the sweep and its runners); every other lab module only reads run records.
LAB_RUNNERS = ("peftlab.lab.sweep", "peftlab.lab.runner", "peftlab.lab.ray_backend", "peftlab.lab.tune")
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
    if "," in who:
        return any(applies(one.strip(), module) for one in who.split(","))
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


# --------------------------------------------------------------------------- transitive rules

CONFIG_LAYER = "peftlab.config, peftlab.config_cli, peftlab.config_roles"
HEAVY = ("torch", "transformers", "peft", "accelerate", "datasets")
# The registrations the config reads its --method / --task choices from (config.MethodName, TaskName): a name is
# registered once, there. They are leaves to the config: it reads their module-level tables and never calls their
# builders, whose function-level imports (peft, the method and pipeline modules) run only when a model is adapted
# or a task's data built; the last transitive rule keeps what importing them loads to nothing heavy and nothing of
# the config, so a reader that reaches them through the config still starts without torch.
CONFIG_READS = ("peftlab.methods.registry", "peftlab.tasks.table")

# (who, what it must not reach, how imports are followed, why). "every import" follows also the imports inside
# functions (what the module may end up running); "on import" follows what `import module` itself loads, with
# third-party packages (what a reader pays for before it does anything).
TRANSITIVE_RULES: list[tuple[str, tuple[str, ...], str, str]] = [
    (CONFIG_LAYER, ("peftlab.methods", "peftlab.tasks", "peftlab.models", "peftlab.training", "peftlab.lab",
                    "peftlab.cli", "peftlab.resolve"), "every import",
     "the config is the leaf everything reads: method and task defaults are resolved above it (peftlab.resolve)"),
    (CONFIG_LAYER, HEAVY, "on import", "flags, YAML and the run key are checked without torch"),
    ("peftlab.training", ("peftlab.lab", "peftlab.cli"), "every import",
     "one run knows nothing of the lab that runs many or of the CLI"),
    (LAB_READERS, ("peftlab.methods", "peftlab.models", "peftlab.training", *HEAVY), "on import",
     "reports and plots start without torch: not directly, and not through config or the store"),
    (", ".join(CONFIG_READS), ("peftlab.config", "peftlab.methods", "peftlab.tasks", "peftlab.models",
                               "peftlab.training", "peftlab.lab", "peftlab.cli", *HEAVY), "on import",
     "the registrations the config reads are leaves on import: torch-free, and no cycle through the config"),
]


def owner(target: str) -> str:
    """The module an import target lives in (``peftlab.config.TrainConfig`` is ``peftlab.config``)."""
    while target not in package_modules() and "." in target:
        target = target.rsplit(".", 1)[0]
    return target


def followed(module: str, how: str) -> list[tuple[str, int | None]]:
    if how == "on import":
        return [(target, None) for target in sorted(loads_on_import(module))]
    return sorted({(owner(imp.target), imp.line) for imp in imports_of(module)})


def import_chain(start: str, forbidden: tuple[str, ...], how: str, leaves: tuple[str, ...] = ()) -> list[str] | None:
    """The shortest chain of imports from ``start`` to a forbidden module (``[start:line, ..., target]``), or None;
    the start's own sub-package is not forbidden to it (the direct rules' convention); ``leaves`` are allowed and
    not followed."""
    came_from: dict[str, tuple[str, int | None] | None] = {start: None}
    queue = [start]
    while queue:
        module = queue.pop(0)
        if module != start and module not in leaves and any(under(module, f) for f in forbidden) \
                and subpackage(module) != subpackage(start):
            chain, step = [module], came_from[module]
            while step is not None:
                chain.append(f"{step[0]}:{step[1]}" if step[1] else step[0])
                step = came_from[step[0]]
            return chain[::-1]
        if module not in package_modules() or module in leaves:
            continue
        for target, line in followed(module, how):
            if target not in came_from:
                came_from[target] = (module, line)
                queue.append(target)
    return None


@pytest.mark.parametrize("who, forbidden, how, why", TRANSITIVE_RULES,
                         ids=[f"{who.split(',')[0]} -/->> {f[0]}... ({how})" for who, f, how, _ in TRANSITIVE_RULES])
def test_transitive_import_rules(who, forbidden, how, why):
    # What importing a registration loads is its own rule's (the last); the config reads them, never their builders.
    leaves = CONFIG_READS if (who == CONFIG_LAYER or how == "on import") and who != ", ".join(CONFIG_READS) else ()
    chains = [import_chain(module, forbidden, how, leaves) for module in package_modules() if applies(who, module)]
    bad = sorted(" -> ".join(chain) for chain in chains if chain)
    assert not bad, f"{why}:\n  " + "\n  ".join(bad)


def test_the_transitive_rules_follow_chains():
    """Able to fail: config_cli reaches peftlab.errors through config_roles too; records reaches the store on
    import; the resolve layer reaches the method table only through a function-level import."""
    assert import_chain("peftlab.config", ("peftlab.errors",), "every import")[0].startswith("peftlab.config:")
    assert import_chain("peftlab.lab.records", ("peftlab.lab.store",), "on import") is None  # own sub-package
    assert import_chain("peftlab.lab.records", ("peftlab.errors",), "on import") == ["peftlab.lab.records",
                                                                                     "peftlab.errors"]
    assert import_chain("peftlab.resolve", ("peftlab.methods",), "on import", CONFIG_READS) is None
    assert import_chain("peftlab.resolve", ("peftlab.methods",), "every import", CONFIG_READS)[-1] == \
        "peftlab.methods.table"
    # the registrations are leaves only where they are passed as such
    assert import_chain("peftlab.config", ("peftlab.methods",), "on import") == ["peftlab.config",
                                                                                 "peftlab.methods.registry"]
    assert "yaml" in loads_on_import("peftlab.config_cli")  # third-party packages count on import


# --------------------------------------------------------------------------- what importing a module loads


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def runs_on_import(body: list[ast.stmt]):
    """The statements of a module body that run when it is imported: also inside module-level ``if`` / ``try``
    blocks, but not under ``if TYPE_CHECKING:`` and not inside functions or classes' methods."""
    for node in body:
        if isinstance(node, ast.If):
            if not is_type_checking(node.test):
                yield from runs_on_import(node.body)
            yield from runs_on_import(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from runs_on_import(block)
        elif isinstance(node, ast.ClassDef):
            yield from runs_on_import([n for n in node.body
                                       if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))])
        else:
            yield node


def import_targets(importer: str, node: ast.stmt, is_package: bool) -> list[str]:
    """The modules an import statement loads: ``from peftlab.x import y`` is ``peftlab.x.y`` when y is a module,
    else ``peftlab.x``; outside peftlab, the top-level package (``torch`` for ``from torch.nn import Module``)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        target = resolve_from(importer, node, is_package)
        if not target.startswith("peftlab"):
            return [target.split(".")[0]]
        names = [f"{target}.{a.name}" if is_module(f"{target}.{a.name}") else target for a in node.names]
    else:
        return []
    return [name if name.startswith("peftlab") else name.split(".")[0] for name in names]


@lru_cache(maxsize=None)
def loads_on_import(module: str) -> frozenset[str]:
    """What ``import module`` imports itself (module level): peftlab modules and other top-level packages."""
    path = package_modules()[module]
    tree = ast.parse(path.read_text(), filename=str(path))
    return frozenset(target for node in runs_on_import(tree.body)
                     for target in import_targets(module, node, path.name == "__init__.py")) - {module}


def every_import(body: list[ast.stmt]):
    """Every import statement of a module, inside functions too, except under ``if TYPE_CHECKING:``."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and is_type_checking(node.test):
            yield from every_import(node.orelse)
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, field, None) or []:
                    yield from every_import([child] if isinstance(child, ast.stmt) else child.body)


def import_graph(modules: dict[str, Path] | None = None, *, lazy: bool = False) -> dict[str, set[str]]:
    """peftlab module -> the peftlab modules it imports at module level (the graph an import cycle lives in);
    ``lazy``: also those it imports inside functions."""
    modules = package_modules() if modules is None else modules
    graph = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        statements = every_import(tree.body) if lazy else runs_on_import(tree.body)
        targets = {t for node in statements for t in import_targets(module, node, path.name == "__init__.py")}
        graph[module] = {t for t in targets if t in modules and t != module}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) through every group of modules that import each other (Tarjan's strongly
    connected components; a module alone is no cycle, as self-imports are dropped)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [cycle_through(graph, group) for group in sorted(groups)]


def cycle_through(graph: dict[str, set[str]], group: list[str]) -> list[str]:
    """A shortest path from the group's first module back to itself, inside the group."""
    start, members = group[0], set(group)
    paths = {nxt: [start, nxt] for nxt in sorted(graph[start] & members)}
    queue = list(paths)
    while start not in paths:
        node = queue.pop(0)
        for nxt in sorted(graph[node] & members):
            if nxt not in paths:
                paths[nxt] = paths[node] + [nxt]
                queue.append(nxt)
    return paths[start]


def test_the_package_never_imports_the_benchmarks():
    """benchmarks/ and studies/ sit beside src/, are not installed (setuptools finds packages under src/ only) and
    drive peftlab through its public API; an import of them from the package would fail in every installed copy."""
    bad = []
    for module, path in package_modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad += [f"{module}:{node.lineno} imports {n}" for n in names
                    if under(n, "benchmarks") or under(n, "studies")]
    assert not bad, bad
    assert not (PACKAGE / "bench").exists() and (ROOT / "benchmarks" / "micro.py").is_file()
    assert not (PACKAGE / "lab" / "study_design.py").exists()
    assert (ROOT / "studies" / "fixed_rate" / "cli.py").is_file()
    assert 'where = ["src"]' in (ROOT / "pyproject.toml").read_text()


def test_no_import_cycle_between_modules():
    """Module-level imports only (a cycle through them fails or half-initialises a module, depending on which
    side is imported first); imports inside functions run after both modules are loaded."""
    cycles = import_cycles(import_graph())
    assert not cycles, "modules that import each other (move what both need into a module of its own):\n  " + (
        "\n  ".join(" -> ".join(cycle) for cycle in cycles))


def test_no_import_cycle_even_through_imports_inside_functions():
    """A lazy import still ties two modules together (each needs the other to work): none may close a cycle."""
    cycles = import_cycles(import_graph(lazy=True))
    assert not cycles, "modules that import each other, some inside functions:\n  " + (
        "\n  ".join(" -> ".join(cycle) for cycle in cycles))


def test_the_cycle_check_finds_a_cycle(tmp_path):
    """The checker is able to fail: a synthetic package whose a -> b -> c -> a (``from pkg import c`` names a
    module, ``from pkg.a import X`` a name) is reported, a function-level and a TYPE_CHECKING import are not."""
    pkg = tmp_path / "peftlab"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from peftlab.sub import b\n",
        "sub/__init__.py": "",
        "sub/b.py": "from peftlab import c\n",
        "c.py": "from peftlab.a import X\n",
        "d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from peftlab import e\n",
        "e.py": "def f():\n    from peftlab import d\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    global PACKAGE
    real = PACKAGE
    PACKAGE = pkg  # is_module and module_name read the package root
    try:
        modules = {module_name(path): path for path in sorted(pkg.rglob("*.py"))}
        graph = import_graph(modules)
        lazy = import_graph(modules, lazy=True)  # the function-level import is an edge; TYPE_CHECKING's is not
    finally:
        PACKAGE = real
    assert graph["peftlab.a"] == {"peftlab.sub.b"} and graph["peftlab.c"] == {"peftlab.a"}
    assert graph["peftlab.d"] == set() and graph["peftlab.e"] == set()
    assert import_cycles(graph) == [["peftlab.a", "peftlab.sub.b", "peftlab.c", "peftlab.a"]]
    assert lazy["peftlab.e"] == {"peftlab.d"} and lazy["peftlab.d"] == set()


def unused_module_level_imports(path: Path) -> list[str]:
    """Names a module imports at module level and never uses, unless it lists them in ``__all__`` (a declared
    re-export): what a ``noqa: F401`` shim keeps alive."""
    tree = ast.parse(path.read_text(), filename=str(path))
    imported: dict[str, int] = {}
    for node in runs_on_import(tree.body):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and not (
                isinstance(node, ast.ImportFrom) and node.module == "__future__"):
            for alias in node.names:
                imported[(alias.asname or alias.name).split(".")[0]] = node.lineno
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    used |= {n.value.id for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)}
    exported: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            exported = {elt.value for elt in node.value.elts if isinstance(elt, ast.Constant)}
    return sorted(f"{name} (line {line})" for name, line in imported.items() if name not in used | exported)


def test_no_module_keeps_an_import_it_does_not_use(tmp_path):
    """No re-export shims: an import a module does not use is either declared in its ``__all__`` (peftlab.config,
    the config layer's one import path) or removed, with its callers importing from where the name lives."""
    found = {module: names for module, path in package_modules().items()
             if path.name != "__init__.py" and (names := unused_module_level_imports(path))}
    assert not found, "module-level imports nothing in the module uses (import from where they live): " + "; ".join(
        f"{module}: {', '.join(names)}" for module, names in sorted(found.items()))
    shim = tmp_path / "shim.py"  # the check is able to fail
    shim.write_text("from os.path import join  # noqa: F401 - importable from here too\nfrom os import sep\n"
                    "__all__ = ['sep']\n")
    assert unused_module_level_imports(shim) == ["join (line 1)"]


# Private attributes of objects a module does not own, each with why no public API does it. Everything else
# (another peftlab module's _private name, a private attribute stored on a model or a library object) fails.
LIBRARY_PRIVATES = {
    ("peftlab.cli.main", "parser._actions"): "argparse has no public way to list a parser's options",
    ("peftlab.cli.main", "argparse._SubParsersAction"): "argparse: finding the subcommands for did-you-mean",
    ("peftlab.cli.main", "sub.choices[command]._option_string_actions"): "argparse: a subcommand's flags",
    ("peftlab.lab.sweep_workers", "os._exit"): "public: exit a worker without running its parent's handlers",
    ("peftlab.tasks.judge_server", "os._exit"): "public: as above",
    ("peftlab.tasks.judge_server", "super()._build_generation_config"): "an override of transformers' serve",
    ("peftlab.lab.tune.study", "frozen._trial_id"): "Optuna: re-attach a Trial to a trial another process began",
    ("peftlab.lab.tune.study", "self.study._storage"): "Optuna: user attrs of a trial this process does not hold",
    ("peftlab.models.hub", "_http._GLOBAL_CLIENT_FACTORY"): "huggingface_hub: is the client factory the user's?",
    ("peftlab.models.hub", "client._transport"): "httpx: the transport a timeout cap wraps",
    ("peftlab.models.packed_attention", "config._attn_implementation"): "transformers' own attention switch",
    ("peftlab.tasks.lm_eval_tasks", "task._filters"): "lm-eval: a task's filters (its scoring of GSM8K)",
    ("peftlab.training.compile", "torch._dynamo"): "torch.compile's configuration and its errors",
    ("peftlab.training.devices", "AcceleratorState._shared_state"): "Accelerate: one state per process, reset "
                                                                    "between runs of another precision",
    ("peftlab.training.devices", "AcceleratorState._reset_state"): "Accelerate: as above",
}


def private_attribute_uses() -> set[tuple[str, str]]:
    """(module, expression) for every ``x._name`` where x is not ``self``/``cls`` (dunders aside)."""
    found = set()
    for module, path in package_modules().items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                found.add((module, ast.unparse(node)))
    return found


def test_no_private_attributes_of_other_objects():
    """No module reads or stores a private attribute of another module or of a model or library object, except
    the library internals listed with their reason (and every listed one is still in use)."""
    found = private_attribute_uses()
    assert not found - LIBRARY_PRIVATES.keys(), "private attributes of objects a module does not own: " + ", ".join(
        f"{module}: {expr}" for module, expr in sorted(found - LIBRARY_PRIVATES.keys()))
    assert not LIBRARY_PRIVATES.keys() - found, f"listed but no longer used: {sorted(LIBRARY_PRIVATES.keys() - found)}"


def test_every_module_is_small():
    sizes = {module: len(path.read_text().splitlines()) for module, path in package_modules().items()}
    big = {module: n for module, n in sizes.items() if n > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines (split them by what they do): " + ", ".join(
        f"{m} ({n})" for m, n in sorted(big.items(), key=lambda item: -item[1]))


def test_every_function_is_short():
    long = []
    for module, path in package_modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{module}.{node.name} ({lines})")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them into steps with names): " + ", ".join(long)


def test_the_package_stays_within_its_line_budget():
    total = sum(len(path.read_text().splitlines()) for path in package_modules().values())
    assert total <= MAX_PACKAGE_LINES, f"src/peftlab has {total} lines, over its ceiling of {MAX_PACKAGE_LINES}"


def code_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, stripped text) of the lines that carry code: no blanks, comments, docstring lines or imports,
    and no argparse declarations (the boilerplate every subcommand's parser shares)."""
    tree = ast.parse(path.read_text())
    skipped = set()
    for node in ast.walk(tree):
        docstring = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(
            node.value.value, str)
        if docstring or isinstance(node, (ast.Import, ast.ImportFrom)):
            skipped.update(range(node.lineno, node.end_lineno + 1))
    boilerplate = ("add_argument", "add_parser", "set_defaults", "add_argument_group", "add_mutually_exclusive")
    return [(number, text.strip()) for number, text in enumerate(path.read_text().splitlines(), 1)
            if number not in skipped and text.strip() and not text.strip().startswith("#")
            and not any(word in text for word in boilerplate)]


def test_no_block_of_code_is_written_twice():
    """No run of REPEAT_LINES code lines (as :func:`code_lines` counts them) stands twice in src/peftlab; runs of
    closing brackets or bare keywords are too thin to count."""
    seen: dict[tuple[str, ...], str] = {}
    repeats: dict[tuple[str, str], str] = {}
    for module, path in package_modules().items():
        lines = code_lines(path)
        for start in range(len(lines) - REPEAT_LINES + 1):
            window = tuple(text for _, text in lines[start:start + REPEAT_LINES])
            if sum(len(text) > 12 for text in window) < REPEAT_LINES - 1:
                continue
            where = f"{module}:{lines[start][0]}"
            first = seen.setdefault(window, where)
            other_module, first_line = first.rsplit(":", 1)
            if first != where and (other_module != module or lines[start][0] - int(first_line) >= REPEAT_LINES):
                repeats.setdefault((other_module, module), f"{first} ~ {where}")  # the first run of each pair
    assert not repeats, f"blocks of {REPEAT_LINES} lines written twice (make one function): " + "; ".join(
        repeats.values())


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
        from peftlab.lab.tune.spec import load_tune_spec

        load_tune_spec(path, output_dir=str(tmp_path / "runs"))
        assert not (tmp_path / "runs").exists()
    else:
        from peftlab.cli.main import build_parser
        from peftlab.training.loop import config_from_args

        argv = ["train", "--config", str(path)]
        cfg = config_from_args(build_parser(argv).parse_args(argv))
        assert cfg.task and cfg.model and cfg.method
