"""The layers hold: no module imports from a layer above its own (lazy imports too).

From the bottom: the pure algorithm, the codec, configuration, the store protocol (with
the resolved run), the model and training step, data, the runtimes, then launching and
views side by side, and the thin CLI on top, which parses and wires the two.  Launch acts
(starts processes, writes runs) and returns data; views read what a run left (its
buckets, through the store) and render it, and never act; neither imports the other.

Every module counts: those of the package root too (its doors: ``diloco_cli.join``,
``python -m diloco_cli``), and imports made by name with ``importlib.import_module``
(a dotted ``diloco_cli.…`` string in a module that imports by name).  A ``module:attr``
string (a recipe's model factory or loss) is data the user may change, not an import.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "diloco_cli"
LAYERS = {
    "core": 0,
    "simulate": 0,  # the goodput simulation: pure, imports no other layer
    "codec": 1,
    "config": 2,
    "store": 3,
    "models": 3,
    "training": 3,
    "data": 3.5,  # corpora, text batches, token datasets (through the store's filesystems), a learner's data
    "bandwidth": 4,
    "runtime": 4,
    "launch": 5,
    "views": 5,
    "cli": 6,
}
ROOT_MODULES = {
    "__init__": 4.5,  # diloco_cli.join: a user's loop joins a run (the runtime)
    "hf_trainer": 4.5,  # the documented import of the Trainer callback (the runtime)
    "__main__": 7,  # python -m diloco_cli: the CLI
}


def imported_packages(path: Path) -> set[str]:
    """The diloco_cli subpackages or root modules a module imports from, anywhere in it
    (but in an ``if TYPE_CHECKING:`` block: annotations name types, they call nothing)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            node.body = []
    names: list[str] = []
    imports_by_name = False
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.Attribute) and node.attr == "import_module":
            imports_by_name = True
    if imports_by_name:
        strings = (node.value for node in ast.walk(tree) if isinstance(node, ast.Constant))
        names += [text for text in strings if isinstance(text, str) and ":" not in text and " " not in text]
    return {name.split(".")[1] for name in names if name.startswith("diloco_cli.") and len(name.split(".")) > 1}


def layer_of(package: str) -> float:
    return LAYERS[package] if package in LAYERS else ROOT_MODULES[package]


def test_no_module_imports_from_a_layer_above_its_own():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        own = relative.parts[0] if len(relative.parts) > 1 else path.stem
        for package in imported_packages(path) - {own}:
            if layer_of(package) >= layer_of(own):
                above = f"diloco_cli.{package} (layer {layer_of(package)})"
                wrong.append(f"{relative} ({own}, layer {layer_of(own)}) imports {above}")
    assert not wrong, "\n".join(wrong)


def test_every_module_has_a_layer():
    packages = {path.name for path in PACKAGE.iterdir() if path.is_dir() and (path / "__init__.py").exists()}
    assert packages <= set(LAYERS), packages - set(LAYERS)
    modules = {path.stem for path in PACKAGE.glob("*.py")}
    assert modules <= set(ROOT_MODULES), modules - set(ROOT_MODULES)


def test_imports_by_name_and_root_modules_are_checked(tmp_path):
    """The checker sees an import made with importlib and one made by a root module."""
    by_name = tmp_path / "lazy.py"
    by_name.write_text('import importlib\nLAZY = {"x": "diloco_cli.cli.app"}\nimportlib.import_module(LAZY["x"])\n')
    assert imported_packages(by_name) == {"cli"}
    factory = tmp_path / "factory.py"
    factory.write_text('import importlib\nDEFAULT = "diloco_cli.models.gpt:byte_gpt"\nimportlib.import_module("x")\n')
    assert imported_packages(factory) == set()
    assert layer_of("__init__") < layer_of("launch") and layer_of("__main__") > layer_of("cli")


REPOSITORY = PACKAGE.parent
APART = {
    "bench": {"tests"},  # the benchmarks share the stand-ins through testbed, not the tests' helpers
    "testbed": {"tests", "bench"},  # the stand-ins serve both and reach into neither
    "diloco_cli": {"tests", "bench", "testbed"},  # the product knows none of them
}


def top_level_imports(path: Path) -> set[str]:
    """The top-level packages a module imports, anywhere in it (lazy imports too), and those
    it runs as ``python -m`` (a dotted string starting with a top-level package)."""
    tree = ast.parse(path.read_text())
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and " " not in node.value:
            if node.value.split(".")[0] in APART and "." in node.value and "/" not in node.value:
                names.append(node.value)
    return {name.split(".")[0] for name in names}


def test_benchmarks_testbed_and_product_stay_apart():
    """bench/ imports nothing from tests/ (what both need lives in testbed/), testbed/ imports
    neither, and diloco_cli/ imports none of the three."""
    wrong = []
    for top, forbidden in APART.items():
        for path in sorted((REPOSITORY / top).rglob("*.py")):
            for package in top_level_imports(path) & forbidden:
                wrong.append(f"{path.relative_to(REPOSITORY)} imports {package}")
    assert not wrong, "\n".join(wrong)


def test_the_apart_check_sees_lazy_imports_and_module_runs(tmp_path):
    lazy = tmp_path / "lazy.py"
    lazy.write_text('def f():\n    from tests.support.runs import x\n    return ["-m", "tests.fuzz"]\n')
    assert top_level_imports(lazy) == {"tests"}
