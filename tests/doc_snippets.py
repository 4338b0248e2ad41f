"""The code blocks of README.md and docs/ that the tests run.

A runnable block is marked by an HTML comment on the line before its fence, which neither
GitHub nor the documentation site shows::

    <!-- snippet: NAME -->
    ```python
    ...
    ```

A name is one piece of code: where it appears in several pages (the README's front-end examples
again in the user guide) every copy must be the same, so running it once covers them all.
"""
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = (README, *sorted((REPO / "docs").rglob("*.md")))

_MARKED = re.compile(r"^<!-- snippet: ([\w-]+) -->\n```(\w+)\n(.*?)^```", re.S | re.M)
_MARKER = re.compile(r"<!-- snippet: ([\w-]+) -->")


def marked(path):
    """``[(name, language, code)]`` of the marked blocks of one page, in page order; a marker
    that is not directly followed by a fenced block is an error (it would run nothing)."""
    text = Path(path).read_text()
    blocks = _MARKED.findall(text)
    stray = len(_MARKER.findall(text)) - len(blocks)
    if stray:
        raise ValueError(f"{path}: {stray} snippet marker(s) not directly before a code fence")
    return blocks


def all_snippets(pages=PAGES):
    """``{name: (language, code)}`` over ``pages``; raises if one name has two versions."""
    found = {}
    for page in pages:
        for name, language, code in marked(page):
            if name in found and found[name][1:] != (language, code):
                raise ValueError(f"snippet {name!r} in {page} differs from its copy in "
                                 f"{found[name][0]}")
            found.setdefault(name, (page, language, code))
    return {name: (language, code) for name, (_, language, code) in found.items()}


def snippet(name):
    """The code of the snippet ``name``."""
    return all_snippets()[name][1]
