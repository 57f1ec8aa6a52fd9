"""Copy every example file into the Markdown pages that quote it.

A page quotes an example with a marker line followed by a ``python`` code fence:

    <!-- example: examples/tutorial_01_first_registry.py -->
    ```python
    ...the file's text, written by this script...
    ```

Run it after editing an example (``.venv/bin/python docs/sync_examples.py``);
``--check`` only reports pages that are out of date, with exit status 1.
tests/test_docs.py makes the same check.
"""

import re
import sys
from pathlib import Path

DOCS = Path(__file__).parent

# The marker, then the fence and everything up to the closing fence.
QUOTE = re.compile(
    r"(<!-- example: (?P<path>[\w./-]+) -->\n```python\n)(?P<code>.*?)(^```$)",
    re.DOTALL | re.MULTILINE,
)


def synced(text: str) -> str:
    def replace(match: re.Match[str]) -> str:
        code = (DOCS / match["path"]).read_text()
        return match.group(1) + code + match.group(4)

    return QUOTE.sub(replace, text)


def main() -> int:
    check = "--check" in sys.argv[1:]
    stale = []
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text()
        new = synced(text)
        if new != text:
            stale.append(page)
            if not check:
                page.write_text(new)
    for page in stale:
        print(f"{'out of date' if check else 'updated'}: {page.relative_to(DOCS.parent)}")
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
