"""The tests mirror the packages: no test file at the root of tests/, helpers in tests/support/ (the fault
suite's own beside it in tests/faults/), and the ``multiprocess`` and ``engine`` markers from conftest.py's
one rule: no file sets them by hand."""
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
HAND_SET = re.compile(r"pytest\.mark\.(multiprocess|engine)\b")


def misplaced(files: list[Path]) -> list[str]:
    """Test files at the root of tests/, and helper modules outside tests/support/ and tests/faults/."""
    out = []
    for path in files:
        rel = path.relative_to(TESTS)
        if path.name in ("__init__.py", "conftest.py"):
            continue
        if len(rel.parts) == 1:
            out.append(f"{rel}: at the root of tests/")
        elif not path.name.startswith("test_") and rel.parts[0] not in ("support", "faults"):
            out.append(f"{rel}: a helper outside tests/support/")
    return out


def hand_set_markers(texts: dict[str, str]) -> list[str]:
    return [name for name, text in sorted(texts.items()) if HAND_SET.search(text)]


def test_tests_mirror_the_packages_and_markers_come_from_one_rule():
    files = sorted(TESTS.rglob("*.py"))
    assert not misplaced(files), misplaced(files)
    assert {"dispatch", "routing", "train", "placement", "integrations", "support"} <= {p.name for p in TESTS.iterdir()}
    texts = {str(p.relative_to(TESTS)): p.read_text() for p in files if p.name != "conftest.py"}
    texts.pop(str(Path(__file__).relative_to(TESTS)))  # this file names the markers it looks for
    assert not hand_set_markers(texts), hand_set_markers(texts)
    # planted: a test at the root, a helper among the tests, a marker set by hand
    assert misplaced([TESTS / "test_x.py", TESTS / "routing" / "helpers.py"]) == [
        "test_x.py: at the root of tests/", "routing/helpers.py: a helper outside tests/support/"]
    assert hand_set_markers({"x.py": "import pytest\npytestmark = pytest.mark.multiprocess\n"}) == ["x.py"]
