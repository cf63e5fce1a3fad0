"""What users read names nothing they do not have: no issue of this project's tracker, no document
outside the repository."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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
    for page in ("getting-started", "expert-parallelism", "configuration", "deepspeed-and-megatron",
                 "transformers", "running", "cli", "gpu-clusters", "measured", "layout"):
        assert f"](docs/{page}.md)" in readme, page
    broken = [f"{page.relative_to(ROOT)}: {m.group(1)}" for page in PAGES
              for m in re.finditer(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", page.read_text())
              if not m.group(1).startswith(("http:", "https:", "mailto:")) and not (page.parent / m.group(1)).exists()]
    assert not broken, broken


def test_every_documented_command_names_files_that_exist():
    """The commands tests/doc_commands.py runs from a fresh clone: each script, config and launcher they name is
    in the repository (a renamed file breaks the page before anyone runs it)."""
    from tests.doc_commands import commands

    found = commands()
    assert any("--layers 58 --plot plan.png" in c.text for c in found)  # a command over two lines, joined
    named = re.compile(r"(?<![\w/.])((?:configs|benchmarks|launch|examples|tests)/[\w./-]+\.(?:py|sh|yaml))")
    missing = [f"{c.page}:{c.line}: {path}" for c in found if not c.left_out
               for path in named.findall(c.text) if not (ROOT / path).exists()]
    assert not missing, missing
