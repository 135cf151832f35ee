"""Copy the latest benchmark tables (benchmarks/results/<name>.md) into README.md between the
``<!-- results:<name> -->`` markers, so the README only ever shows numbers a script produced."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    readme = ROOT / "README.md"
    text = readme.read_text()
    for name in re.findall(r"<!-- results:(\w+) -->", text):
        found = [d for d in ("", "studies/") if (ROOT / "benchmarks" / "results" / d / f"{name}.md").exists()]
        if not found:
            raise SystemExit(f"README.md shows results:{name}, but benchmarks/results has no {name}.md")
        md = (ROOT / "benchmarks" / "results" / found[0] / f"{name}.md").read_text()
        md = md.replace("](", f"](benchmarks/results/{found[0]}").replace(
            "# ", "### ", 1
        )  # links relative to the README
        block = f"<!-- results:{name} -->\n{md}\n<!-- /results:{name} -->"
        text = re.sub(rf"<!-- results:{name} -->.*?<!-- /results:{name} -->", lambda _, b=block: b, text, flags=re.S)
    readme.write_text(text)


if __name__ == "__main__":
    main()
