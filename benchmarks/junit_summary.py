"""What a pytest run found, from its JUnit XML, or from its `-v` log when the run was killed before writing it.

    python -m benchmarks.junit_summary tests.xml tests.log

Prints the counts and one line per failure or error (test id and the first line of its message). A run
cut by SIGINT (`timeout -s INT`) still writes its XML, with the tests that ran; one killed outright leaves
only its log, whose `PASSED` / `FAILED` / `ERROR` lines are then read. Exit status: 1 when a test failed
or errored, or nothing could be read; else 0.
"""
from __future__ import annotations

import collections
import os
import re
import sys
import xml.etree.ElementTree as ElementTree

# `-v` result lines: "python_tests/t.py::test[a] PASSED  [ 5%]"; under xdist "[gw3] [ 5%] FAILED python_tests/t.py::test[a]"
_RESULT = re.compile(r"\b(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
_NODE = re.compile(r"(\S+\.py::\S+)")


def from_xml(path):
    """(counts, [(outcome, test id, first line of the message)]) of a JUnit XML file."""
    counts, problems = collections.Counter(), []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        if case.get("name") is None:  # what a SIGINT cut: the test that was running, written without a name
            counts["interrupted"] += 1
            continue
        test = f"{case.get('classname', '')}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                if child.tag != "skipped":
                    message = (child.get("message") or child.text or "").strip().splitlines()
                    problems.append((outcome, test, message[0] if message else ""))
        counts[outcome] += 1
    return counts, problems


def from_log(path):
    """(counts, [(outcome, test id, "")]) of the result lines of a `pytest -v` log (each test's last)."""
    results = {}
    with open(path, errors="replace") as f:
        for line in f:
            result, node = _RESULT.search(line), _NODE.search(line)
            if result and node:
                results[node.group(1)] = result.group(1).lower()
    return collections.Counter(results.values()), [(r, t, "") for t, r in results.items() if r in ("failed", "error")]


def summary(xml_path, log_path=None):
    """(lines to print, whether anything failed or nothing could be read)."""
    if os.path.exists(xml_path) and os.path.getsize(xml_path):
        try:
            counts, problems = from_xml(xml_path)
            source = xml_path
        except ElementTree.ParseError as e:
            counts, problems, source = None, [], f"{xml_path} unreadable ({e})"
    else:
        counts, problems, source = None, [], f"no {xml_path}"
    if counts is None and log_path and os.path.exists(log_path):
        counts, problems = from_log(log_path)
        source += f"; read from {log_path}"
    if not counts:
        return [f"tests: nothing to read ({source})"], True
    head = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    lines = [f"tests: {head} ({source})"] + [f"  {outcome.upper()} {test}{': ' + msg if msg else ''}"
                                             for outcome, test, msg in problems]
    return lines, bool(problems)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not 1 <= len(argv) <= 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    lines, bad = summary(*argv)
    print("\n".join(lines))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
