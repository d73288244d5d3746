"""Move docs/development.md's ``file:line`` (``name``) places to the lines that define their
names now (tests/test_docs.py fails where one does not): each to the definition of its name
nearest the old line; a name defined nowhere is reported and left.

    python tools/fix_places.py
"""

from __future__ import annotations

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PLACE = re.compile(r"`(src/scaleopt/[\w/]+\.(?:py|c|h)):(\d+)`(\s+\(`(\w+)`\))")


def definitions(path: str, name: str) -> list:
    lines = (ROOT / path).read_text().splitlines()
    if path.endswith(".py"):
        pattern = re.compile(rf"\s*(def|class)\s+{name}\b")
        return [i for i, line in enumerate(lines, 1) if pattern.match(line)]
    pattern = re.compile(rf"(^#define\s+{name}\b|\b{name}\()")
    return [i for i, line in enumerate(lines, 1) if pattern.search(line)]


def main() -> int:
    doc = ROOT / "docs" / "development.md"
    missing = []

    def move(m: re.Match) -> str:
        path, line, rest, name = m.group(1), int(m.group(2)), m.group(3), m.group(4)
        found = definitions(path, name)
        if not found:
            missing.append(f"{path}: {name}")
            return m.group(0)
        if line in found:
            return m.group(0)
        new = min(found, key=lambda n: abs(n - line))
        print(f"{path}:{line} -> {new} ({name})")
        return f"`{path}:{new}`{rest}"

    doc.write_text(PLACE.sub(move, doc.read_text()))
    for place in missing:
        print(f"defined nowhere now: {place}", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
