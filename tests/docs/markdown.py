"""The repository's Markdown, read for the documentation tests: which files, their code blocks, their links."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def doc_files() -> list[Path]:
    """README.md, CONTRIBUTING.md and every page under docs/ (the pages a user reads)."""
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]


def linked_files() -> list[Path]:
    """Every Markdown file whose links are checked: the pages above and the other READMEs of the repository."""
    extra = [ROOT / "bench" / "README.md", *sorted((ROOT / "examples").rglob("README.md"))]
    return doc_files() + [p for p in extra if p.exists()]


_FENCE = re.compile(r"^(\s*)(```|~~~)(.*)$")


def code_blocks(path: Path) -> Iterator[tuple[int, str, list[str]]]:
    """(line number of the first line, info string, lines) of every fenced code block of ``path``."""
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info = m.group(2), m.group(3).strip()
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            body.append(lines[j])
            j += 1
        yield i + 2, info, body
        i = j + 1


def prose(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, line) of every line of ``path`` outside fenced code blocks."""
    inside = None
    for n, line in enumerate(path.read_text().splitlines(), 1):
        m = _FENCE.match(line)
        if m and (inside is None or line.strip().startswith(inside)):
            inside = None if inside else m.group(2)
            continue
        if inside is None:
            yield n, line


_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def links(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, target) of every inline Markdown link and image of ``path``, code spans left out."""
    for n, line in prose(path):
        for m in _LINK.finditer(re.sub(r"`[^`]*`", "", line)):
            yield n, m.group(1)


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"`", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(line.lstrip("#")) for _, line in prose(path) if re.match(r"#{1,6} ", line)}
