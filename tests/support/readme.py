"""The README's code blocks and the ``diloco`` commands in them, in order."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def diloco_commands() -> list[str]:
    commands = []
    for block in code_blocks("bash"):
        for line in block.splitlines():
            command = line.split("  #")[0].strip()
            if command.startswith("diloco "):
                commands.append(command)
    return commands
