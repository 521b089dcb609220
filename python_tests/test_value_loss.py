"""`value_loss` (docs/math.md §12) against the reference and by hand."""
from __future__ import annotations

import pytest
import torch

import rlkernels
from rlkernels import reference


def _inputs(B=5, T=6, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(B, T, generator=g, dtype=dtype)
    old = values + 0.3 * torch.randn(B, T, generator=g, dtype=dtype)
    returns = torch.randn(B, T, generator=g, dtype=dtype)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[1] = False
    return values, old, returns, mask


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant"])
@pytest.mark.parametrize("clip", [0.2, None, 0.05])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_reference(agg, clip, dtype):
    for seed in range(3):
        values, old, returns, mask = _inputs(seed=seed, dtype=dtype)
        v = values.clone().requires_grad_(True)
        length = dict(norm_length=9) if agg == "constant" else {}
        out = rlkernels.value_loss(v, old, returns, mask, clip=clip, agg=agg, **length)
        (grad,) = torch.autograd.grad(out.loss, v)
        v_ref = values.clone().requires_grad_(True)
        loss_ref, metrics_ref = reference.value_loss(v_ref, old, returns, mask, clip=clip, agg=agg, **length)
        (grad_ref,) = torch.autograd.grad(loss_ref, v_ref)
        torch.testing.assert_close(out.loss, loss_ref)
        torch.testing.assert_close(grad, grad_ref)
        torch.testing.assert_close(out.metrics["vf_clip_frac"], metrics_ref["vf_clip_frac"])


def test_by_hand():
    # one token: V = 1.0, V_old = 0.0, R = 2.0, ε = 0.2: unclipped (1-2)² = 1, clipped (0.2-2)² = 3.24
    v = torch.tensor([[1.0]], dtype=torch.float64, requires_grad=True)
    out = rlkernels.value_loss(v, torch.zeros(1, 1, dtype=torch.float64), torch.full((1, 1), 2.0, dtype=torch.float64),
                               torch.ones(1, 1, dtype=torch.bool))
    torch.testing.assert_close(out.loss, torch.tensor(0.5 * 3.24, dtype=torch.float64))
    (grad,) = torch.autograd.grad(out.loss, v)
    assert float(grad) == 0.0 and float(out.metrics["vf_clip_frac"]) == 1.0  # clipped branch: V outside the band


def test_empty_mask_and_bad_inputs():
    values, old, returns, mask = _inputs()
    v = values.clone().requires_grad_(True)
    out = rlkernels.value_loss(v, old, returns, torch.zeros_like(mask))
    (grad,) = torch.autograd.grad(out.loss, v)
    assert float(out.loss) == 0.0 and (grad == 0).all()
    with pytest.raises(ValueError, match="returns"):
        rlkernels.value_loss(values, old, returns[:, :3], mask)
    with pytest.raises(ValueError, match="clip"):
        rlkernels.value_loss(values, old, returns, mask, clip=-0.1)
    with pytest.raises(ValueError, match="agg"):
        rlkernels.value_loss(values, old, returns, mask, agg="mean")


def test_constant_aggregation_does_not_change_with_padding():
    """agg="constant" divides by norm_length (required), so padding the batch changes nothing (it divided by the
    padded T: 0.50 / 0.25 / 0.15 for the same tokens); a count whose inverse overflows is refused, not inf."""
    values, old, returns, mask = _inputs(T=6)
    losses = []
    for pad in (0, 6, 14):
        z = torch.zeros(values.shape[0], pad, dtype=values.dtype)
        padded = [torch.cat([x, z], 1) for x in (values, old, returns)]
        m = torch.cat([mask, torch.zeros(mask.shape[0], pad, dtype=torch.bool)], 1)
        losses.append(rlkernels.value_loss(*padded, m, agg="constant", norm_length=8).loss)
    torch.testing.assert_close(losses[1], losses[0])
    torch.testing.assert_close(losses[2], losses[0])
    with pytest.raises(ValueError, match="norm_length"):
        rlkernels.value_loss(values, old, returns, mask, agg="constant")
    with pytest.raises(ValueError, match="num_items: expected a count"):
        rlkernels.value_loss(values.float(), old.float(), returns.float(), mask, num_items=1e-45)
