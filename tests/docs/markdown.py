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


# -- command lines -------------------------------------------------------------------------------------------

_COMMAND = re.compile(r"^(?:\$\s+)?(?:ExecStart=)?(?:\S*/)?"
                      r"(rallypoint(?=\s|$)|python3?\s+-m\s+rallypoint\.cluster\.daemons(?=\s))")


def command_lines(path: Path) -> Iterator[tuple[int, str, str]]:
    """(line number, program, arguments) of every command line in ``path``'s code blocks that runs the
    ``rallypoint`` command (program ``rallypoint``) or the daemons (``daemons``): a shell prompt, a leading path
    (``.venv/bin/``) and a systemd ``ExecStart=`` are dropped, continuation lines joined."""
    for start, _info, body in code_blocks(path):
        i = 0
        while i < len(body):
            n, line = start + i, body[i]
            while line.rstrip().endswith("\\") and i + 1 < len(body):
                i += 1
                line = line.rstrip()[:-1] + " " + body[i].strip()
            i += 1
            m = _COMMAND.match(line.strip())
            if m:
                program = "rallypoint" if m.group(1) == "rallypoint" else "daemons"
                yield n, program, line.strip()[m.end():].strip()


def section(path: Path, heading: str) -> list[str]:
    """The lines of ``path`` from the heading ``heading`` (``## Quick start``) to the next heading of its level."""
    lines = path.read_text().splitlines()
    start = lines.index(heading)
    level = heading.split(" ")[0] + " "
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith(level)), len(lines))
    return lines[start:end]


QUICK_START = "## Quick start"


def _quick_start(verb: str) -> list[str]:
    """The arguments of the one ``rallypoint VERB`` of the README's quick start."""
    import shlex

    readme = ROOT / "README.md"
    lines = set(section(readme, QUICK_START))
    found = [shlex.split(text, comments=True) for _, program, text in command_lines(readme)
             if program == "rallypoint" and text.startswith(f"{verb} ") and any(text in line for line in lines)]
    assert len(found) == 1, f"README.md's quick start should show one `rallypoint {verb}`, found {found}"
    return found[0]


def quick_start_run() -> list[str]:
    """The arguments of the one ``rallypoint run`` of the README's quick start (the suite runs exactly it:
    tests/integration/test_recovery.py)."""
    return _quick_start("run")


def quick_start_export() -> list[str]:
    """The arguments of the README quick start's ``rallypoint export`` (its weights on disk)."""
    return _quick_start("export")
