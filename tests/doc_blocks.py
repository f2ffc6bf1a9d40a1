"""The fenced code blocks of README.md and docs/*.md, and the shell commands in them."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHELL = ("bash", "sh", "shell", "console")
_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository
    line: int  # 1-based line of the opening fence
    lang: str
    text: str


@dataclass(frozen=True)
class Command:
    path: str
    line: int  # 1-based line where the command starts
    text: str  # the line as written (continuations joined, a trailing comment kept)
    argv: tuple[str, ...]  # shlex words of one simple command (no `&&` inside)
    chain: tuple[tuple[str, ...], ...]  # every simple command of its `a && b && c` line

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def blocks(path: Path) -> list[Block]:
    text = path.read_text()
    rel = str(path.relative_to(REPO))
    return [Block(rel, text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2))
            for m in _FENCE.finditer(text)]


def all_blocks() -> list[Block]:
    return [b for p in doc_files() for b in blocks(p)]


def commands(block: Block) -> list[Command]:
    """One Command per logical line of a shell block (backslash continuations joined)."""
    out = []
    lines = block.text.splitlines()
    i = 0
    while i < len(lines):
        start = i
        line = lines[i]
        while line.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line.rstrip()[:-1] + " " + lines[i].strip()
        i += 1
        words = shlex.split(line, comments=True)
        if not words:
            continue
        chain, cur = [], []
        for w in words:
            if w == "&&":
                chain.append(tuple(cur))
                cur = []
            else:
                cur.append(w)
        chain.append(tuple(cur))
        text = line.strip()
        for argv in chain:
            out.append(Command(block.path, block.line + 1 + start, text, argv, tuple(chain)))
    return out


def shell_commands() -> list[Command]:
    return [c for b in all_blocks() if b.lang in SHELL for c in commands(b)]
