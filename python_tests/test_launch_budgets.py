"""Launch and sync budgets of the fused losses (issue: the loss inside the kernels).

Op counts are deterministic (a TorchDispatchMode over one forward + backward, `benchmarks.launches`),
so this is not a timed test: it fails when a change adds launches or a host synchronisation.
"""
import pytest

from benchmarks import launches
from rlkernels import _backend, presets
from rlkernels.ops._plan import kernel_supports

CONFIGS = {name: launches.loss_inputs(name)[0] for name in presets.NAMES}  # with Dr. GRPO's norm_length
# Token-level losses the forward kernel evaluates; the others (Clip-Cov, KL-Cov) choose tokens over the whole call
# first (`covariance_choice`), then take `policy_token_loss` (`ops/_covariance_step.py`)
TOKEN_LEVEL = [name for name in presets.NAMES if kernel_supports(CONFIGS[name])]
GENERAL_TOKEN_LEVEL = [name for name in presets.NAMES if CONFIGS[name].ratio == "token" and name not in TOKEN_LEVEL]
SEQUENCE_LEVEL = [name for name in presets.NAMES if CONFIGS[name].ratio != "token"]
BACKENDS = [b for b in ("cpu", "torch") if _backend.backend_info()[b]["available"]]


@pytest.mark.parametrize("preset", TOKEN_LEVEL)
def test_token_level_logits_path_budget(preset):
    c = launches.fused_policy_loss_count(preset, "cpu")
    assert c.syncs == 0, c.names
    assert c.ops <= 24, c.names
    # the loss is evaluated in the kernel, which on the cpu also writes ∂logits (the two-pass path): no backward kernel
    assert c.names.get("rlkernels_C::policy_token_fwd_grad") == 1, c.names
    assert "rlkernels_C::token_logprobs_bwd" not in c.names, c.names


@pytest.mark.parametrize("preset", TOKEN_LEVEL)
def test_token_level_hidden_state_path_budget(preset):
    per_chunk, besides, syncs = launches.linear_split(preset, "cpu")
    assert syncs == 0
    assert per_chunk <= 8 and besides <= 24, (per_chunk, besides)


@pytest.mark.parametrize("preset", GENERAL_TOKEN_LEVEL)
def test_covariance_objectives_token_level_budget(preset):
    c = launches.fused_policy_loss_count(preset, "cpu")
    assert c.syncs == 0, c.names
    assert c.ops <= 24, c.names
    # the call's choice of tokens in one launch, then the loss per token (no autograd of `losses/`)
    assert c.names.get("rlkernels_C::covariance_choice") == 1, c.names
    assert c.names.get("rlkernels_C::policy_token_loss") == 1, c.names
    per_chunk, besides, syncs = launches.linear_split(preset, "cpu")
    assert syncs == 0
    assert per_chunk <= 8 and besides <= 24, (per_chunk, besides)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("preset", SEQUENCE_LEVEL + GENERAL_TOKEN_LEVEL)
def test_no_host_sync_on_any_path(preset, backend):
    assert launches.fused_policy_loss_count(preset, backend).syncs == 0
    assert launches.fused_linear_policy_loss_count(preset, 512, backend).syncs == 0


@pytest.mark.parametrize("preset", SEQUENCE_LEVEL)
def test_sequence_level_budget(preset):
    """`ops/_sequence_step` evaluates every sequence-level surrogate with `policy_token_loss`: one call for the KL
    and entropy terms, one for the surrogate (SNIS's, REINFORCE as the first call is, comes in that call)."""
    c = launches.fused_policy_loss_count(preset, "cpu")
    calls = 1 if CONFIGS[preset].ratio == "snis" else 2
    assert c.names.get("rlkernels_C::policy_token_loss") == calls, c.names
    assert c.ops <= 48, c.names


@pytest.mark.parametrize("preset", ["gepo", "snis"])
def test_sequence_level_budget_with_group_ids(preset):
    """The same 48 with groups as group_ids (issue 24), though they cost a sort and a searchsorted for the index (built
    once per call) and a scatter (a fill and an add) per group reduction where `group_size` takes a view: each loss
    takes its group statistics in one shared max and one stacked sum."""
    c = launches.fused_policy_loss_count(preset, "cpu", group_ids=True)
    assert c.syncs == 0, c.names
    assert c.names.get("aten::searchsorted") == 1, c.names  # the groups were given as ids
    assert c.ops <= 48, c.names


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("preset,options", [
    ("grpo", dict(top_entropy_quantile=0.2)), ("gspo", dict(top_entropy_quantile=0.2)),
    ("grpo", dict(off_policy_mask=0.01)), ("grpo", dict(kl_bias_correction=True, kl_bias_ratio="sequence")),
    ("cispo", dict(is_weights=True)), ("dro", dict(is_weights=True))])
def test_no_host_sync_with_options_that_leave_the_kernel(preset, options, backend):
    """Options whose terms couple a row's or the call's tokens (a quantile, row means), and importance weights: no
    host sync; the weights stay in the forward kernel, and the token-level options that need its outputs take the
    token step (two `policy_token_loss` calls), not the autograd of `losses/` (the KL times a row's sequence ratio
    still does)."""
    import torch
    import warnings

    import rlkernels
    config, targets, adv, mask, kw = launches.loss_inputs(preset)
    options = dict(options)
    if options.pop("is_weights", False):
        kw["is_weights"] = torch.rand(targets.shape, generator=torch.Generator().manual_seed(0))
    config = config.replace(**options)
    if config.off_policy_mask is not None:
        kw["rollout_logp"] = kw["old_logp"] + 0.05
    logits = torch.randn(*targets.shape, 1000, generator=torch.Generator().manual_seed(1)).requires_grad_(True)

    def call():
        rlkernels.fused_policy_loss(logits, targets, adv, mask, config, backend=backend, **kw).loss.backward()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one-time "general path" warning
        call()
        c = launches.count(call)
    assert c.syncs == 0, c.names
    if backend == "cpu" and "is_weights" in kw:  # the forward step: on the cpu the two-pass row
        assert c.names.get("rlkernels_C::policy_token_fwd_grad") == 1 and c.ops <= 24, c.names
    elif backend == "cpu" and config.ratio == "token" and config.kl_bias_ratio != "sequence":
        assert c.names.get("rlkernels_C::policy_token_loss") == 2, c.names
        assert c.ops <= 64, c.names


@pytest.mark.parametrize("preset", presets.NAMES)
def test_sliced_logits_keep_the_contiguous_budget(preset):
    """`logits[:, :-1]` of a (B, T + 1, V) parent at B = 256 (issue 30): every kernel reads the slice where it lies
    in one launch, so the call keeps the contiguous budgets (token-level 24 ops, sequence-level 48)."""
    c = launches.fused_policy_loss_count(preset, "cpu", B=256, T=8, sliced=True)
    assert c.syncs == 0, c.names
    assert c.ops <= (48 if preset in SEQUENCE_LEVEL else 24), c.names
    # the gradient into the parent's box in one launch: by the two-pass forward (TOKEN_LEVEL) or the backward kernel
    writer = "policy_token_fwd_grad_out" if preset in TOKEN_LEVEL else "token_logprobs_bwd_out"
    assert c.names.get(f"rlkernels_C::{writer}") == 1, c.names


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("preset", ["grpo", "gspo", "clip_cov", "gepo"])
def test_sliced_logits_cost_one_fill_whatever_the_batch(preset, backend):
    """The sliced call makes the contiguous call's ops plus one: the zeros of the parent's positions outside the
    slice (its gradient is written into the parent's shape, `ops/_rows.py`), the same at B = 16 and 256 (it grew by
    about two launches per sequence while the slice was read block by block)."""
    sliced = [launches.fused_policy_loss_count(preset, backend, B=B, T=8, sliced=True) for B in (16, 256)]
    contiguous = launches.fused_policy_loss_count(preset, backend, B=256, T=8)
    assert sliced[0].ops == sliced[1].ops == contiguous.ops + 1, (sliced[1].names, contiguous.names)
    assert sliced[1].names.get("aten::zero_", 0) == contiguous.names.get("aten::zero_", 0) + 1


def _vocab_blocked_count(monkeypatch, preset: str, cols: int, bias: bool):
    """Ops of fused_linear_policy_loss (cpu backend, fp32, V = 1000) on vocabulary blocks of `cols` columns."""
    import torch

    import rlkernels
    from rlkernels.ops import _head_design

    monkeypatch.setattr(_head_design, "choose", lambda *a, **k: _head_design.Design("vocab", cols))
    config, targets, adv, mask, kw = launches.loss_inputs(preset)
    g = torch.Generator().manual_seed(2)
    h = torch.randn(*targets.shape, 64, generator=g).requires_grad_(True)
    w = (torch.randn(1000, 64, generator=g) / 8).requires_grad_(True)
    b = torch.zeros(1000, requires_grad=True) if bias else None

    def call():
        out = rlkernels.fused_linear_policy_loss(h, w, targets, adv, mask, config, bias=b, backend="cpu", **kw)
        out.loss.backward()

    call()
    return launches.count(call)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("preset", ["grpo", "clip_cov", "gspo"])  # token-level, covariance, sequence-level
def test_vocabulary_blocked_hidden_state_path_budget(monkeypatch, preset, bias):
    """Per vocabulary block 7 ops, within the row chunk's 8: forward 2 (the logits GEMM, the statistics kernel),
    backward 5 (GEMM, the −inf fill of its padding, which the backward kernel wrote over, the backward kernel,
    ∂hidden and ∂W GEMMs), and ∂bias's sum; the block the forward ends on is not computed again. Besides the
    blocks, once per call: the targets' range check (3 ops; on every backend, as the kernels read blocks padded with
    −inf: issue 37), the forward's −inf fills (one per block width), the blocks' target ids (9 ops), the
    merge of their statistics (~24), and the two-pass loss step, as a vocabulary-parallel head has (token-level
    losses too: a row's statistics need every block first). A GPU's fp32-output GEMM keeps bf16 at the same
    count; a CPU's upcast adds 2 per block."""
    three, five = (_vocab_blocked_count(monkeypatch, preset, cols, bias) for cols in (499, 249))  # 3 and 5 blocks
    per_block = (five.ops - three.ops) / 2
    besides = three.ops - 3 * per_block
    assert three.syncs == five.syncs == 0
    assert per_block <= 7 + bias and besides <= (70 if preset == "gspo" else 61) + bias, (per_block, besides)
    # GEMMs: the logits 5 forward and 4 backward, ∂W 5, ∂hidden 5 (one writes, four add)
    assert five.names["aten::mm"] + five.names.get("aten::addmm", 0) == 5 + 4 + 5 + 5
