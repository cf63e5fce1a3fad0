"""What users read names nothing they do not have: no issue of this project's tracker, no document
outside the repository."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md")),
         *sorted((ROOT / "benchmarks").glob("*.md")), *sorted((ROOT / "examples").rglob("*.md"))]
OUTSIDE = re.compile(r"\b[Ii]ssues? #?\d+|\.\./shared|\bDESIGN\.md\b")


def test_no_user_page_names_an_issue_or_a_document_outside_the_repository():
    found = [f"{page.relative_to(ROOT)}:{n}: {m.group(0)}" for page in PAGES
             for n, line in enumerate(page.read_text().splitlines(), 1) for m in OUTSIDE.finditer(line)]
    assert not found, found


def test_the_readme_is_a_front_page_and_every_link_between_the_pages_resolves():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    unlinked = [page.name for page in (ROOT / "docs").glob("*.md") if f"](docs/{page.name})" not in readme]
    assert not unlinked, f"README links no {unlinked}"
    broken = [f"{page.relative_to(ROOT)}: {m.group(1)}" for page in PAGES
              for m in re.finditer(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", page.read_text())
              if not m.group(1).startswith(("http:", "https:", "mailto:")) and not (page.parent / m.group(1)).exists()]
    assert not broken, broken


def test_the_command_check_reads_every_page():
    from tests.support.doc_commands import PAGES

    pages = {str(p.relative_to(ROOT)) for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md"),
                                                ROOT / "benchmarks" / "README.md"]}
    assert pages <= set(PAGES), sorted(pages - set(PAGES))


def test_every_documented_command_names_files_that_exist():
    """The commands tests/support/doc_commands.py runs from a fresh clone: each script, config and launcher they name is
    in the repository (a renamed file breaks the page before anyone runs it)."""
    from tests.support.doc_commands import commands

    found = commands()
    assert any("--layers 58 --plot plan.png" in c.text for c in found)  # a command over two lines, joined
    named = re.compile(r"(?<![\w/.])((?:configs|benchmarks|launch|examples|tests)/[\w./-]+\.(?:py|sh|yaml))")
    missing = [f"{c.page}:{c.line}: {path}" for c in found if not c.left_out
               for path in named.findall(c.text) if not (ROOT / path).exists()]
    assert not missing, missing


def test_a_slow_command_is_told_from_its_comment():
    """tests/support/doc_commands.py fails a command over 20 s whose page does not say how long it takes."""
    from tests.support.doc_commands import Command

    assert Command("p", 1, "x", "4 ranks as 2 nodes (about 40 s)").says_its_time
    assert Command("p", 1, "x", "every seed (2-3 min)").says_its_time
    assert not Command("p", 1, "x", "4 ranks as 2 nodes x 2").says_its_time
    assert not Command("p", 1, "x", "top-4 of 16 experts").says_its_time


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_every_link_to_a_heading_finds_it():
    broken = [f"{page.relative_to(ROOT)}: {target}#{anchor}" for page in PAGES
              for target, anchor in re.findall(r"\]\(([^)\s#]*\.md)?#([^)\s]+)\)", page.read_text())
              if anchor not in _anchors(page.parent / target if target else page)]
    assert not broken, broken
