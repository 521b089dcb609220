"""rlkernels.advantages: against rlkernels.reference on fresh random inputs, hand-derived
values that come from neither implementation, and bad inputs."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlkernels.advantages import gae, group_normalized, rloo, tree_grpo

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-10, atol=1e-10)}
DTYPES = [torch.float32, torch.float64]
SEEDS = [0, 1, 2]


@pytest.fixture
def ref():
    return pytest.importorskip("rlkernels.reference")


def random_group_ids(B, gen):
    """(B,) ids of uneven groups (groups of one included), arbitrary id values, shuffled rows."""
    sizes = []
    while sum(sizes) < B:
        sizes.append(min(int(torch.randint(1, 7, (1,), generator=gen)), B - sum(sizes)))
    values = torch.randperm(1000, generator=gen)[: len(sizes)] - 500  # negative ids too
    ids = torch.repeat_interleave(values, torch.tensor(sizes))
    return ids[torch.randperm(B, generator=gen)]


def random_rewards(B, dtype, gen, discrete=False):
    if discrete:  # 0/1 rewards: uniform groups and ties are common
        return torch.randint(0, 2, (B,), generator=gen).to(dtype)
    return torch.randn(B, generator=gen, dtype=torch.float64).to(dtype) * 3 + 1


# ---------------------------------------------------------------------------------------------
# GAE


def gae_inputs(B, T, dtype, gen, empty_rows=True):
    rewards = torch.randn(B, T, generator=gen, dtype=torch.float64).to(dtype)
    values = torch.randn(B, T, generator=gen, dtype=torch.float64).to(dtype)
    mask = torch.rand(B, T, generator=gen) < 0.7
    if empty_rows and B > 1:
        mask[0] = False  # an empty row
    return rewards, values, mask


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("B,T", [(1, 1), (3, 7), (8, 33)])
@pytest.mark.parametrize("whiten", [True, False])
def test_gae_matches_reference(ref, dtype, seed, B, T, whiten):
    gen = torch.Generator().manual_seed(seed)
    rewards, values, mask = gae_inputs(B, T, dtype, gen)
    gamma, lam = [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)][seed]
    adv, ret = gae(rewards, values, mask, gamma, lam, whiten)
    adv_r, ret_r = ref.gae(rewards, values, mask, gamma, lam, whiten)
    assert adv.dtype == ret.dtype == dtype and adv.shape == ret.shape == (B, T)
    torch.testing.assert_close(ret, ret_r.to(dtype), **TOL[dtype])
    torch.testing.assert_close(adv, adv_r.to(dtype), **TOL[dtype])


def test_gae_empty_mask_matches_reference(ref):
    rewards, values = torch.randn(2, 5), torch.randn(2, 5)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    for whiten in (True, False):
        adv, ret = gae(rewards, values, mask, 0.9, 0.9, whiten)
        adv_r, ret_r = ref.gae(rewards, values, mask, 0.9, 0.9, whiten)
        torch.testing.assert_close(adv, adv_r)
        torch.testing.assert_close(ret, ret_r)


def test_gae_gamma_lam_one_is_reward_to_go_minus_value():
    r = torch.tensor([[1.0, -2.0, 0.5, 3.0]])
    v = torch.tensor([[0.2, 0.4, -1.0, 1.5]])
    adv, ret = gae(r, v, torch.ones(1, 4), 1.0, 1.0, whiten=False)
    to_go = torch.tensor([[2.5, 1.5, 3.5, 3.0]])
    torch.testing.assert_close(ret, to_go)
    torch.testing.assert_close(adv, to_go - v)


def test_gae_lam_zero_is_one_step_td():
    r = torch.tensor([[1.0, -2.0, 0.5]], dtype=torch.float64)
    v = torch.tensor([[0.2, 0.4, -1.0]], dtype=torch.float64)
    adv, _ = gae(r, v, torch.ones(1, 3, dtype=torch.bool), gamma=0.5, lam=0.0, whiten=False)
    expected = [1.0 + 0.5 * 0.4 - 0.2, -2.0 + 0.5 * -1.0 - 0.4, 0.5 - (-1.0)]
    torch.testing.assert_close(adv, torch.tensor([expected], dtype=torch.float64))


def test_gae_full_mask_is_discounted_sum_of_td_errors():
    # A_t = Σ_l (γλ)^l δ_{t+l},  δ_t = r_t + γ V_{t+1} − V_t  (V_T = 0), by explicit double sum
    gen = torch.Generator().manual_seed(3)
    B, T, gamma, lam = 3, 6, 0.9, 0.7
    r = torch.randn(B, T, generator=gen, dtype=torch.float64)
    v = torch.randn(B, T, generator=gen, dtype=torch.float64)
    adv, ret = gae(r, v, torch.ones(B, T), gamma, lam, whiten=False)
    expected = torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):
        for t in range(T):
            for s in range(t, T):
                nxt = v[i, s + 1] if s + 1 < T else 0.0
                expected[i, t] += (gamma * lam) ** (s - t) * (r[i, s] + gamma * nxt - v[i, s])
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected + v)


def test_gae_masked_positions_carry_next_value_and_advantage():
    r = torch.tensor([[1.0, 7.0, 2.0]], dtype=torch.float64)
    v = torch.tensor([[0.5, 9.0, 1.5]], dtype=torch.float64)
    mask = torch.tensor([[True, False, True]])
    gamma, lam = 0.9, 0.8
    adv, ret = gae(r, v, mask, gamma, lam, whiten=False)
    a2 = 2.0 - 1.5
    a0 = (1.0 + gamma * 1.5 - 0.5) + gamma * lam * a2  # skips position 1 entirely
    torch.testing.assert_close(adv, torch.tensor([[a0, a2, a2]], dtype=torch.float64))
    torch.testing.assert_close(ret, adv + v)


def test_gae_whitening_over_valid_tokens():
    gen = torch.Generator().manual_seed(4)
    r, v, mask = gae_inputs(4, 9, torch.float64, gen)
    raw, ret_raw = gae(r, v, mask, 0.95, 0.9, whiten=False)
    adv, ret = gae(r, v, mask, 0.95, 0.9, whiten=True)
    torch.testing.assert_close(ret, ret_raw)  # returns come before whitening
    valid = adv[mask]
    torch.testing.assert_close(valid.mean(), torch.zeros((), dtype=torch.float64))
    var = raw[mask].var()  # Bessel-corrected
    torch.testing.assert_close(valid.var(), var / (var + 1e-8))
    # every position (masked ones too) gets the same affine map
    torch.testing.assert_close(adv, (raw - raw[mask].mean()) / torch.sqrt(var + 1e-8))


def test_gae_rows_are_independent_and_empty_rows_are_zero():
    gen = torch.Generator().manual_seed(5)
    r, v, mask = gae_inputs(4, 6, torch.float64, gen)
    adv, ret = gae(r, v, mask, 0.9, 0.7, whiten=False)
    for i in range(4):
        a_i, r_i = gae(r[i : i + 1], v[i : i + 1], mask[i : i + 1], 0.9, 0.7, whiten=False)
        torch.testing.assert_close(adv[i : i + 1], a_i)
        torch.testing.assert_close(ret[i : i + 1], r_i)
    assert torch.equal(adv[0], torch.zeros(6, dtype=torch.float64))  # row 0 is empty
    torch.testing.assert_close(ret[0], v[0])


def test_gae_single_valid_token_and_empty_batch_whitening():
    r, v = torch.tensor([[2.0, 5.0]]), torch.tensor([[0.5, 1.0]])
    adv, _ = gae(r, v, torch.tensor([[True, False]]), whiten=True)
    # one valid token: centred to 0, variance 0 -> the padding gets (0 − 1.5)/sqrt(1e-8), as verl
    torch.testing.assert_close(adv, torch.tensor([[0.0, -1.5e4]]))
    adv, ret = gae(r, v, torch.zeros(1, 2, dtype=torch.bool), whiten=True)
    assert torch.equal(adv, torch.zeros(1, 2)) and torch.equal(ret, v)
    adv, ret = gae(torch.zeros(0, 3), torch.zeros(0, 3), torch.zeros(0, 3, dtype=torch.bool))
    assert adv.shape == ret.shape == (0, 3)
    adv, ret = gae(torch.zeros(2, 0), torch.zeros(2, 0), torch.zeros(2, 0))
    assert adv.shape == ret.shape == (2, 0)


def test_gae_numeric_mask_dtype_promotion_and_detached():
    gen = torch.Generator().manual_seed(6)
    r, v, mask = gae_inputs(3, 5, torch.float32, gen)
    v64 = v.double().requires_grad_()
    adv_b, ret_b = gae(r, v64, mask)
    adv_f, ret_f = gae(r, v64, mask.float())
    assert adv_b.dtype == torch.float64 and not adv_b.requires_grad and not ret_b.requires_grad
    assert torch.equal(adv_b, adv_f) and torch.equal(ret_b, ret_f)


# ---------------------------------------------------------------------------------------------
# group_normalized, rloo, tree_grpo against the reference


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("B", [1, 5, 37])
@pytest.mark.parametrize("scale", ["group", "batch", None])
@pytest.mark.parametrize("discrete", [False, True])
def test_group_normalized_matches_reference(ref, dtype, seed, B, scale, discrete):
    gen = torch.Generator().manual_seed(seed)
    rewards = random_rewards(B, dtype, gen, discrete)
    ids = random_group_ids(B, gen)
    out = group_normalized(rewards, ids, scale=scale)
    expected = ref.group_normalized(rewards, ids, scale=scale)
    assert out.dtype == dtype and out.shape == (B,)
    torch.testing.assert_close(out, expected.to(dtype), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [1, 2, 4])
def test_group_size_matches_reference(ref, dtype, k):
    gen = torch.Generator().manual_seed(k)
    rewards = random_rewards(12, dtype, gen)
    for scale in ("group", "batch", None):
        torch.testing.assert_close(
            group_normalized(rewards, group_size=k, scale=scale, eps=1e-4),
            ref.group_normalized(rewards, group_size=k, scale=scale, eps=1e-4).to(dtype),
            **TOL[dtype],
        )
    torch.testing.assert_close(
        rloo(rewards, group_size=k), ref.rloo(rewards, group_size=k).to(dtype), **TOL[dtype]
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("B", [1, 6, 41])
@pytest.mark.parametrize("discrete", [False, True])
def test_rloo_matches_reference(ref, dtype, seed, B, discrete):
    gen = torch.Generator().manual_seed(seed)
    rewards = random_rewards(B, dtype, gen, discrete)
    ids = random_group_ids(B, gen)
    out = rloo(rewards, ids)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref.rloo(rewards, ids).to(dtype), **TOL[dtype])


def random_trees(group_ids, gen):
    """Tree ids numbered per prompt (0, 1, ...), so equal tree ids recur across prompts."""
    return torch.randint(0, 3, group_ids.shape, generator=gen)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("B", [1, 7, 40])
@pytest.mark.parametrize("discrete", [False, True])
def test_tree_grpo_matches_reference(ref, dtype, seed, B, discrete):
    gen = torch.Generator().manual_seed(seed)
    rewards = random_rewards(B, dtype, gen, discrete)
    ids = random_group_ids(B, gen)
    # globally unique tree ids, so the test does not depend on how ids are scoped
    trees = ids * 10 + random_trees(ids, gen)
    out = tree_grpo(rewards, ids, trees)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref.tree_grpo(rewards, ids, trees).to(dtype), **TOL[dtype])


# ---------------------------------------------------------------------------------------------
# hand-derived values


@pytest.mark.parametrize("scale", ["group", "batch", None])
def test_identical_group_and_group_of_one_give_exactly_zero(scale):
    rewards = torch.tensor([0.1, 0.1, 0.1, 7.3, 1.0, 2.0])
    ids = torch.tensor([4, 4, 4, 9, 2, 2])
    out = group_normalized(rewards, ids, scale=scale)
    assert torch.equal(out[:4], torch.zeros(4))
    assert torch.equal(rloo(rewards, ids)[:4], torch.zeros(4))
    assert torch.equal(tree_grpo(rewards, ids, torch.zeros(6, dtype=torch.long))[:4], torch.zeros(4))


def test_group_normalized_hand_values():
    rewards = torch.tensor([1.0, 2.0, 6.0, 5.0, 3.0], dtype=torch.float64)
    ids = torch.tensor([0, 0, 0, 1, 1])
    # group 0: mean 3, Bessel std sqrt((4+1+9)/2) = sqrt(7); group 1: mean 4, std sqrt(2)
    centred = torch.tensor([-2.0, -1.0, 3.0, 1.0, -1.0], dtype=torch.float64)
    eps = 1e-6
    s7, s2 = math.sqrt(7), math.sqrt(2)
    torch.testing.assert_close(group_normalized(rewards, ids, scale=None), centred)
    torch.testing.assert_close(
        group_normalized(rewards, ids),
        centred / torch.tensor([s7 + eps] * 3 + [s2 + eps] * 2, dtype=torch.float64),
    )
    # batch std: mean 17/5, Σ(R−mean)² = 17.2, Bessel → sqrt(17.2/4) = sqrt(4.3)
    torch.testing.assert_close(
        group_normalized(rewards, ids, scale="batch", eps=0.0), centred / math.sqrt(4.3)
    )
    # a group of two is ±1/sqrt(2) (up to eps), whatever the two values
    out = group_normalized(torch.tensor([3.0, -5.0]), group_size=2, eps=0.0)
    torch.testing.assert_close(out, torch.tensor([1.0, -1.0]) / math.sqrt(2))


def test_batch_scale_of_a_single_row_is_zero():
    out = group_normalized(torch.tensor([2.5]), group_size=1, scale="batch")
    assert torch.equal(out, torch.zeros(1))


def test_rloo_hand_values():
    r1, r2 = 0.75, -2.0
    torch.testing.assert_close(rloo(torch.tensor([r1, r2]), group_size=2), torch.tensor([r1 - r2, r2 - r1]))
    # group [1, 2, 6]: 1 − 4, 2 − 3.5, 6 − 1.5 ; group of one → 0
    out = rloo(torch.tensor([2.0, 9.0, 1.0, 6.0]), torch.tensor([5, 8, 5, 5]))
    torch.testing.assert_close(out, torch.tensor([-1.5, 0.0, -3.0, 4.5]))


def test_tree_grpo_hand_values():
    rewards = torch.tensor([0.5, 3.0, 3.0, 3.0, 1.0, 0.0], dtype=torch.float64)
    ids = torch.tensor([1, 1, 1, 1, 2, 2])
    trees = torch.tensor([0, 0, 1, 1, 0, 1])  # numbered per prompt
    eps = 1e-6
    # prompt 1: mean 2.375, std sqrt((1.875² + 3·0.625²)/3) = 1.25
    prompt = torch.tensor([-1.875, 0.625, 0.625, 0.625], dtype=torch.float64) / (1.25 + eps)
    # tree (1,0) = {0.5, 3}: ±1.25 / (1.25·sqrt(2) + eps); tree (1,1) = {3, 3}: 0
    d = 1.25 / (1.25 * math.sqrt(2) + eps)
    tree = torch.tensor([-d, d, 0.0, 0.0], dtype=torch.float64)
    # prompt 2 = {1, 0}: ±1/sqrt(2); its trees are single rows → 0
    p2 = 0.5 / (math.sqrt(0.5) + eps)
    expected = torch.cat([prompt + tree, torch.tensor([p2, -p2], dtype=torch.float64)])
    torch.testing.assert_close(tree_grpo(rewards, ids, trees), expected)
    # the same trees numbered across the batch give the same result
    torch.testing.assert_close(tree_grpo(rewards, ids, ids * 10 + trees), expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sixteen_bit_inputs_are_computed_and_returned_in_fp32(ref, dtype):
    rewards = torch.tensor([100.0, 101.0, 102.0, 103.0, 7.0, 8.0]).to(dtype)
    ids = torch.tensor([0, 0, 0, 0, 1, 1])
    out = group_normalized(rewards, ids, scale=None)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor([-1.5, -0.5, 0.5, 1.5, -0.5, 0.5]))
    for fn in (lambda r: group_normalized(r, ids), lambda r: rloo(r, ids)):
        assert fn(rewards).dtype == torch.float32
        torch.testing.assert_close(fn(rewards), fn(rewards.float()))
    t = tree_grpo(rewards, ids, ids)
    assert t.dtype == torch.float32
    torch.testing.assert_close(t, ref.tree_grpo(rewards, ids, ids))
    gen = torch.Generator().manual_seed(8)
    r, v, mask = gae_inputs(3, 5, torch.float32, gen)
    adv, ret = gae(r.to(dtype), v.to(dtype), mask, 0.9, 0.9)
    assert adv.dtype == ret.dtype == torch.float32
    adv_r, ret_r = ref.gae(r.to(dtype), v.to(dtype), mask, 0.9, 0.9)
    torch.testing.assert_close(adv, adv_r)
    torch.testing.assert_close(ret, ret_r)


# ---------------------------------------------------------------------------------------------
# properties


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 4), st.floats(-100, 100)), min_size=1, max_size=20),
    st.sampled_from(["group", "batch", None]),
    st.randoms(use_true_random=False),
)
def test_permutation_equivariance_and_loo_identity(rows, scale, rnd):
    ids = torch.tensor([g for g, _ in rows])
    rewards = torch.tensor([r for _, r in rows], dtype=torch.float64)
    perm = list(range(len(rows)))
    rnd.shuffle(perm)
    perm = torch.tensor(perm)
    out = group_normalized(rewards, ids, scale=scale)
    torch.testing.assert_close(group_normalized(rewards[perm], ids[perm], scale=scale), out[perm])
    loo = rloo(rewards, ids)
    torch.testing.assert_close(rloo(rewards[perm], ids[perm]), loo[perm])
    # R_i − mean_{j≠i} R_j, written directly
    for i in range(len(rows)):
        others = rewards[(ids == ids[i]) & (torch.arange(len(rows)) != i)]
        want = rewards[i] - others.mean() if len(others) else torch.zeros((), dtype=torch.float64)
        torch.testing.assert_close(loo[i], want, rtol=1e-9, atol=1e-9)


def test_group_ids_and_group_size_agree():
    rewards = torch.randn(12, generator=torch.Generator().manual_seed(7))
    ids = torch.arange(12) // 3
    for scale in ("group", "batch", None):
        assert torch.equal(group_normalized(rewards, ids, scale=scale), group_normalized(rewards, group_size=3, scale=scale))
    assert torch.equal(rloo(rewards, ids), rloo(rewards, group_size=3))


# ---------------------------------------------------------------------------------------------
# bad inputs

R8 = torch.randn(8)
BT = torch.randn(2, 3)


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda: group_normalized(R8), ValueError, r"group_ids/group_size: expected exactly one.*neither"),
        (lambda: group_normalized(R8, torch.zeros(8, dtype=torch.long), group_size=2), ValueError, r"group_ids/group_size.*both"),
        (lambda: group_normalized(R8, torch.zeros(7, dtype=torch.long)), ValueError, r"group_ids: expected shape \(8,\) matching rewards, got \(7,\)"),
        (lambda: group_normalized(R8, torch.zeros(8)), TypeError, r"group_ids: expected an integer dtype, got torch.float32"),
        (lambda: group_normalized(R8, torch.zeros(8, dtype=torch.bool)), TypeError, r"group_ids: expected an integer dtype"),
        (lambda: group_normalized(R8, torch.zeros(2, 4, dtype=torch.long)), ValueError, r"group_ids: expected a 1-D tensor"),
        (lambda: group_normalized(R8, [0] * 8), TypeError, r"group_ids: expected a torch.Tensor, got list"),
        (lambda: group_normalized(R8, group_size=3), ValueError, r"group_size: expected a positive int dividing the batch size 8, got 3"),
        (lambda: group_normalized(R8, group_size=0), ValueError, r"group_size: expected a positive int, got 0"),
        (lambda: group_normalized(R8, group_size=2.0), TypeError, r"group_size: expected an int, got float"),
        (lambda: group_normalized(R8, group_size=True), TypeError, r"group_size: expected an int, got bool"),
        (lambda: group_normalized(R8, group_size=2, scale="std"), ValueError, r"scale: expected one of 'group', 'batch', None, got 'std'"),
        (lambda: group_normalized(R8, group_size=2, eps=-1.0), ValueError, r"eps: expected a finite number in \[0, inf\)"),
        (lambda: group_normalized(torch.arange(8), group_size=2), TypeError, r"rewards: expected a floating dtype, got torch.int64"),
        (lambda: group_normalized(torch.randn(2, 4), group_size=2), ValueError, r"rewards: expected a 1-D tensor, got shape \(2, 4\)"),
        (lambda: group_normalized([1.0, 2.0], group_size=2), TypeError, r"rewards: expected a torch.Tensor, got list"),
        (lambda: rloo(R8, group_size=5), ValueError, r"group_size: expected a positive int dividing"),
        (lambda: rloo(R8, torch.zeros(9, dtype=torch.long)), ValueError, r"group_ids: expected shape \(8,\)"),
        (lambda: tree_grpo(R8, torch.zeros(8, dtype=torch.long), torch.zeros(7, dtype=torch.long)), ValueError, r"tree_ids: expected shape \(8,\) matching rewards, got \(7,\)"),
        (lambda: tree_grpo(R8, torch.zeros(8, dtype=torch.long), torch.zeros(8)), TypeError, r"tree_ids: expected an integer dtype"),
        (lambda: tree_grpo(R8, None, torch.zeros(8, dtype=torch.long)), ValueError, r"group_ids/group_size: expected exactly one"),
        (lambda: tree_grpo(R8, torch.zeros(8, dtype=torch.long), torch.zeros(8, dtype=torch.long), eps=float("nan")), ValueError, r"eps: expected a finite number"),
        (lambda: gae(torch.randn(6), torch.randn(6), torch.ones(6)), ValueError, r"rewards: expected a 2-D tensor, got shape \(6,\)"),
        (lambda: gae(BT, torch.randn(2, 4), torch.ones(2, 3)), ValueError, r"values: expected shape \(2, 3\) matching rewards, got \(2, 4\)"),
        (lambda: gae(BT, BT, torch.ones(3, 2)), ValueError, r"mask: expected shape \(2, 3\) matching rewards, got \(3, 2\)"),
        (lambda: gae(BT, BT, torch.full((2, 3), 0.5)), ValueError, r"mask: expected a bool tensor or numbers that are all 0 or 1"),
        (lambda: gae(BT, BT.long(), torch.ones(2, 3)), TypeError, r"values: expected a floating dtype, got torch.int64"),
        (lambda: gae(BT.long(), BT, torch.ones(2, 3)), TypeError, r"rewards: expected a floating dtype"),
        (lambda: gae(BT, BT, torch.ones(2, 3), gamma=1.5), ValueError, r"gamma: expected a finite number in \[0, 1\], got 1.5"),
        (lambda: gae(BT, BT, torch.ones(2, 3), lam=-0.1), ValueError, r"lam: expected a finite number in \[0, 1\], got -0.1"),
        (lambda: gae(BT, BT, torch.ones(2, 3), gamma=torch.tensor(0.9)), TypeError, r"gamma: expected a real number, got Tensor"),
        (lambda: gae(BT, BT, torch.ones(2, 3), whiten=1), TypeError, r"whiten: expected a bool, got int"),
        (lambda: gae(BT, BT, torch.ones(2, 3, device="meta")), ValueError, r"mask: expected a tensor on cpu like rewards"),
        (lambda: rloo(R8, torch.zeros(8, dtype=torch.long, device="meta")), ValueError, r"group_ids: expected a tensor on cpu like rewards"),
    ],
)
def test_bad_inputs_name_the_argument(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
