"""The documentation stays navigable: every relative link in README.md, docs/*.md and bench/README.md
points at a file that exists and, when it names an anchor, at a heading of that file.

Anchors follow GitHub's rule for heading ids: the heading's text without its markup, lower-cased,
every character that is not a letter, a digit, `_`, `-` or a space dropped, spaces turned into `-`,
and `-1`, `-2`, ... appended to repeats. Links inside code blocks and code spans are not links.
The README also keeps stating the test command CI runs, and no page depends on a design
reference outside this repository (the design is docs/design.md).
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", ROOT / "bench" / "README.md", *(ROOT / "docs").glob("*.md")])

_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """A heading's id as GitHub renders it (before repeats are numbered)."""
    text = re.sub(r"!\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # images: their alt text
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)        # links: their text
    text = re.sub(r"<[^>]+>", "", text)                          # inline HTML
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"(?<!\w)_+|_+(?!\w)", "", text)               # _emphasis_, not snake_case
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading id of a markdown file, repeats numbered as GitHub numbers them."""
    seen: Counter[str] = Counter()
    ids = set()
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        match = _HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        ids.add(base if seen[base] == 0 else f"{base}-{seen[base]}")
        seen[base] += 1
    return ids


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every markdown link and image outside code."""
    found = []
    for number, line in _prose_lines(path.read_text(encoding="utf-8")):
        for match in _LINK.finditer(_CODE_SPAN.sub("", line)):
            found.append((number, match.group(1)))
    return found


def broken_links(page: Path) -> list[str]:
    problems = []
    for number, target in links(page):
        if _EXTERNAL.match(target):
            continue
        where, _, anchor = target.partition("#")
        resolved = (ROOT / where.lstrip("/")) if where.startswith("/") else (page.parent / where if where else page)
        label = f"{page.relative_to(ROOT)}:{number}: ({target})"
        if not resolved.exists():
            shown = resolved.relative_to(ROOT) if resolved.is_relative_to(ROOT) else resolved
            problems.append(f"{label}: no such file {shown}")
        elif anchor:
            if resolved.suffix != ".md" or resolved.is_dir():
                problems.append(f"{label}: an anchor into something that is not a markdown file")
            elif anchor not in anchors(resolved):
                problems.append(f"{label}: no heading with id #{anchor} in {resolved.relative_to(ROOT)}")
    return problems


@pytest.mark.parametrize(("heading", "expected"), [
    ("4. The WAL protocol: W1\u2013W7", "4-the-wal-protocol-w1w7"),  # an en dash, dropped
    ("4.1 The sharper readings", "41-the-sharper-readings"),
    ("Limits (defaults in `WriterConfig`)", "limits-defaults-in-writerconfig"),
    ("Truncation, and how often to snapshot", "truncation-and-how-often-to-snapshot"),
    ("The cluster: leadership, failover, routing", "the-cluster-leadership-failover-routing"),
    ("`wal_append.py`: what the single-writer guard costs", "wal_appendpy-what-the-single-writer-guard-costs"),
    ("The [store](api.md) *itself*", "the-store-itself"),
])
def test_slug_follows_github(heading: str, expected: str) -> None:
    assert slug(heading) == expected


def test_repeated_headings_are_numbered(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# A\n\n## Results\n\n```\n## Results\n```\n\n## Results\n", encoding="utf-8")
    assert anchors(page) == {"a", "results", "results-1"}


def test_links_in_code_are_not_links(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("`f([a](b))` and [real](c.md#x)\n\n```\n[no](d.md)\n```\n", encoding="utf-8")
    assert links(page) == [(1, "c.md#x")]


def test_the_pages_exist() -> None:
    names = {page.relative_to(ROOT).as_posix() for page in PAGES}
    assert {"README.md", "bench/README.md", "docs/README.md", "docs/design.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page: Path) -> None:
    problems = broken_links(page)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_every_docs_page_is_in_the_index() -> None:
    index = {target.partition("#")[0] for _, target in links(ROOT / "docs" / "README.md")}
    pages = [page.name for page in (ROOT / "docs").glob("*.md") if page.name != "README.md"]
    missing = [name for name in pages if name not in index]
    assert not missing, f"add these to the table in docs/README.md: {missing}"


def test_the_readme_states_the_test_command() -> None:
    # CI runs `make test` on a fresh clone (.ci/run); the README is where a newcomer finds it.
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "make test" in readme and "make up" in readme


def test_no_page_depends_on_a_design_reference_outside_the_repository() -> None:
    outside = re.compile(r"shared[/]DESIGN")  # the team's reference, outside the repository
    pages = [page for page in PAGES if outside.search(page.read_text(encoding="utf-8"))]
    assert not pages, f"docs/design.md is the design; these still cite the reference outside it: {pages}"
