"""The table of per-token objectives (rlkernels/_token_loss_table.py) against its readers: the generated C++ header
(committed; regenerated here and compared), its ids, layout and range checks, the Triton constants, `TokenLossParams`
and `PolicyLossConfig`'s ranges of the same fields. Any drift fails."""
from __future__ import annotations

import dataclasses
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from rlkernels.kernels import gen_token_loss_header
from rlkernels.kernels import token_loss_params as P
from rlkernels.kernels.triton import token_loss as triton_token_loss
from rlkernels.losses import PolicyLossConfig
from rlkernels.losses.config import KL_ESTIMATORS as CONFIG_KL_ESTIMATORS
from rlkernels.losses import objectives
from rlkernels.losses.kl import LOW_VAR_KL_BOUND

ROOT = os.path.join(os.path.dirname(__file__), "..")
INCLUDE = os.path.join(ROOT, "csrc", "include", "rlkernels")


def test_generated_header_is_what_the_table_gives():
    """Fails after a change to the table until `python -m rlkernels.kernels.gen_token_loss_header` is run (and after
    a hand edit of the header)."""
    proc = subprocess.run([sys.executable, "-m", "rlkernels.kernels.gen_token_loss_header", "--check", "--root", ROOT],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, ("token_loss_table.h or the objectives' generated branches (token_loss_surrogates.h, "
                                  "triton/token_loss_surrogates.py, losses/token_formulas.py) are not what the "
                                  "table gives; run "
                                  "`python -m rlkernels.kernels.gen_token_loss_header`:\n" + proc.stdout[-6000:]
                                  + proc.stderr[-2000:])
    assert open(os.path.join(ROOT, gen_token_loss_header.HEADER)).read() == gen_token_loss_header.render()


def test_no_hand_written_copy_of_the_layout():
    """Only the generated header names the objectives' ids and the packed offsets in C++: the sources use its names."""
    for folder, _, files in os.walk(os.path.join(ROOT, "csrc")):
        for name in files:
            if name == "token_loss_table.h":
                continue
            text = open(os.path.join(folder, name)).read()
            assert not re.search(r"enum (TokenObjective|KlEstimator|TokenLossParam|TokenStat)\b", text), name
            assert not re.search(r"struct TokenLossParams\b", text), name


def _snake(camel: str) -> str:
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", camel).lower()


def _enum(header: str, name: str) -> list[tuple[str, int]]:
    """(name, value) of each enumerator of `enum name` in a header, counting on from the last explicit value."""
    text = open(os.path.join(INCLUDE, header)).read()
    body = re.search(rf"enum {name} : int \{{(.*?)\}};", text, re.S).group(1)
    out, value = [], -1
    for item in re.sub(r"//[^\n]*", "", body).split(","):
        if not item.strip():
            continue
        enumerator, _, explicit = item.partition("=")
        value = int(explicit) if explicit.strip() else value + 1
        out.append((enumerator.strip(), value))
    return out


def test_cpp_layout_is_the_table_order():
    layout = _enum("token_loss_table.h", "TokenLossParam")
    assert [_snake(n[len("kParam"):]) for n, _ in layout[:-1]] == [p.name for p in P.PARAMS]
    assert layout[-1] == ("kNumTokenLossParams", P.NUM_PARAMS)
    assert [v for _, v in layout] == list(range(P.NUM_PARAMS + 1))


def test_cpp_ids_are_the_table_ids():
    *objectives, count = _enum("token_loss_table.h", "TokenObjective")
    assert {_snake(n[1:]): v for n, v in objectives} == {e.name: e.id for e in P.OBJECTIVES}
    assert count == ("kNumObjectives", len(P.OBJECTIVES))  # the ids are 0 to count − 1, each once
    assert sorted(e.id for e in P.OBJECTIVES) == list(range(len(P.OBJECTIVES)))
    *estimators, count = _enum("token_loss_table.h", "KlEstimator")
    assert {_snake(n[len("kKl"):]): v for n, v in estimators} == {
        "none": P.KL_NONE, **{e.name.replace("+", "_plus"): e.id for e in P.KL_ESTIMATORS}}
    assert count == ("kNumKlEstimators", len(P.KL_ESTIMATORS) + 1)
    bound = re.search(r"kLowVarKlBound = ([0-9.]+);", open(os.path.join(INCLUDE, "token_loss_table.h")).read())
    assert float(bound.group(1)) == P.LOW_VAR_KL_BOUND == LOW_VAR_KL_BOUND


def test_triton_constants_are_the_table_ids_and_offsets():
    for entry in P.OBJECTIVES:
        assert getattr(triton_token_loss, P.upper_name(entry.name)).value == entry.id, entry.name
    for entry in P.KL_ESTIMATORS:
        assert getattr(triton_token_loss, "KL_" + P.upper_name(entry.name)).value == entry.id, entry.name
    assert triton_token_loss.KL_NONE.value == P.KL_NONE
    for param in P.PARAMS:
        if param.kind == P.REAL:  # the ids and bools are constexpr arguments of the Triton kernels
            assert getattr(triton_token_loss, param.name.upper()).value == P.OFFSET[param.name], param.name


def test_params_record_and_config_follow_the_table():
    fields = {f.name: f for f in dataclasses.fields(P.TokenLossParams)}
    assert list(fields) == [p.name for p in P.PARAMS]
    assert P.TokenLossParams().packed() == tuple(float(p.default) for p in P.PARAMS)
    config = {f.name for f in dataclasses.fields(PolicyLossConfig)}
    for param in P.PARAMS:
        assert param.field in config, param.name
    for entry in P.OBJECTIVES + P.KL_ESTIMATORS:
        assert set(entry.params) <= set(P.OFFSET), entry.name
        assert set(entry.ops) <= {P.FWD, P.LOSS}, entry.name
    assert {e.name for e in P.OBJECTIVES} <= set(objectives.names())
    assert {e.name for e in P.KL_ESTIMATORS} <= set(CONFIG_KL_ESTIMATORS)
    assert len({e.id for e in P.OBJECTIVES}) == len(P.OBJECTIVES)


# A config where each real parameter's field is read, and its whole table range is valid: the first objective that
# reads it (CISPO for clip_high, whose cap may be below 1; else clip), with a KL term for the KL parameters.
_READER = {"clip_high": "cispo"}


def _config(param: P.Param, value) -> PolicyLossConfig:
    objective = _READER.get(param.name) or next((e.name for e in P.OBJECTIVES if param.name in e.params), "clip")
    extra = dict(kl_estimator="k3", kl_coef=0.1) if param.name.startswith("kl_") else {}
    required = dict(dro_beta=0.1) if objective == "dro" else {}
    return PolicyLossConfig(objective=objective, **{**extra, **required, param.field: value})


@pytest.mark.parametrize("param", [p for p in P.PARAMS if p.kind == P.REAL], ids=lambda p: p.name)
def test_config_takes_the_table_range(param):
    """PolicyLossConfig refuses what the table refuses (its "no bound" is None, not inf) and takes a value just
    inside the table's range, for the field of each real parameter."""
    for value in _outside(param) + ([math.inf] if param.inf_ok else []):
        with pytest.raises(ValueError, match=f"^{param.field}: "):
            _config(param, value)
    inside = 0.0 if math.isinf(param.low) else param.low + 0.5
    assert getattr(_config(param, inside), param.field) == inside


def _outside(param: P.Param) -> list[float]:
    """Values just outside the table's range of `param`."""
    values = [math.nan] + ([] if param.inf_ok else [math.inf])
    if math.isfinite(param.low):
        values.append(param.low if param.strict else param.low - 0.5)
    return values


@pytest.mark.parametrize("param", P.PARAMS, ids=lambda p: p.name)
def test_cpp_refuses_what_the_table_refuses(param):
    from rlkernels.kernels import _extension
    if _extension.missing_reason():
        pytest.skip(_extension.missing_reason())
    default = P.TokenLossParams(**{p.name: p.default for p in P.PARAMS}).packed()
    logp, mask = torch.zeros(2), torch.ones(2, dtype=torch.bool)
    for value in _outside(param):
        packed = list(default)
        packed[P.OFFSET[param.name]] = value
        with pytest.raises(RuntimeError, match=f"^ValueError: {param.name}: "):
            torch.ops.rlkernels_C.policy_token_loss(logp, None, mask, logp, None, None, None, None, None, packed)
    torch.ops.rlkernels_C.policy_token_loss(logp, None, mask, logp, None, None, None, None, None, list(default))
    with pytest.raises(RuntimeError, match="^ValueError: params: "):
        torch.ops.rlkernels_C.policy_token_loss(logp, None, mask, logp, None, None, None, None, None, default[:-1])
