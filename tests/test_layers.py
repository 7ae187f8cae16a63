"""The layers hold: no module imports from a layer above its own (lazy imports too).

From the bottom: the pure algorithm, the codec, configuration, the store protocol (with
the resolved run), the model and training loop, the runtimes, then launching and views
side by side (launch acts and returns data, views only render; neither imports the
other), and the thin CLI on top, which parses and wires the two.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "diloco_cli"
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


def imported_packages(path: Path) -> set[str]:
    """The diloco_cli subpackages a module imports from, anywhere in it (but in an
    ``if TYPE_CHECKING:`` block: annotations name types, they call nothing)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            node.body = []
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("diloco_cli."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {alias.name.split(".")[1] for alias in node.names if alias.name.startswith("diloco_cli.")}
    return found


def test_no_module_imports_from_a_layer_above_its_own():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if len(relative.parts) < 2:  # __init__, __main__: the package's doors
            continue
        own = relative.parts[0]
        for package in imported_packages(path) - {own}:
            if LAYERS[package] >= LAYERS[own]:
                wrong.append(
                    f"{relative} ({own}, layer {LAYERS[own]}) imports diloco_cli.{package} (layer {LAYERS[package]})"
                )
    assert not wrong, "\n".join(wrong)


def test_every_subpackage_has_a_layer():
    packages = {path.name for path in PACKAGE.iterdir() if path.is_dir() and (path / "__init__.py").exists()}
    assert packages <= set(LAYERS), packages - set(LAYERS)
