"""The benchmarks time the right thing: every provider that runs here computes what eager PyTorch
computes (value and gradients) on fresh random inputs, and `python -m benchmarks.report` writes its
table, JSON and plots."""
import json

import pytest
import torch

from benchmarks import report
from benchmarks.providers import check_agrees_with_eager, runnable
from benchmarks.workloads import MODES, OPS, Case

CPU = torch.device("cpu")
# torch.compile and Liger (which compiles its chunk function) take tens of seconds here
SLOW = {"compile", "liger"}


def _params():
    for op in OPS:
        for provider, reason in runnable(op, CPU):
            marks = [pytest.mark.slow] if provider.name in SLOW else []
            if reason:
                marks.append(pytest.mark.skip(reason=reason))
            for mode in MODES:
                yield pytest.param(op, provider, mode, marks=marks, id=f"{op}-{provider.name}-{mode}")


@pytest.mark.parametrize("op, provider, mode", list(_params()))
def test_provider_agrees_with_eager(op, provider, mode):
    case = Case(op, n=100, vocab=1000, dtype="fp32", mode=mode, hidden=48 if op == "grpo_linear" else 0, seq_len=25)
    check_agrees_with_eager(case, provider, CPU)


def test_agreement_check_catches_a_wrong_provider():
    """The check is not vacuous: a provider off by a little fails it."""
    provider = next(p for p, _ in runnable("grpo", CPU, ["eager"]))
    build = provider.build
    wrong = type(provider)(provider.name, provider.ops, lambda case, inputs: (
        lambda logits: build(case, inputs)(logits) * 1.001))
    with pytest.raises(AssertionError):
        check_agrees_with_eager(Case("grpo", 64, 500, "fp32", "fwd", seq_len=16), wrong, CPU)


def test_report_writes_table_json_and_plots(tmp_path):
    argv = ["--quick", "--providers", "eager", "rlkernels-cpu", "rlkernels-torch", "--out", str(tmp_path),
            "--name", "smoke"]
    assert report.main(argv) == 0
    md = (tmp_path / "smoke.md").read_text()
    data = json.loads((tmp_path / "smoke.json").read_text())
    args = report.parse_args(argv)
    points = len(set([(v, args.n) for v in args.vocabs] + [(args.vocab, n) for n in args.ns]))
    providers = {p.name for op in OPS for p, why in runnable(op, CPU, args.providers) if not why}
    assert len(data["rows"]) == points * len(MODES) * len(OPS) * len(providers)
    assert all("error" not in r and r["ms"] > 0 and 0 < r["roofline"] for r in data["rows"])
    # every case also as it finished, one JSON line each (a run killed at its limit keeps them)
    lines = (tmp_path / "smoke.rows.jsonl").read_text().splitlines()
    assert [(r["op"], r["mode"], r["provider"], r["ms"]) for r in map(json.loads, lines)] == [
        (r["op"], r["mode"], r["provider"], r["ms"]) for r in data["rows"]]
    for op in OPS:
        assert f"| {op} | fwd+bwd | {max(args.vocabs)} | {args.n} | rlkernels-cpu |" in md
        assert (tmp_path / f"smoke_{op}.png").stat().st_size > 10_000


def test_report_rejects_unknown_provider(capsys):
    with pytest.raises(SystemExit):
        report.parse_args(["--providers", "eagre"])
    assert "--providers: unknown ['eagre']" in capsys.readouterr().err


@pytest.mark.slow  # two spawned processes, each importing torch and transformers: ~20 s on 2 cores
def test_demo_runs_and_both_paths_agree(capsys, tmp_path):
    """`python -m rlkernels.demo` at a tiny size: exit 0 means the two losses and gradients agree; it draws its PNG."""
    from rlkernels import demo

    assert demo.main(["--vocab", "512", "--seq-len", "16", "--groups", "1", "--group-size", "2", "--threads", "1",
                      "--png", str(tmp_path / "demo.png")]) == 0
    assert (tmp_path / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "rlkernels" in out and "plain log_softmax + gather" in out and "x the speed" in out


def test_extension_errors_raise_and_never_crash():
    """Each kind of argument error of the compiled extension raises its class, naming the argument (the H200 run
    saw SIGSEGV there: benchmarks/RESULTS.md). In this process, as a test; `python -m benchmarks.exception_probe`
    runs each case in its own process, for a machine where they crash. CUDA cases need a GPU."""
    import torch

    from benchmarks import exception_probe
    from rlkernels.kernels import cpu

    if not cpu.available()[0]:
        pytest.skip(cpu.available()[1])
    for what, call, error, name in exception_probe.CASES:
        if what.startswith("cuda") and not torch.cuda.is_available():
            continue
        exec(exception_probe.program(call, error, name), {})  # raises AssertionError unless `error` names `name`


def test_first_touch_rows(capsys):
    """benchmarks.first_touch at a tiny size: eager, the op, the kernel alone and the first touch, in that order."""
    from benchmarks import first_touch

    first_touch.main(["--n", "64", "--seq-len", "32", "--vocab", "256", "--reps", "1"])
    rows = [line.split("|")[1].strip() for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert rows == ["row", "eager", "rlkernels", "kernel", "first touch"]
