"""The split row's protocol (kernels/triton/split_row.py) under adversarial schedules of the host model
split_row_protocol.py: the protocol as built always finishes with every row's exact result in every program of the
row whenever K programs are resident, and each broken variant of `MUTATIONS` is caught on some schedule (the model's
checks can fail)."""
import pytest

from split_row_protocol import CORRECT, MUTATIONS, run

SEEDS = range(200)


@pytest.mark.parametrize("rows,chunks,resident", [(3, 3, 3), (4, 4, 7), (5, 1, 2), (2, 5, 5), (6, 2, 3)])
def test_the_protocol_finishes_exact_under_every_schedule(rows, chunks, resident):
    failures = {seed: why for seed in SEEDS if (why := run(CORRECT, seed, rows, chunks, resident))}
    assert not failures, failures


def test_it_needs_k_programs_resident():
    """What the launcher checks (K ≤ the SM count, one resident program per SM at the least): with fewer than K
    resident, every running program can wait on a row whose last item is never taken."""
    assert any("deadlock" in (run(CORRECT, seed, rows=3, chunks=3, resident=2) or "") for seed in SEEDS)


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_each_broken_variant_is_caught(name):
    caught = [why for seed in SEEDS if (why := run(MUTATIONS[name], seed))]
    assert caught, f"{name}: no schedule of {len(SEEDS)} showed it"
