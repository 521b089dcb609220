"""How deeply a `--config` file nests, checked before it is parsed: a config is an object of values and lists
of values, and the YAML and JSON parsers recurse once per level (a deep file ends in a RecursionError there)."""
from __future__ import annotations

import re

MAX_DEPTH = 2  # the object of keys, a list in it
_JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')  # strings are skipped whole: brackets in them do not count


def check(text: str, yaml_file: bool, path: str) -> None:
    """A ValueError naming --config and the line where `text` nests deeper than MAX_DEPTH."""
    depth = 0
    for opens, offset_or_line in (_yaml_events(text) if yaml_file else _json_tokens(text)):
        depth += 1 if opens else -1
        if depth > MAX_DEPTH:
            line = offset_or_line if yaml_file else text.count("\n", 0, offset_or_line) + 1
            raise ValueError(f"--config: {path} nests deeper than a config needs at line {line} (expected an "
                             f"object of values and lists of values)")


def _yaml_events(text: str):
    """(opens, line) for each collection start and end, from PyYAML's event stream (its parser does not recurse).
    Malformed YAML yields nothing more: `yaml.safe_load` reports it."""
    import yaml

    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, (yaml.CollectionStartEvent, yaml.CollectionEndEvent)):
                yield isinstance(event, yaml.CollectionStartEvent), event.start_mark.line + 1
    except yaml.YAMLError:
        return


def _json_tokens(text: str):
    """(opens, offset) for each bracket outside strings."""
    for m in _JSON_TOKENS.finditer(text):
        if m.group() in ("[", "{", "]", "}"):
            yield m.group() in ("[", "{"), m.start()
