"""`make_head`: the hidden-state head of a spec's design (`_head_design`): row chunks or vocabulary blocks."""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from ._linear_head import HeadSpec, LinearHead
from ._vocab_blocks import VocabBlockedHead


def make_head(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor, spec: HeadSpec) -> LinearHead:
    cls = LinearHead if spec.design.kind == "rows" else VocabBlockedHead
    return cls(hidden, weight, bias, targets, spec)
