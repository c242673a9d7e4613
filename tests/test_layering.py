"""The package's imports run one way: no module imports from a layer above its own.

The layers, lowest first, are stated once, as ``LAYERS`` in ``gradhooks/__init__.py``: each is
a folder of the package (``base``, ``rules``, ``core``, ``readers``, ``tools``,
``integrations``) or ``api``, the modules at the package's top (the facade); the package's
``__init__`` and ``__main__`` may import anything. Each folder's ``__init__.py`` says in words
what lives there and what it may import; this test holds the code to it, by parsing the source
(nothing is imported, so optional dependencies do not matter). It also fails on an import
cycle between modules and on an import inside a function (the way a cycle is usually hidden).
"""
import ast
import importlib
import os
import sys
from typing import Dict, List, Set, Tuple

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gradhooks")
TOP = ("__init__", "__main__")


def _modules() -> Dict[str, str]:
    """``{dotted module name relative to gradhooks ('' for the package): file path}``."""
    found = {}
    for folder, _, files in os.walk(ROOT):
        rel = os.path.relpath(folder, ROOT)
        parts = [] if rel == "." else rel.split(os.sep)
        if "__pycache__" in parts:
            continue
        for f in files:
            if not f.endswith(".py"):
                continue
            stem = f[:-3]
            name = ".".join(parts if stem == "__init__" else parts + [stem])
            found[name] = os.path.join(folder, f)
    return found


MODULES = _modules()


def _layers() -> Tuple[str, ...]:
    tree = ast.parse(open(MODULES[""]).read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "LAYERS"
                                                 for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise AssertionError("gradhooks/__init__.py states no LAYERS")


LAYERS = _layers()


def _layer(module: str) -> str:
    """The layer of a module: its top folder, ``api`` for the package's own modules, ``top``
    for its ``__init__`` / ``__main__``."""
    if module in ("", "__main__"):
        return "top"
    head = module.split(".")[0]
    return head if head in LAYERS else "api"


def _is_module(name: str) -> bool:
    return name in MODULES


def _imports(module: str) -> Tuple[Set[str], List[str]]:
    """The package modules ``module`` imports at its top level, and the places where it
    imports inside a function or class."""
    path = MODULES[module]
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    tree = ast.parse(open(path).read())
    out, nested = set(), []
    top_level = {id(n) for n in tree.body}
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        targets = []
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".") if package else []
            base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
            stem = ".".join(base + ([node.module] if node.module else []))
            stem = stem.strip(".")
            for alias in node.names:
                sub = f"{stem}.{alias.name}".strip(".")
                targets.append(sub if _is_module(sub) else stem)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gradhooks"):
            stem = node.module[len("gradhooks"):].strip(".")
            for alias in node.names:
                sub = f"{stem}.{alias.name}".strip(".")
                targets.append(sub if _is_module(sub) else stem)
        elif isinstance(node, ast.Import):
            targets = [a.name[len("gradhooks"):].strip(".") for a in node.names
                       if a.name == "gradhooks" or a.name.startswith("gradhooks.")]
        if not targets:
            continue
        if id(node) not in top_level and not _type_checking_only(tree, node):
            nested.append(f"{module}:{node.lineno}")
        out.update(t for t in targets if t in MODULES)
    return out, nested


def _type_checking_only(tree, node) -> bool:
    for block in tree.body:
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.dump(block.test):
            if any(n is node for n in ast.walk(block)):
                return True
    return False


GRAPH = {m: _imports(m) for m in MODULES}


def test_every_folder_is_a_layer_and_says_what_it_may_import():
    folders = {m.split(".")[0] for m in MODULES if "." in m or os.path.isdir(os.path.join(ROOT, m))}
    folders.discard("")
    assert folders <= set(LAYERS), f"folders not in LAYERS: {folders - set(LAYERS)}"
    for layer in LAYERS:
        if layer == "api":
            continue
        assert layer in MODULES, f"LAYERS names {layer!r}, which is no folder of the package"
        doc = ast.get_docstring(ast.parse(open(MODULES[layer]).read())) or ""
        assert "may import" in doc.lower(), f"gradhooks/{layer}/__init__.py does not say what it may import"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _layer(m) != "top"))
def test_no_module_imports_from_a_layer_above_its_own(module):
    own = LAYERS.index(_layer(module))
    above = sorted(t for t in GRAPH[module][0]
                   if _layer(t) == "top" or LAYERS.index(_layer(t)) > own)
    assert not above, (f"gradhooks.{module} (layer {_layer(module)!r}) imports "
                       f"{['gradhooks.' + t for t in above]} from layers above it")



#: The parts of a layer (its sub-folders) and the other parts of the same layer each may import
#: (issue 41). ``""``: the modules at the layer's top (the readers' per-sample basics, which
#: every use shares and which import no use). A layer not named here has no parts.
PARTS = {
    "readers": {"": (), "dp": (), "curvature": (), "attribution": ("curvature",)},
    "core": {"analysis": (), "recorder": ("analysis",)},
}
#: Parts reached from outside only through their package's ``__init__`` (one interface).
INTERFACES = ("core.analysis",)


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in PARTS.get(parts[0], {})) else ""


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _layer(m) in PARTS and m not in PARTS))
def test_a_part_imports_only_the_parts_it_builds_on(module):
    layer, part = _layer(module), _part(module)
    allowed = {part, *PARTS[layer][part]} | ({""} if "" in PARTS[layer] else set())
    wrong = sorted(t for t in GRAPH[module][0] if _layer(t) == layer and t != layer
                   and _part(t) not in allowed)
    assert not wrong, (f"gradhooks.{module} (part {part or 'top'!r} of {layer!r}) imports "
                       f"{['gradhooks.' + t for t in wrong]}: parts it does not build on")


@pytest.mark.parametrize("module", sorted(MODULES))
def test_an_interface_is_the_only_way_in(module):
    inside = sorted(t for t in GRAPH[module][0] for i in INTERFACES
                    if t.startswith(i + ".") and not (module == i or module.startswith(i + ".")))
    assert not inside, (f"gradhooks.{module} imports {['gradhooks.' + t for t in inside]}: "
                        f"import from the package's interface ({INTERFACES}) instead")


def test_every_part_says_what_it_may_import():
    for layer, parts in PARTS.items():
        for part in parts:
            doc = ast.get_docstring(ast.parse(open(MODULES[f"{layer}.{part}".strip(".")]).read()))
            assert "may import" in (doc or "").lower(), f"gradhooks.{layer}.{part}: says nothing"


def test_no_import_inside_a_function():
    nested = [place for m in MODULES for place in GRAPH[m][1]]
    assert not nested, f"imports inside functions or classes: {nested}"


def test_no_import_cycle():
    # Package __init__ files that only gather their folder's modules import downwards; an edge
    # from a module to the package it lives in is the cycle Python resolves half-way: forbidden.
    state: Dict[str, int] = {}
    cycle: List[str] = []

    def visit(m: str, path: List[str]) -> bool:
        state[m] = 1
        for t in sorted(GRAPH[m][0]):
            if t == m:
                continue
            if state.get(t) == 1:
                cycle.extend(path[path.index(t):] + [m, t] if t in path else [m, t])
                return True
            if state.get(t) is None and visit(t, path + [m]):
                return True
        state[m] = 2
        return False

    for m in sorted(MODULES):
        if state.get(m) is None and visit(m, []):
            break
    assert not cycle, f"import cycle: {' -> '.join(cycle)}"


#: The sizes past which a module or a class holds more than one idea (issue 26: "no module is
#: above about 600 lines and no class above about 400"); split by responsibility, not by count.
MODULE_LINES, CLASS_LINES = 600, 400


def test_no_module_or_class_outgrows_one_idea():
    big = []
    for name, path in MODULES.items():
        source = open(path).read()
        if source.count("\n") > MODULE_LINES:
            big.append(f"gradhooks.{name}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > CLASS_LINES:
                big.append(f"gradhooks.{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not big, big

def test_no_old_module_paths():
    """The package has never been released under its pre-folder module paths: no finder or table
    keeps them alive (issue 41), and ``gradhooks.kfac`` is the one-call function.
    (The only test here that imports the package: the others read its source.)"""
    import gradhooks
    assert not hasattr(gradhooks, "RENAMED")
    assert not any(type(f).__name__ == "_RenamedModules" for f in sys.meta_path)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("gradhooks.norms")
    assert callable(gradhooks.kfac)
    # the one public module name: gradhooks.attribution, also as a module path
    assert importlib.import_module("gradhooks.attribution") is gradhooks.attribution


#: Where torch's (and CPython's) internals are read: the one module that lists each with the
#: torch versions it was checked on (tests/test_torch_internals.py checks each by behaviour).
TORCH_INTERNALS = "base.torch_internals"
#: namedtuple's public API (its methods start with "_" so as not to clash with field names).
NAMEDTUPLE_API = frozenset({"_replace", "_asdict", "_make", "_fields", "_field_defaults"})
PRIVATE_READS_LIMIT = 20


def private_reads() -> List[Tuple[str, int, str]]:
    """Every read (or write) of another object's private attribute in the package, as
    ``(module, line, expression)``, found by parsing (nothing is imported).

    The rule: an attribute node ``x._name`` (one leading underscore; dunders are Python's
    protocol) counts unless ``x`` is ``self`` or ``cls`` (an object's own state), ``x`` is a
    class defined in the same module (a class's own methods, e.g. handed to a hook registry),
    or ``_name`` is namedtuple's public API (``_replace``, ``_asdict``, ``_make``, ``_fields``,
    ``_field_defaults``). ``base/torch_internals.py``, the module that names every torch
    internal read, is not counted.
    """
    hits = []
    for module, path in sorted(MODULES.items()):
        if module != TORCH_INTERNALS:
            with open(path) as f:
                hits += [(module, line, expr) for line, expr in _private_reads_in(f.read())]
    return hits


def _private_reads_in(source: str) -> List[Tuple[int, str]]:
    tree = ast.parse(source)
    classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    hits = []
    for n in ast.walk(tree):
        if not (isinstance(n, ast.Attribute) and n.attr.startswith("_")
                and not n.attr.startswith("__")) or n.attr in NAMEDTUPLE_API:
            continue
        v = n.value
        if isinstance(v, ast.Name) and (v.id in ("self", "cls") or v.id in classes):
            continue
        hits.append((n.lineno, ast.unparse(n)[:80]))
    return hits


def test_private_read_rule():
    """The counting rule on a sample: another object's private attributes (read or written)
    count; self's, cls's, the module's own classes', dunders and namedtuple's API do not."""
    source = ("class A:\n    def f(self, other, t):\n        self._x, cls._y, A._z, t.__dict__\n"
              "        other._x = t._version\n        return t._replace(a=1), sys._getframe()\n")
    assert [e for _, e in _private_reads_in(source)] == ["other._x", "t._version", "sys._getframe"]


def test_private_reads_are_few():
    """gradhooks' own objects expose what other modules need through public names, and torch
    internals are read through gradhooks/base/torch_internals.py: fewer than
    PRIVATE_READS_LIMIT private reads elsewhere (:func:`private_reads` states the rule)."""
    hits = private_reads()
    listed = "\n".join(f"gradhooks/{m.replace('.', '/')}.py:{line}: {expr}" for m, line, expr in hits)
    assert len(hits) < PRIVATE_READS_LIMIT, f"{len(hits)} private reads:\n{listed}"
