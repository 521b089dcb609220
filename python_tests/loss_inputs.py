"""Fresh random inputs for the loss tests, shared by the logits and hidden-state paths."""
from __future__ import annotations

import torch


def random_loss_inputs(B=6, T=7, *, dtype=torch.float64, noise=0.3, per_token_adv=False, group_size=3,
                       empty_rows=(1,), seed=None, device="cpu"):
    """A batch with ragged masks (rows in `empty_rows` fully masked), off-policy log-probs
    `noise` away from the current ones, shuffled prompt groups of `group_size` rows, and
    garbage (inf/NaN) in the padding, which no loss may read."""
    g = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**31, ())))
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    for i in empty_rows:
        mask[i] = False
    logp = -torch.rand(B, T, generator=g, dtype=dtype) * 3
    old_logp = logp + noise * r(B, T)
    ref_logp = logp + noise * r(B, T)
    entropy = torch.rand(B, T, generator=g, dtype=dtype) * 2
    adv = r(B, T) if per_token_adv else r(B)
    group_ids = torch.arange(B).div(group_size, rounding_mode="floor")[torch.randperm(B, generator=g)]
    rewards = torch.randint(0, 2, (B,), generator=g).to(dtype)
    for t in (logp, old_logp, ref_logp, entropy):
        t[~mask] = float("nan")
    logp[~mask] = float("inf")
    return dict(
        logp=logp.to(device), advantages=adv.to(device), mask=mask.to(device), old_logp=old_logp.to(device),
        ref_logp=ref_logp.to(device), entropy=entropy.to(device), group_ids=group_ids.to(device),
        rewards=rewards.to(device),
    )


# What a preset has no default for (dr_grpo's constant), and Clip-Cov / KL-Cov fractions large enough that
# the few tokens of a test batch get chosen (their defaults, 2e-4 of the tokens, choose one).
TEST_FIELDS = {
    "dr_grpo": dict(norm_length=11),
    "clip_cov": dict(clip_cov_lb=0.0, clip_cov_ratio=0.25),
    "kl_cov": dict(kl_cov_ratio=0.25),
}


def preset(name, **overrides):
    """`presets.get(name, **overrides)` with `TEST_FIELDS[name]` under the overrides."""
    from rlkernels import presets

    return presets.get(name, **{**TEST_FIELDS.get(name, {}), **overrides})


def preset_case(name, B, T, V, dtype=torch.float32, seed=0, device="cpu"):
    """(config, logits, targets, adv, mask, kw) of preset `name` with an entropy bonus, on `device`: fp64 loss inputs
    rounded to fp32, logits in `dtype` with −inf entries in an unmasked row, a masked all −inf row, a masked row
    with a NaN and a sequence without tokens (B ≥ 3, T ≥ 4)."""
    config = preset(name, entropy_coef=0.01)
    inputs = random_loss_inputs(B, T, dtype=torch.float64, noise=0.2, per_token_adv=True, seed=seed)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g) * 2
    logits[0, 1, ::4] = -torch.inf  # −inf entries in an unmasked row
    logits[1, 2] = -torch.inf  # a masked row that is all −inf
    logits[1, 3, 7] = torch.nan  # a masked row with a NaN
    mask = inputs["mask"].clone()
    mask[0, 1], mask[1, 2:4] = True, False
    mask[2] = False  # a sequence without tokens
    kw = dict(old_logp=inputs["old_logp"].float().to(device), ref_logp=inputs["ref_logp"].float().to(device))
    targets = torch.randint(0, V, (B, T), generator=g)
    targets[0, 1] = 1  # a finite logit (a cap keeps −inf, where the reference's tanh makes it −c)
    return (config, logits.to(device, dtype), targets.to(device), inputs["advantages"].float().to(device),
            mask.to(device), kw)


def check_fused_against_the_composition(config, logits, targets, adv, mask, kw, backend, temperature=1.0):
    """`fused_policy_loss` on `backend` equals its definition `policy_loss(token_logprobs(...))` (torch backend) in
    loss, ∂logits and metrics; returns (the fused output, its ∂logits)."""
    import rlkernels

    x = logits.clone().requires_grad_(True)
    torch.manual_seed(0)  # Clip-Cov's random choice of tokens: the same draw on both paths
    fused = rlkernels.fused_policy_loss(x, targets, adv, mask, config, temperature=temperature, backend=backend, **kw)
    fused.loss.backward()
    y = logits.clone().requires_grad_(True)
    logp, entropy = rlkernels.token_logprobs(y, targets, temperature=temperature, return_entropy=True,
                                             backend="torch")
    torch.manual_seed(0)
    composed = rlkernels.policy_loss(logp, adv, mask, config, entropy=entropy, **kw)
    composed.loss.backward()
    torch.testing.assert_close(fused.loss, composed.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-4, atol=1e-6)
    for key in composed.metrics:
        torch.testing.assert_close(fused.metrics[key], composed.metrics[key], rtol=1e-5, atol=1e-6, msg=key)
    return fused, x.grad
