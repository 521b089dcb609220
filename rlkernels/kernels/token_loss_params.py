"""The kernels' view of the table of per-token objectives (rlkernels/_token_loss_table.py), derived from it at import.

The table declares each objective, KL estimator and parameter once; here are its names as the kernels' modules
import them, and what the backends read of it: the packed layout's offsets `OFFSET`, the Python record
`TokenLossParams` (whose `packed()` is the one argument of the kernel ops), and the constants of the Triton
formula (`triton_constants`). The C++ side is the committed header csrc/include/rlkernels/token_loss_table.h,
written from the table by `python -m rlkernels.kernels.gen_token_loss_header`; python_tests/test_token_loss_table.py
fails when it is not what the table gives.

The kernels know nothing of `PolicyLossConfig`; `ops/kernel_params.py` translates a token-level config
into these numbers once per call (each `Param.field` names the config field a value comes from).
"""
from __future__ import annotations

import enum

import dataclasses
from typing import Dict, Tuple

from .._token_loss_table import (  # noqa: F401 (the table's names, as the kernels' modules import them)
    BOOL, CHOOSE_CLIP_COV, CHOOSE_KL_COV, FWD, INF, KL_ESTIMATOR_ID, KL_ESTIMATORS, KL_NONE, LOSS, LOW_VAR_KL_BOUND,
    OBJECTIVE_ID, OBJECTIVES, PARAMS, REAL, STATS, Entry, Param)


def upper_name(name: str) -> str:
    """An entry's or parameter's name as a constant: CLIP_LOW, LOW_VAR_KL_PLUS."""
    return name.replace("+", "_plus").upper()


# Each objective's id by its upper-case name (CLIP, GPPO, ...) and each KL estimator's as KL_<name> (KL_K3, ...),
# from the table's entries: an entry added there is named here too.
IDS = {**{upper_name(e.name): e.id for e in OBJECTIVES}, **{"KL_" + upper_name(e.name): e.id for e in KL_ESTIMATORS}}
globals().update(IDS)

NUM_STATS = len(STATS)
# the columns of `stats` by name (C++: kStatRatio, ...), and the surrogate's four (loss, clip flags, ratio)
Stat = enum.IntEnum("Stat", {name.upper(): i for i, name in enumerate(STATS)})
SURROGATE_STATS = slice(Stat.LOSS, Stat.RATIO + 1)
CLIP_FLAGS = slice(Stat.CLIP_LOW, Stat.CLIP_HIGH + 1)
OFFSET = {p.name: i for i, p in enumerate(PARAMS)}
NUM_PARAMS = len(PARAMS)


def triton_constants() -> Dict[str, int]:
    """The constants of triton/token_loss.py: each objective's id by its upper-case name (CLIP, GPPO), each KL
    estimator's as KL_<name> (KL_NONE, KL_K1), and the offset into ``params`` of each real parameter by its name
    (CLIP_LOW, ...; the id and bool parameters reach the Triton kernels as constexpr arguments instead)."""
    return {**IDS, "KL_NONE": KL_NONE, **{upper_name(p.name): OFFSET[p.name] for p in PARAMS if p.kind == REAL}}


def _python_type(param: Param) -> type:
    return float if param.kind == REAL else bool if param.kind == BOOL else int


def _packed(self) -> Tuple[float, ...]:
    """The one argument of the kernel ops: every field as a float, in the order of PARAMS."""
    return tuple(float(getattr(self, p.name)) for p in PARAMS)


# The kernels' parameters, one field per PARAMS entry in its order (defaults: the table's).
TokenLossParams = dataclasses.make_dataclass(
    "TokenLossParams", [(p.name, _python_type(p), dataclasses.field(default=_python_type(p)(p.default)))
                        for p in PARAMS],
    namespace={"packed": _packed, "__module__": __name__, "__doc__": "The parameters of the fused token loss: "
               + "; ".join(f"{p.name}: {p.doc}" for p in PARAMS) + "."},
    frozen=True)


@dataclasses.dataclass(frozen=True)
class CovarianceChoiceParams:
    objective: int  # CHOOSE_CLIP_COV or CHOOSE_KL_COV
    fraction: float  # k = max(⌊fraction·N⌋, 1) tokens, N the masked ones
    cov_lb: float  # Clip-Cov: a candidate's covariance lies in (cov_lb, cov_ub)
    cov_ub: float
    clip_low: float  # Clip-Cov: PPO's clip bounds 1 − clip_low, 1 + clip_high; a clipped token is no candidate
    clip_high: float
    log_ratio_clamp: float
    scale: float  # a chosen token's output
