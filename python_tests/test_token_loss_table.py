"""The table of per-token objectives (rlkernels/kernels/token_loss_params.py) against its readers: the C++ layout
header and ids, the Triton offsets, `TokenLossParams`, `PolicyLossConfig` and the C++ range checks. Any drift fails."""
from __future__ import annotations

import dataclasses
import math
import os
import re

import pytest
import torch

from rlkernels.kernels import token_loss_params as P
from rlkernels.kernels.triton import token_loss as triton_token_loss
from rlkernels.losses import PolicyLossConfig
from rlkernels.losses.config import KL_ESTIMATORS as CONFIG_KL_ESTIMATORS
from rlkernels.losses import objectives
from rlkernels.losses.kl import LOW_VAR_KL_BOUND

INCLUDE = os.path.join(os.path.dirname(__file__), "..", "csrc", "include", "rlkernels")


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
    layout = _enum("token_loss_layout.h", "TokenLossParam")
    assert [_snake(n[len("kParam"):]) for n, _ in layout[:-1]] == [p.name for p in P.PARAMS]
    assert layout[-1] == ("kNumTokenLossParams", P.NUM_PARAMS)
    assert [v for _, v in layout] == list(range(P.NUM_PARAMS + 1))


def test_cpp_ids_are_the_table_ids():
    *objectives, count = _enum("token_loss.h", "TokenObjective")
    assert {_snake(n[1:]): v for n, v in objectives} == {e.name: e.id for e in P.OBJECTIVES}
    assert count == ("kNumObjectives", len(P.OBJECTIVES))  # the ids are 0 to count − 1, each once
    assert sorted(e.id for e in P.OBJECTIVES) == list(range(len(P.OBJECTIVES)))
    *estimators, count = _enum("token_loss.h", "KlEstimator")
    assert {_snake(n[len("kKl"):]): v for n, v in estimators} == {
        "none": P.KL_NONE, **{e.name.replace("+", "_plus"): e.id for e in P.KL_ESTIMATORS}}
    assert count == ("kNumKlEstimators", len(P.KL_ESTIMATORS) + 1)
    bound = re.search(r"kLowVarKlBound = ([0-9.]+);", open(os.path.join(INCLUDE, "token_loss.h")).read())
    assert float(bound.group(1)) == P.LOW_VAR_KL_BOUND == LOW_VAR_KL_BOUND


def test_triton_offsets_are_the_table_offsets():
    ids = {"objective", "kl_estimator", "kl_bias_correction"}  # constexpr arguments of the Triton kernels
    for param in P.PARAMS:
        if param.name not in ids:
            assert getattr(triton_token_loss, param.name.upper()).value == P.OFFSET[param.name], param.name


def test_params_dataclass_and_config_follow_the_table():
    fields = {f.name: f for f in dataclasses.fields(P.TokenLossParams)}
    assert list(fields) == [p.name for p in P.PARAMS]
    config = {f.name for f in dataclasses.fields(PolicyLossConfig)}
    for param in P.PARAMS:
        assert param.field in config, param.name
        if fields[param.name].default is not dataclasses.MISSING:
            assert fields[param.name].default == param.default, param.name
    for entry in P.OBJECTIVES + P.KL_ESTIMATORS:
        assert set(entry.params) <= set(P.OFFSET), entry.name
        assert set(entry.ops) <= {P.FWD, P.LOSS}, entry.name
    assert {e.name for e in P.OBJECTIVES} <= set(objectives.names())
    assert {e.name for e in P.KL_ESTIMATORS} <= set(CONFIG_KL_ESTIMATORS)
    assert len({e.id for e in P.OBJECTIVES}) == len(P.OBJECTIVES)


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
