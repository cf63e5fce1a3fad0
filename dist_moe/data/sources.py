"""The packaged texts every text dataset here is built from (Debian packages and the stdlib).

fortunes-min   /usr/share/games/fortunes/{fortunes,literature,riddles}: quotes split on "%"
wordnet-base   /usr/share/wordnet/data.{noun,verb,adj,adv}: one synset a line, its gloss after "|"
the stdlib     Python's own top-level *.py sources, always present
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

FORTUNES = Path("/usr/share/games/fortunes")
WORDNET = Path("/usr/share/wordnet")


def fortune_quotes(name: str) -> list[str]:
    """The non-empty quotes of one fortunes-min file, stripped."""
    path = FORTUNES / name
    if not path.exists():
        raise ValueError(f"{path} not found: install the Debian package fortunes-min (make does, as root)")
    return [q.strip() for q in path.read_text(errors="replace").split("\n%\n") if q.strip()]


def wordnet_synsets(part: str) -> list[tuple[str, int]]:
    """(gloss, lexicographer file number) of every synset in data.<part>: WordNet's one parser here."""
    path = WORDNET / f"data.{part}"
    if not path.exists():
        raise ValueError(f"{path} not found: install the Debian package wordnet-base (make does, as root)")
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("  ") or "|" not in line:  # the licence header lines start with spaces
            continue
        fields = line.split(" ", 2)
        out.append((line.split("|", 1)[1].strip(), int(fields[1])))
    return out


def stdlib_code(limit_bytes: int = 4_000_000) -> str:
    """Python's top-level standard library modules (a stable, version-bound set), up to a size."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(errors="replace")
        out.append(text)
        total += len(text)
        if total >= limit_bytes:
            break
    return "\n".join(out)
