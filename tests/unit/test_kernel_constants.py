"""The C kernels and the Python codecs state their shared constants once each, and agree:
every constant a codec's module (``kernel_constants``, ``fold_kind``) or the codec as a
whole (``quantize.KERNEL_CONSTANTS``) states is read from ``_kernels.c`` and compared, and
every merge-kernel format (``KIND_*``) of the C source belongs to a registered codec."""

import ast
import operator
import re
import struct

from diloco_cli.codec import Codec, quantize
from diloco_cli.codec.build import SOURCE
from diloco_cli.codec.registry import codec_named

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _value(expression: str) -> float:
    """A C constant expression of numbers, + - * / and parentheses (``3.0e38f``: a float,
    rounded to fp32 as C rounds it)."""
    single = bool(re.search(r"\d[fF]$", expression.strip()))
    tree = ast.parse(re.sub(r"(\d)[fF]\b", r"\1", expression), mode="eval").body

    def evaluate(node: ast.AST) -> float:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -evaluate(node.operand)
        if isinstance(node, ast.BinOp):
            return _OPERATORS[type(node.op)](evaluate(node.left), evaluate(node.right))
        raise ValueError(f"not a constant expression: {expression}")

    value = evaluate(tree)
    return _fp32(value) if single else value


def _fp32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]


def c_constants(source: str) -> dict[str, float]:
    """The enumerators and the ``static const`` numbers of a C source, by name."""
    constants = {}
    for body in re.findall(r"enum\s*\{([^}]*)\}", source):
        for name, expression in re.findall(r"(\w+)\s*=\s*([^,]+)", body):
            constants[name] = _value(expression)
    for name, expression in re.findall(r"static const (?:float|double|int) (\w+)\s*=\s*([^;]+);", source):
        constants[name] = _value(expression)
    return constants


def python_constants() -> dict[str, float]:
    """What the Python side states of the kernels' constants."""
    stated = dict(quantize.KERNEL_CONSTANTS)
    for codec in Codec:
        implementation = codec_named(codec)
        stated.update(implementation.kernel_constants)
        if implementation.fold_kind is not None:
            stated[f"KIND_{codec.value.upper()}"] = implementation.fold_kind
    return stated


def disagreements(source: str) -> list[str]:
    constants = c_constants(source)
    stated = python_constants()
    wrong = [
        f"{name}: {value!r} in Python, {constants.get(name, 'absent')!r} in _kernels.c"
        for name, value in stated.items()
        if constants.get(name) not in (value, _fp32(value))  # a float constant of C is fp32, as torch compares it
    ]
    wrong += [
        f"{name}: a merge-kernel format of no codec"
        for name in constants
        if name.startswith("KIND_") and name not in stated
    ]
    return wrong


def test_the_python_codecs_state_the_kernels_constants_as_the_c_source_does():
    source = SOURCE.read_text()
    assert {"MAX_ABSMAX", "MAX_TILE", "INT4_MAX_BLOCK", "INT2_SCALE_OF_MEAN", "KIND_INT2"} <= set(c_constants(source))
    assert disagreements(source) == []


def test_a_constant_changed_on_one_side_only_is_named():
    source = SOURCE.read_text()
    assert source.count("INT4_LEVELS = 7") == 1 and source.count("KIND_INT2 = 4") == 1
    changed = source.replace("INT4_LEVELS = 7", "INT4_LEVELS = 6").replace(
        "KIND_INT2 = 4", "KIND_INT2 = 4, KIND_INT3 = 5"
    )
    assert disagreements(changed) == [
        "INT4_LEVELS: 7 in Python, 6 in _kernels.c",
        "KIND_INT3: a merge-kernel format of no codec",
    ]
    assert c_constants("static const float X = 3.0e38f;")["X"] != 3.0e38  # rounded to fp32, as C does
