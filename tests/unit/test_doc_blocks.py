"""Code a user copies from the README and the docs is the code the suite runs (static, no server).

The rule: every file in ``examples/`` names itself in a comment ``# examples/<file>`` on its first
line, or on its second line when the first is a shebang (``#!``). A fenced code block in README.md
or docs/**/*.md that names a file the same way (its first line, or its second after a shebang)
must equal that file byte for byte. tests/e2e/test_examples.py runs every file in ``examples/``
against a live server, so such a block cannot drift from code that works.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
MARKER = re.compile(r"# (examples/[\w.-]+)")
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


def marker(lines: list[str]) -> str | None:
    """The ``examples/<file>`` a block's (or a file's) lines name, per the rule above."""
    head = lines[1:2] if lines[:1] and lines[0].startswith("#!") else lines[:1]
    m = MARKER.fullmatch(head[0].rstrip()) if head else None
    return m.group(1) if m else None


def fenced_blocks(text: str) -> list[tuple[int, str]]:
    """(line number of the opening fence, content) of every fenced block, the fence's indentation
    removed from each line (a block inside a list item). Unclosed blocks run to the end, as in MyST."""
    blocks, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m or (m["fence"][0] == "`" and "`" in m["info"]):
            i += 1
            continue
        indent, fence, start, body = len(m["indent"]), m["fence"], i + 1, []
        i += 1
        while i < len(lines):
            close = FENCE.match(lines[i])
            if (
                close
                and close["fence"][0] == fence[0]
                and len(close["fence"]) >= len(fence)
                and not close["info"].strip()
            ):
                break
            line = lines[i]
            body.append(line[indent:] if line[:indent].strip() == "" else line)
            i += 1
        blocks.append((start, "".join(f"{line}\n" for line in body)))
        i += 1
    return blocks


def doc_pages() -> list[Path]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [p for p in pages if p.is_file() and ".venv" not in p.parts and "_build" not in p.parts]


def example_files() -> list[Path]:
    return sorted(p for p in EXAMPLES.iterdir() if p.is_file() and not p.name.startswith("."))


@pytest.mark.parametrize("path", example_files(), ids=lambda p: p.name)
def test_every_example_names_itself(path):
    lines = path.read_text().splitlines()
    assert marker(lines) == f"examples/{path.name}", (
        f"{path.name}: its first line (the second after a shebang) must be '# examples/{path.name}'"
    )


def test_every_doc_block_that_names_an_example_is_a_copy_of_it():
    checked, problems = 0, []
    for page in doc_pages():
        for line_no, block in fenced_blocks(page.read_text()):
            name = marker(block.splitlines())
            if name is None:
                continue
            where = f"{page.relative_to(ROOT)}:{line_no}"
            target = ROOT / name
            if not target.is_file():
                problems.append(f"{where}: the block names {name}, which does not exist")
                continue
            checked += 1
            text = target.read_text()
            if block != text:
                diff = difflib.unified_diff(text.splitlines(), block.splitlines(), name, where, lineterm="", n=1)
                problems.append("\n".join(diff))
    assert not problems, "\n\n".join(problems)
    print(f"{checked} doc blocks equal their examples/ file")


def test_the_parser_finds_blocks_the_way_myst_does():
    """The test above must not pass by finding nothing: fences of either kind, longer fences holding
    shorter ones, a block inside a list item, a shebang before the marker, and a file that differs."""
    text = (
        "Intro\n\n```bash\n#!/usr/bin/env bash\n# examples/a.sh\necho hi\n```\n\n"
        "- item\n\n  ~~~python\n  # examples/b.py\n  print(1)\n  ~~~\n\n"
        "````md\n```\n# examples/c.py\n```\n````\n"
    )
    blocks = fenced_blocks(text)
    assert [b for _, b in blocks] == [
        "#!/usr/bin/env bash\n# examples/a.sh\necho hi\n",
        "# examples/b.py\nprint(1)\n",
        "```\n# examples/c.py\n```\n",
    ]
    assert [marker(b.splitlines()) for _, b in blocks] == ["examples/a.sh", "examples/b.py", None]
    assert marker(["x = 1  # examples/b.py"]) is None  # a trailing comment names nothing
