"""The lists of presets and objectives that README.md and docs/math.md show are the registry's
(`rlkernels.presets`, `rlkernels.losses.objectives`): a preset or objective added without its docs fails here."""
from __future__ import annotations

import pathlib
import re

from rlkernels import presets
from rlkernels.losses import objectives

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _section(doc: str, heading: str) -> str:
    text = (ROOT / doc).read_text()
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:end if end >= 0 else None]


def test_readme_lists_every_preset():
    text = (ROOT / "README.md").read_text()
    listed = re.search(r"Presets \(\[docs/math\.md[^)]*\)\): `([^`]*)`", text)
    assert listed, "README.md: no 'Presets ([docs/math.md ...]): `a, b, ...`' line"
    assert [n.strip() for n in listed.group(1).split(",")] == list(presets.NAMES)
    count = re.search(r"PPO, GRPO, GSPO, DAPO and (\d+) more presets of (\d+) objectives", text)
    assert count and int(count.group(1)) == len(presets.NAMES) - 4, "README.md: the count of presets"
    built_in = [name for name in objectives.names() if not objectives.get(name).plugin]
    assert int(count.group(2)) == len(built_in), "README.md: the count of objectives (not of presets)"


def test_math_preset_table_is_the_presets():
    rows = re.findall(r"^\| `(\w+)` \| `(\w+)` \| `(\w+)` \|", _section("docs/math.md", "## 9. Presets"), re.M)
    assert [name for name, _, _ in rows] == list(presets.NAMES)
    for name, ratio, objective in rows:
        fields = presets.fields(name)
        assert (fields["ratio"], fields["objective"]) == (ratio, objective), name


def test_math_names_every_objective_and_its_ratios():
    surrogates = _section("docs/math.md", "## 5. Surrogates")
    pairs = re.search(r"\* Valid pairs \([^)]*\): (.*?)\.\s+Other pairs", surrogates, re.S).group(1)
    documented = {}
    for part in " ".join(pairs.split()).split("; "):
        names, ratios = part.split(": ")
        for name in re.findall(r"`(\w+)`", names):
            documented[name] = set(re.findall(r"`(\w+)`", ratios))
    builtin = {name: set(objectives.get(name).ratios) for name in objectives.names() if not objectives.get(name).plugin}
    assert documented == builtin
