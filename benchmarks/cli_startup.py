"""How long the `rlkernels` console script takes to answer without training (issue 33 item 6: under 1 s for
`--help` and for a flag error): each command in a fresh process, the median of several runs, and the load average
(the machine is shared). `python -m benchmarks.cli_startup [--repeats N]`."""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

COMMANDS = [["--help"], ["train", "--help"], ["train", "--no-such-flag"], ["train", "--lr", "x"],
            ["demo", "--help"], ["bench", "--help"], ["trl", "--help"]]


def time_command(args, repeats: int):
    """(median seconds, exit status) of `rlkernels ARGS`."""
    exe = shutil.which("rlkernels") or sys.exit("the rlkernels console script is not installed")
    times, status = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        status = subprocess.run([exe, *args], capture_output=True).returncode
        times.append(time.perf_counter() - start)
    return statistics.median(times), status


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    repeats = parser.parse_args().repeats
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for args in COMMANDS:
        seconds, status = time_command(args, repeats)
        print(f"rlkernels {' '.join(args):<28} {seconds:6.2f} s  (exit {status}, median of {repeats})")
    print(f"load average after:  {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
