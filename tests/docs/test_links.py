"""Every relative link of the documentation points at a file of the repository (and a heading that exists)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.markdown import ROOT, anchors, linked_files, links


def broken_links(path: Path) -> list[str]:
    out = []
    for n, target in links(path):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(ROOT)}:{n}: {target}"
        if not dest.is_relative_to(ROOT):
            out.append(f"{where} points outside the repository")
        elif not dest.exists():
            out.append(f"{where} names a file that does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            out.append(f"{where} names a heading that {dest.relative_to(ROOT)} does not have")
    return out


@pytest.mark.parametrize("path", linked_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_inside_the_repository(path: Path) -> None:
    assert broken_links(path) == []


def test_every_page_under_docs_is_reachable_from_the_docs_index() -> None:
    """docs/README.md sorts the pages into guides, reference and design: a new page must be listed there."""
    index = ROOT / "docs" / "README.md"
    listed = {(index.parent / t.partition("#")[0]).resolve() for _, t in links(index)}
    pages = {p.resolve() for p in (ROOT / "docs").rglob("*.md")} - {index.resolve()}
    assert sorted(str(p.relative_to(ROOT)) for p in pages - listed) == []


def test_the_checker_finds_a_broken_link_and_a_missing_heading(tmp_path: Path) -> None:
    page = ROOT / "docs" / "_probe_for_the_link_test.md"
    page.write_text("# Probe\n\n[a](nowhere.md) [b](README.md#no-such-heading) [c](#probe) `[d](x.md)`\n"
                    "[e](../../outside.md)\n")
    try:
        found = broken_links(page)
    finally:
        page.unlink()
    assert [f.split(": ", 1)[1] for f in found] == [
        "nowhere.md names a file that does not exist",
        "README.md#no-such-heading names a heading that docs/README.md does not have",
        "../../outside.md points outside the repository",
    ]
