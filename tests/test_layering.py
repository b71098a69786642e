"""One direction of dependencies and no import cycles, read from the source (ast), then every
module imported for real.

The layers (a folder may import its own modules and those its rule names, nothing else of the repository):

    kernels/, data/          nothing of the repository (and not each other)
    model/                   kernels/
    train/                   model/, kernels/, data/
    launchers/               train/ and what train/ may import
    experiments/             the library: kernels/, data/, model/, train/, launchers/
    benchmarks/              the library and experiments/
    tools/                   the library, experiments/ and benchmarks/ (the GPU validation kit runs
                             the study and builds the benchmarks' photo shards)

Every import counts: inside functions too (a lazy import is still a dependency), and
`from X import Y` names the submodule X.Y when Y is one.
"""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LIBRARY = ("kernels", "data", "model", "train", "launchers")
ON_TOP = ("experiments", "tools", "benchmarks")
ALLOWED = {
    "kernels": set(),
    "data": set(),
    "model": {"kernels"},
    "train": {"model", "kernels", "data"},
    "launchers": {"train", "model", "kernels", "data"},
    "experiments": set(LIBRARY),
    "benchmarks": {*LIBRARY, "experiments"},
    "tools": {*LIBRARY, "experiments", "benchmarks"},
}
# train/'s rooms in their order: each may import its own modules and the rooms before it. The
# commands at train/'s top (pretrain.py, export.py, ...) may import every room; no room imports a
# command, and nothing outside train/ names a room's module through a command.
ROOMS = ("config", "engine", "weights", "estimate", "run")
# Packages that only exist (or only build) on CUDA machines: a module needing one is skipped by the
# import check, with its name printed.
CUDA_ONLY = {"flash_attn", "apex"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_modules() -> dict[str, Path]:
    """Dotted name -> file of every .py file of the layered folders."""
    return {module_name(p): p for top in (*LIBRARY, *ON_TOP) for p in sorted((REPO / top).rglob("*.py"))}


def resolve(name: str, known: dict[str, Path]) -> str | None:
    """The most specific module of the repository that `name` (a.b.c) refers to, None outside it."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in known:
            return ".".join(parts[:n])
    return None


def imports(module: str, path: Path, known: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported module of the repository, line) for every import statement in the file."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from .x import y / from .. import y
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # `from X import Y` imports the submodule X.Y when Y is one, else X itself
            names = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source
                     for alias in node.names]
        else:
            continue
        for name in names:
            target = resolve(name, known)
            if target is not None and target != module and (target, node.lineno) not in found:
                found.append((target, node.lineno))
    return sorted(found, key=lambda t: t[1])


def unknown_imports(path: Path, known: dict[str, Path]) -> list[tuple[str, int]]:
    """(name, line) of absolute imports of a repository folder's module that does not exist (a
    stale path after a move: `import train.study`), which `imports` would count as its package."""
    tops = {name.split(".")[0] for name in known}
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module]  # `from X import Y`: X must be a module, Y may be an attribute
        else:
            continue
        found += [(name, node.lineno) for name in names if name.split(".")[0] in tops and name not in known]
    return sorted(found, key=lambda t: t[1])


def graph() -> tuple[dict[str, Path], dict[str, list[tuple[str, int]]]]:
    known = source_modules()
    return known, {m: imports(m, p, known) for m, p in known.items()}


def find_cycle(edges: dict[str, list[tuple[str, int]]]) -> list[str] | None:
    """A cycle of the module graph as [a, b, ..., a], or None (depth-first search, iterative)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    for start in sorted(edges):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted({t for t, _ in edges[start]}))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted({t for t, _ in edges.get(nxt, [])})))
    return None


def test_the_cycle_finder_finds_a_cycle_and_the_parser_counts_lazy_and_submodule_imports(tmp_path):
    edges = {"a": [("b", 1)], "b": [("c", 1)], "c": [("a", 3), ("d", 4)], "d": []}
    assert find_cycle(edges) == ["a", "b", "c", "a"]
    assert find_cycle({**edges, "c": [("d", 4)]}) is None
    source = tmp_path / "train" / "x.py"
    source.parent.mkdir()
    source.write_text("import os\nfrom model import vit\n\ndef f():\n    from launchers.slurm import main\n"
                      "    import kernels.masked\nfrom . import y\n")
    known = {"train.x": source, "train.y": tmp_path, "model": tmp_path, "model.vit": tmp_path,
             "launchers.slurm": tmp_path, "kernels": tmp_path, "kernels.masked": tmp_path}
    assert imports("train.x", source, known) == [("model.vit", 2), ("launchers.slurm", 5), ("kernels.masked", 6),
                                                  ("train.y", 7)]


def test_no_import_cycle():
    _, edges = graph()
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_every_import_of_the_repository_names_an_existing_module():
    known = source_modules()
    stale = [f"{path.relative_to(REPO)}:{line}: no module {name}"
             for module, path in sorted(known.items()) for name, line in unknown_imports(path, known)]
    assert not stale, "\n".join(stale)


def test_imports_run_down_the_layers_only():
    known, edges = graph()
    offending = []
    for module, targets in sorted(edges.items()):
        layer = module.split(".")[0]
        for target, line in targets:
            other = target.split(".")[0]
            if other != layer and other not in ALLOWED[layer]:
                offending.append(f"{known[module].relative_to(REPO)}:{line}: {layer}/ imports {target} ({other}/)")
    assert not offending, "imports against the layers (" + ", ".join(
        f"{k} -> {sorted(v) or 'nothing'}" for k, v in ALLOWED.items()) + "):\n" + "\n".join(offending)


def test_every_module_imports():
    """Each module of the library, experiments/ and tools/ imports in this process (benchmarks/ holds
    scripts that run when imported). CUDA-only packages are the one accepted reason to fail."""
    names = [m for m, p in source_modules().items() if m.split(".")[0] in (*LIBRARY, "experiments", "tools")]
    skipped, failed = [], []
    for name in names:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] in CUDA_ONLY:
                skipped.append(f"{name} (needs {e.name})")
            else:
                failed.append(f"{name}: {type(e).__name__}: {e}")
        except Exception as e:  # noqa: BLE001 - every failure is listed, not only the first
            failed.append(f"{name}: {type(e).__name__}: {e}")
    if skipped:
        print("skipped, CUDA-only packages missing:", ", ".join(skipped))
    assert not failed, "\n".join(failed)
    assert len(names) - len(skipped) > 50  # the walk found the packages


def room_of(module: str) -> str | None:
    """train.<room>.x -> <room>; a command at train/'s top -> "command"; outside train/: None."""
    parts = module.split(".")
    if parts[0] != "train":
        return None
    return parts[1] if len(parts) > 2 or parts[1:] and parts[1] in ROOMS else ("command" if len(parts) > 1 else "train")


def test_train_holds_only_commands_and_rooms():
    top = sorted(p.name for p in (REPO / "train").iterdir() if p.name != "__pycache__")
    rooms = [p for p in top if (REPO / "train" / p).is_dir()]
    assert sorted(rooms) == sorted([*ROOMS, "configs"]), rooms  # configs: the presets (JSON)
    commands = [p for p in top if p.endswith(".py") and p != "__init__.py"]
    assert all('if __name__ == "__main__":' in (REPO / "train" / c).read_text() for c in commands), commands


def test_train_rooms_import_down_their_order_only():
    """config < engine < weights < estimate < run < the commands: an arrow the other way, or from a
    room to a command, fails here; train/__init__.py's docstring draws the same order."""
    known, edges = graph()
    offending = []
    for module, targets in sorted(edges.items()):
        mine = room_of(module)
        if mine not in ROOMS:
            continue
        for target, line in targets:
            theirs = room_of(target)
            if theirs is None or theirs == mine or theirs == "train":
                continue
            if theirs == "command" or ROOMS.index(theirs) > ROOMS.index(mine):
                offending.append(f"{known[module].relative_to(REPO)}:{line}: train/{mine}/ imports {target}")
    assert not offending, f"imports against train/'s rooms ({' < '.join(ROOMS)} < commands):\n" + "\n".join(offending)


def test_the_room_order_is_the_one_train_says():
    doc = importlib.import_module("train").__doc__
    assert [line.split()[0].rstrip("/") for line in doc.splitlines() if line.startswith("    ") and "/" in line.split()[0]] \
        == list(ROOMS)


@pytest.mark.parametrize("layer", LIBRARY + ON_TOP)
def test_every_layer_folder_exists(layer):
    assert (REPO / layer).is_dir()  # a renamed folder would silently drop out of the rule
