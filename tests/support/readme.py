"""The README's code blocks and the ``diloco`` commands in them, in order."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def diloco_commands() -> list[str]:
    return [command for block in code_blocks("bash") for command in commands_in(block)]


def own_data_commands() -> list[str]:
    """The ``diloco`` commands of the "Your data" steps (the ``shell`` block that prepares a corpus)."""
    return commands_in(next(block for block in code_blocks("shell") if "diloco prepare" in block))


def commands_in(block: str) -> list[str]:
    """The block's ``diloco`` commands, without their comments."""
    commands = [line.split("  #")[0].strip() for line in block.splitlines()]
    return [command for command in commands if command.startswith("diloco ")]
