"""The documents (issue 41): README.md is read in one sitting (at most 240 lines, Install first), its detail lives in
docs/, each docs page is reachable from README.md, and every relative link in the project's documents resolves, to a
file and, for `#anchor`, to a heading of the target (GitHub's slugs)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick  # the quick subset: every test here (python -m pytest -q -m quick)

REPO = Path(__file__).resolve().parent.parent
README_MAX_LINES = 240

_FENCED = re.compile(r"^[ \t]*(```+|~~~+).*?^[ \t]*\1[ \t]*$", re.S | re.M)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)[ \t]*#*[ \t]*$", re.M)
_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.I)
_SCHEME = re.compile(r"[a-z][a-z0-9+.-]*:", re.I)  # https:, mailto:


def documents() -> list[Path]:
    """The project's own documents: the top-level ones, the benchmarks' READMEs and docs/."""
    found = [REPO / name for name in ("README.md", "CONTRIBUTING.md", "RELIABILITY.md", "CHANGELOG.md")]
    found += sorted((REPO / "benchmarks").rglob("README.md")) + docs_pages()
    return found


def docs_pages() -> list[Path]:
    return sorted((REPO / "docs").glob("*.md"))


def _prose(text: str) -> str:
    """Text without fenced code blocks (a `# comment` there is no heading) and without inline code."""
    return _INLINE_CODE.sub("", _FENCED.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation but '-' and '_' removed, each space a
    '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a page offers: its headings' slugs (a repeated one gets -1, -2, ... as on GitHub) and HTML ids."""
    text = path.read_text(encoding="utf-8")
    seen: dict[str, int] = {}
    found = set(_HTML_ANCHOR.findall(text))
    for match in _HEADING.finditer(_FENCED.sub("", text)):
        base = slug(match.group(2))
        count = seen.get(base, 0)
        found.add(base if count == 0 else f"{base}-{count}")
        seen[base] = count + 1
    return found


def links(path: Path) -> list[str]:
    prose = _prose(path.read_text(encoding="utf-8"))
    return _LINK.findall(prose) + _REFERENCE.findall(prose)


def broken_links(path: Path) -> list[str]:
    """The relative links of one document that lead nowhere: no such file, or no such heading in the target."""
    broken = []
    for target in links(path):
        if _SCHEME.match(target):
            continue
        file, _, fragment = target.partition("#")
        if file.startswith("/"):
            broken.append(f"{target} (an absolute path: GitHub does not resolve it from the repository)")
            continue
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.is_relative_to(REPO) or not resolved.exists():
            broken.append(f"{target} (no such file or folder)")
        elif fragment and (resolved.suffix != ".md" or fragment not in anchors(resolved)):
            broken.append(f"{target} (no heading #{fragment} in {resolved.relative_to(REPO)})")
    return broken


def test_the_documents_exist_and_docs_has_pages():
    missing = [str(p.relative_to(REPO)) for p in documents() if not p.is_file()]
    assert not missing, missing
    assert len(docs_pages()) >= 5, docs_pages()  # the method, statistics and the card, verify, the doors, benchmarks


@pytest.mark.parametrize("document", documents(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(document):
    broken = broken_links(document)
    assert not broken, f"{document.relative_to(REPO)}: links that do not resolve: {broken}"


def test_a_broken_link_is_found(tmp_path, monkeypatch):
    """The check itself: a missing file, a missing heading and an absolute path are each reported; good ones are not."""
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# A page\n\n## What `verify` costs, in short\n\n## Twice\n\n## Twice\n")
    good = "[a](docs/page.md) [b](docs/page.md#what-verify-costs-in-short) [c](docs/page.md#twice-1) [d](#top)"
    bad = "[e](docs/gone.md) [f](docs/page.md#nowhere) [g](/docs/page.md) [h](../outside.md)"
    readme = tmp_path / "README.md"
    readme.write_text(f"# Top\n\n{good}\n\n{bad}\n\n```bash\n# not a heading\n[x](nowhere.md)\n```\n`[y](nowhere.md)`\n")
    assert [b.split(" ")[0] for b in broken_links(readme)] == [
        "docs/gone.md", "docs/page.md#nowhere", "/docs/page.md", "../outside.md",
    ]


def test_readme_is_read_in_one_sitting():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move detail to docs/"
    sections = [m.group(2) for m in _HEADING.finditer(_FENCED.sub("", "\n".join(lines))) if m.group(1) == "##"]
    assert sections and sections[0] == "Install", f"README.md's first section must be Install, not {sections[:1]}"


def test_every_docs_page_is_linked_from_the_readme():
    readme = REPO / "README.md"
    linked = {(readme.parent / t.partition("#")[0]).resolve() for t in links(readme) if not _SCHEME.match(t)}
    unlinked = [str(p.relative_to(REPO)) for p in docs_pages() if p.resolve() not in linked]
    assert not unlinked, f"docs pages README.md does not link to: {unlinked}"
