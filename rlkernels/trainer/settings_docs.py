"""The table of every setting in docs/trainer.md#every-setting, from settings.py: `python -m
rlkernels.trainer.settings_docs` rewrites it there (python_tests/test_trainer_settings.py checks that it is current)."""
from __future__ import annotations

import dataclasses
import pathlib

from .settings import FIELDS, MULTI, expected, nullable, shown, value_type

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "trainer.md"
END = "<!-- end of the generated table -->"
TABLE_HEAD = ("| flag | default | values | TRL's names | read by | what it does |", "|---|---|---|---|---|---|")


def _values(name: str) -> str:
    meta = FIELDS[name].metadata
    if meta["choices"]:  # None among them is the default that another setting decides
        return " \\| ".join(c for c in meta["choices"] if c is not None)
    if meta["bounds"]:
        return expected(name)
    kind = {int: "an int", float: "a number", bool: "a bool", str: "a string"}[value_type(name)]
    return (f"several: {kind} each" if name in MULTI else kind) + (" or none" if nullable(name) else "")


def markdown_table() -> str:
    """The settings as the rows of docs/trainer.md's table (python_tests/test_trainer_settings.py compares)."""
    rows = list(TABLE_HEAD)
    for name, f in FIELDS.items():
        meta = f.metadata
        default = (f"{shown(meta['mode'][0])} (demo), {shown(meta['mode'][1])} (--model)" if meta["mode"] else
                   shown(f.default_factory() if f.default is dataclasses.MISSING else f.default))
        if "trl_default" in meta:
            default += f"; TRL recipe: {shown(meta['trl_default'])}"
        trl = ", ".join(f"`{n}`" for n in meta["trl"])
        rows.append(f"| `--{name.replace('_', '-')}` | {default} | {_values(name)} | {trl} | "
                    f"{', '.join(meta['reads'])} | {meta['help'].replace('|', chr(92) + '|')} |")
    return "\n".join(rows) + "\n"


def write(path: pathlib.Path = DOC) -> None:
    """Replace the table in `path` with the settings' (the rows between its head and the end marker)."""
    text = path.read_text()
    start, end = text.index(TABLE_HEAD[0]), text.index(END)
    path.write_text(text[:start] + markdown_table() + text[end:])


if __name__ == "__main__":
    write()
