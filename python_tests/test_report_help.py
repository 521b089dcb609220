"""`python -m benchmarks.report --help` says what the report is in whole sentences (it was cut mid-sentence)."""
import pytest

from benchmarks import report


def test_help_describes_the_report_in_whole_sentences(capsys):
    with pytest.raises(SystemExit):
        report.parse_args(["--help"])
    out = capsys.readouterr().out
    description = out.split("\n\n")[1]  # after the usage
    assert description.startswith("Benchmark report:") and description.rstrip().endswith(".png."), description
    assert out.rstrip().endswith("in the same dtype.")  # the roofline column, explained after the flags
