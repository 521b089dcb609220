"""rlkernels.sampling: against rlkernels.reference on fresh random inputs, brute force over all
m-subsets, hand-computed penalties, and bad inputs."""
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlkernels.sampling import filter_uniform_groups, overlong_penalty, pods_select

DTYPES = [torch.float32, torch.float64]
SEEDS = [0, 1, 2]


@pytest.fixture
def ref():
    return pytest.importorskip("rlkernels.reference")


def random_group_ids(B, gen, max_size=7):
    """(B,) ids of uneven groups (groups of one included), arbitrary id values, shuffled rows."""
    sizes = []
    while sum(sizes) < B:
        sizes.append(min(int(torch.randint(1, max_size + 1, (1,), generator=gen)), B - sum(sizes)))
    values = torch.randperm(1000, generator=gen)[: len(sizes)] - 500
    ids = torch.repeat_interleave(values, torch.tensor(sizes))
    return ids[torch.randperm(B, generator=gen)]


def random_rewards(B, dtype, gen, discrete=False):
    if discrete:  # few distinct values: ties and uniform groups are common
        return torch.randint(0, 3, (B,), generator=gen).to(dtype) / 2
    return torch.randn(B, generator=gen, dtype=torch.float64).to(dtype) * 3 + 1


def pvar(x):
    """Population variance in fp64."""
    return x.double().var(unbiased=False) if x.numel() else torch.zeros((), dtype=torch.float64)


def groups_of(ids):
    return {g: (ids == g).nonzero().flatten() for g in ids.unique().tolist()}


def check_pods_structure(keep, ids, m):
    """Kept indices are int64, strictly increasing, and min(n, m) rows of every group."""
    assert keep.dtype == torch.long
    assert bool((keep[1:] > keep[:-1]).all())
    kept = torch.zeros(ids.shape[0], dtype=torch.bool)
    kept[keep] = True
    for rows in groups_of(ids).values():
        assert int(kept[rows].sum()) == min(len(rows), m)
    return kept


# ---------------------------------------------------------------------------------------------
# pods_select


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("m", [1, 2, 3, 5])
@pytest.mark.parametrize("discrete", [False, True])
def test_pods_select_is_the_brute_force_optimum(seed, m, discrete):
    gen = torch.Generator().manual_seed(seed)
    ids = random_group_ids(30, gen, max_size=9)
    rewards = random_rewards(30, torch.float64, gen, discrete)
    keep = pods_select(rewards, m, ids)
    kept = check_pods_structure(keep, ids, m)
    for rows in groups_of(ids).values():
        if len(rows) <= m:
            continue
        best = max(pvar(rewards[list(c)]) for c in itertools.combinations(rows.tolist(), m))
        torch.testing.assert_close(pvar(rewards[rows[kept[rows]]]), best, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("B,m", [(1, 1), (9, 2), (40, 3), (64, 8)])
@pytest.mark.parametrize("discrete", [False, True])
def test_pods_select_matches_reference(ref, dtype, seed, B, m, discrete):
    gen = torch.Generator().manual_seed(seed)
    ids = random_group_ids(B, gen, max_size=12)
    rewards = random_rewards(B, dtype, gen, discrete)
    keep = pods_select(rewards, m, ids)
    keep_ref = ref.pods_select(rewards, m, ids)
    if not discrete:  # distinct rewards: the optimum is unique
        assert torch.equal(keep, keep_ref)
        return
    # with ties several subsets are optimal: compare what they achieve per group
    check_pods_structure(keep, ids, m)
    kept, kept_ref = torch.zeros(B, dtype=torch.bool), torch.zeros(B, dtype=torch.bool)
    kept[keep], kept_ref[keep_ref] = True, True
    for rows in groups_of(ids).values():
        torch.testing.assert_close(
            pvar(rewards[rows[kept[rows]]]), pvar(rewards[rows[kept_ref[rows]]]), rtol=1e-6, atol=1e-7
        )


@pytest.mark.parametrize("k", [1, 4, 8])
def test_pods_select_group_size_matches_reference(ref, k):
    gen = torch.Generator().manual_seed(k)
    rewards = random_rewards(16, torch.float32, gen)
    assert torch.equal(pods_select(rewards, 3, group_size=k), ref.pods_select(rewards, 3, group_size=k))


def test_pods_select_hand_cases():
    # one group of 6, m = 2: the optimum is the min and the max
    r = torch.tensor([0.3, -1.0, 0.9, 2.5, 0.0, 1.1])
    assert pods_select(r, 2, group_size=6).tolist() == [1, 3]
    # m = 4 over {0,0,0,1,1,1,...}: two of each value is optimal (variance 1/4)
    r = torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    keep = pods_select(r, 4, group_size=6)
    assert len(keep) == 4 and r[keep].sum() == 2
    # groups of <= m rows keep all; a group of one is kept
    ids = torch.tensor([3, 3, 7, 3, 3])
    assert pods_select(torch.tensor([1.0, 2.0, 5.0, 3.0, 4.0]), 4, ids).tolist() == [0, 1, 2, 3, 4]
    assert pods_select(torch.tensor([1.0, 2.0, 5.0, 3.0, 4.0]), 2, ids).tolist() == [0, 2, 4]
    # an empty batch
    assert pods_select(torch.zeros(0), 3, group_size=2).tolist() == []


def test_pods_select_large_offsets_and_many_groups():
    # rewards far from 0 with a small spread: the prefix sums are taken of centred values
    gen = torch.Generator().manual_seed(11)
    r = 1e6 + torch.randn(600, generator=gen, dtype=torch.float64)
    keep = pods_select(r, 3, group_size=6)
    kept = check_pods_structure(keep, torch.arange(600) // 6, 3)
    for g in range(100):
        rows = torch.arange(6 * g, 6 * g + 6)
        best = max(pvar(r[list(c)]) for c in itertools.combinations(rows.tolist(), 3))
        torch.testing.assert_close(pvar(r[rows[kept[rows]]]), best, rtol=1e-9, atol=0)


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(-3, 3)), min_size=1, max_size=16),
    st.integers(1, 5),
)
def test_pods_select_property_brute_force(rows, m):
    ids = torch.tensor([g for g, _ in rows])
    rewards = torch.tensor([float(r) for _, r in rows])
    keep = pods_select(rewards, m, ids)
    kept = check_pods_structure(keep, ids, m)
    for g_rows in groups_of(ids).values():
        if len(g_rows) > m:
            best = max(pvar(rewards[list(c)]) for c in itertools.combinations(g_rows.tolist(), m))
            torch.testing.assert_close(pvar(rewards[g_rows[kept[g_rows]]]), best)


# ---------------------------------------------------------------------------------------------
# overlong_penalty


def test_overlong_penalty_hand_values():
    # max_len 16, buffer 4: free up to 12, then −1/4 per token, −1 from 16 on
    lengths = torch.tensor([0, 5, 12, 13, 14, 15, 16, 17, 100])
    expected = torch.tensor([0, 0, 0, -0.25, -0.5, -0.75, -1, -1, -1])
    out = overlong_penalty(lengths, 16, 4)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(overlong_penalty(lengths, 16, 4, penalty_factor=0.5), expected / 2)
    assert torch.equal(overlong_penalty(lengths, 16, 4, penalty_factor=0), torch.zeros(9))
    # float lengths keep their dtype; any shape
    fl = torch.tensor([[12.5, 20.0], [3.0, 15.0]], dtype=torch.float64)
    out = overlong_penalty(fl, 16, 4)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, torch.tensor([[-0.125, -1.0], [0.0, -0.75]], dtype=torch.float64))
    # buffer 1: a single step from 0 to −1
    assert overlong_penalty(torch.tensor([9, 10, 11]), 10, 1).tolist() == [0.0, -1.0, -1.0]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32, torch.float64])
def test_overlong_penalty_matches_reference(ref, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    lengths = (torch.rand(5, 7, generator=gen) * 300).to(dtype)
    max_len, buffer, factor = [(256, 64, 1.0), (200, 1, 0.3), (300, 299, 2.0)][seed]
    out = overlong_penalty(lengths, max_len, buffer, factor)
    expected = ref.overlong_penalty(lengths, max_len, buffer, factor)
    assert out.dtype == expected.dtype and out.shape == lengths.shape
    torch.testing.assert_close(out, expected)


# ---------------------------------------------------------------------------------------------
# filter_uniform_groups


def test_filter_uniform_groups_hand_values():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.5, 2.0])
    ids = torch.tensor([0, 0, 1, 1, 2, 2, 2, 3])  # uniform, mixed, uniform, single
    assert filter_uniform_groups(rewards, ids).tolist() == [False, False, True, True, False, False, False, False]
    assert filter_uniform_groups(rewards, group_size=4).tolist() == [True] * 4 + [True] * 4
    assert filter_uniform_groups(rewards, group_size=2).tolist() == [False, False, True, True, False, False, True, True]
    assert filter_uniform_groups(torch.zeros(0), group_size=3).tolist() == []


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("B", [1, 10, 50])
def test_filter_uniform_groups_matches_reference(ref, dtype, seed, B):
    gen = torch.Generator().manual_seed(seed)
    ids = random_group_ids(B, gen)
    rewards = random_rewards(B, dtype, gen, discrete=True)
    out = filter_uniform_groups(rewards, ids)
    assert out.dtype == torch.bool
    assert torch.equal(out, ref.filter_uniform_groups(rewards, ids))


# ---------------------------------------------------------------------------------------------
# bad inputs

R8 = torch.randn(8)
L4 = torch.tensor([1, 2, 3, 4])


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda: pods_select(R8, 0, group_size=4), ValueError, r"m: expected an int >= 1, got 0"),
        (lambda: pods_select(R8, 2.0, group_size=4), TypeError, r"m: expected an int, got float"),
        (lambda: pods_select(R8, True, group_size=4), TypeError, r"m: expected an int, got bool"),
        (lambda: pods_select(R8, 2), ValueError, r"group_ids/group_size: expected exactly one"),
        (lambda: pods_select(R8, 2, group_size=3), ValueError, r"group_size: expected a positive int dividing the batch size 8, got 3"),
        (lambda: pods_select(R8, 2, torch.zeros(7, dtype=torch.long)), ValueError, r"group_ids: expected shape \(8,\) matching rewards, got \(7,\)"),
        (lambda: pods_select(R8, 2, torch.zeros(8)), TypeError, r"group_ids: expected an integer dtype"),
        (lambda: pods_select(torch.arange(8), 2, group_size=4), TypeError, r"rewards: expected a floating dtype"),
        (lambda: pods_select(torch.randn(2, 4), 2, group_size=4), ValueError, r"rewards: expected a 1-D tensor"),
        (lambda: overlong_penalty(L4, 16, 0), ValueError, r"buffer: expected an int >= 1, got 0"),
        (lambda: overlong_penalty(L4, 16, 4.0), TypeError, r"buffer: expected an int, got float"),
        (lambda: overlong_penalty(L4, 4, 4), ValueError, r"max_len: expected an int > buffer \(4\), got 4"),
        (lambda: overlong_penalty(L4, 16.0, 4), TypeError, r"max_len: expected an int, got float"),
        (lambda: overlong_penalty(L4, 16, 4, penalty_factor=-1), ValueError, r"penalty_factor: expected a finite number in \[0, inf\)"),
        (lambda: overlong_penalty(L4 > 2, 16, 4), TypeError, r"lengths: expected one of .*, got torch.bool"),
        (lambda: overlong_penalty([1, 2], 16, 4), TypeError, r"lengths: expected a torch.Tensor, got list"),
        (lambda: filter_uniform_groups(R8), ValueError, r"group_ids/group_size: expected exactly one"),
        (lambda: filter_uniform_groups(R8, torch.zeros(8, dtype=torch.long), group_size=8), ValueError, r"group_ids/group_size.*both"),
        (lambda: filter_uniform_groups(R8.long(), group_size=2), TypeError, r"rewards: expected a floating dtype"),
    ],
)
def test_bad_inputs_name_the_argument(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
