"""The code blocks of the README and docs/ that tests run: `<!-- example: NAME -->` then a fenced block."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def block(name: str, doc: str = "README.md") -> str:
    """The code of the block marked `name` in `doc` (a path from the repository root)."""
    m = re.search(rf"<!-- example: {re.escape(name)} -->\s*```\w*\n(.*?)```", (ROOT / doc).read_text(), re.S)
    assert m, f"{doc}: no block marked {name!r}"
    return m.group(1)
