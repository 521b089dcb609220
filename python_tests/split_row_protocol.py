"""A host model of the split row's protocol (rlkernels/kernels/triton/split_row.py), in plain Python.

The Triton interpreter runs programs one after another, so the kernel's one-launch form (a program waits for its
row's peers) cannot run there. This model runs the protocol's steps as generators under a scheduler that
interleaves them adversarially, with the memory effects a GPU allows:

- a plain store sits in its program's buffer until it is flushed to memory at a random later step, in any order;
  a release atomic flushes its program's stores first;
- a wait with acquire reads the partials after it saw the count complete; a relaxed one may read them (the
  hardware may reorder the loads) as soon as it starts waiting;
- at most `resident` programs run at once; the others start, in random order, as running ones exit;
- one program per run is a laggard, scheduled only rarely (paused, say, between its publish and its arrival), and
  in some runs a program keeps running for several steps in a row (so that its item overtakes its peers').

Per launch every (row, rank) item has its own partial value, and every launch's values differ, so a stale or early
read gives a wrong result. A row's result is the fold of its partials in rank order (floating-point: another order
gives other bits) plus the target's logit, which the chunk holding the target overwrites with its gradient (``out``
is the logits). `run` reports a wrong result, a result that differs between a row's programs, or a deadlock (every
running program waits on a count that no running program can raise). `Variant` names the protocol's choices;
`MUTATIONS` are broken ones, each of which `run` must catch on some schedule.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Optional


@dataclasses.dataclass(frozen=True)
class Variant:
    publish_before_arrive: bool = True  # store the partials, then count the arrival
    release: bool = True  # the arrival flushes the program's stores (else: relaxed)
    acquire: bool = True  # the partials are read after the wait saw K arrivals (else: relaxed, loads hoisted)
    rank_order: bool = True  # merge the partials in rank order (else: in arrival order)
    fresh_counters: bool = True  # zeroed arrival counters for each launch
    tickets: bool = True  # items from a ticket counter (else: item = program id)
    target_before_arrive: bool = True  # rank 0 reads the target's logit before its arrival (else: after the wait)


CORRECT = Variant()
MUTATIONS = {
    "arrive before publish": Variant(publish_before_arrive=False),
    "relaxed arrival": Variant(release=False),
    "relaxed wait": Variant(acquire=False),
    "merge in arrival order": Variant(rank_order=False),
    "counters kept between launches": Variant(fresh_counters=False),
    "items by program id": Variant(tickets=False),
    "target read after the wait": Variant(target_before_arrive=False),
}


def partial(launch, row, rank, chunks=3):
    """A chunk's partial: ±2^40 at the row's ends, between them integers plus 2^-20, which a sum with 2^40 in it
    rounds away (its ulp is 2^-12) and one after the two cancelled keeps: the fold's bits depend on its order. Every
    value is another in each launch and row, so a stale or early read shows."""
    big = 2.0 ** 40 * (1 + launch + 3 * row)
    if rank == 0:
        return big
    if rank == chunks - 1:
        return -big
    return float(1 + (launch * 31 + row) * chunks + rank) + 2.0 ** -20


def target_logit(launch, row):
    return 1000.0 * launch + row + 0.5


def expected(launch, row, chunks):
    total = 0.0
    for rank in range(chunks):
        total += partial(launch, row, rank, chunks)
    return total + target_logit(launch, row)


class _Program:
    def __init__(self, pid):
        self.pid, self.pending, self.waiting_on = pid, {}, None


class _Model:
    def __init__(self, variant: Variant, rows: int, chunks: int, rng: random.Random):
        self.v, self.rows, self.chunks, self.rng = variant, rows, chunks, rng
        self.mem = {("z", r): None for r in range(rows)}
        self.mem.update({("part", r, k): "uninitialised" for r in range(rows) for k in range(chunks)})
        self.mem.update({("zy", r): "uninitialised" for r in range(rows)})
        self.results = {}

    def load(self, p, key):
        return p.pending.get(key, self.mem[key])

    def store(self, p, key, value):
        p.pending[key] = value

    def flush(self, p, key=None):
        for k in [key] if key is not None else list(p.pending):
            self.mem[k] = p.pending.pop(k)

    def new_launch(self, launch):
        self.launch = launch
        self.mem["ticket"] = 0
        for r in range(self.rows):
            self.mem[("z", r)] = target_logit(launch, r)  # the logits of this launch
            self.mem[("order", r)] = []
            if self.v.fresh_counters or launch == 0:
                self.mem[("arrived", r)] = 0

    def program(self, p):
        """The steps of one program; each `yield` is a point where others may run."""
        v, chunks = self.v, self.chunks
        item = p.pid
        if v.tickets:  # one item per program, as the kernel: the next ticket, whichever program starts
            item = self.mem["ticket"]
            self.mem["ticket"] += 1
            yield
        row, rank = divmod(item, chunks)
        owner = chunks - 1  # the chunk that holds the target, and overwrites its logit

        def publish():
            self.store(p, ("part", row, rank), partial(self.launch, row, rank, chunks))
            if rank == 0 and v.target_before_arrive:
                self.store(p, ("zy", row), self.load(p, ("z", row)))

        if v.publish_before_arrive:
            publish()
            yield
        if v.release:
            self.flush(p)
        self.mem[("arrived", row)] += 1
        self.mem[("order", row)].append(rank)
        yield
        if not v.publish_before_arrive:
            publish()
            yield
        keys = [("part", row, k) for k in range(chunks)] + [("zy", row)]
        seen = None if v.acquire else [self.load(p, k) for k in keys]  # loads hoisted above the wait
        p.waiting_on = row
        while self.mem[("arrived", row)] < chunks:
            yield
        p.waiting_on = None
        if rank == 0 and not v.target_before_arrive:
            self.store(p, ("zy", row), self.load(p, ("z", row)))
            self.flush(p)
            yield
        if seen is None:
            seen = [self.load(p, k) for k in keys]
        order = range(chunks) if v.rank_order else self.mem[("order", row)]
        try:
            total = 0.0
            for k in order:
                total += seen[k]
            result = total + seen[-1]
        except TypeError:  # an uninitialised partial
            result = None
        self.results.setdefault(row, {})[rank] = result
        if rank == owner:  # the chunk's gradient over the logits, the target's last
            self.store(p, ("z", row), "gradient")
            yield
        self.flush(p)  # a program's stores are visible once it exits


def run(variant: Variant, seed: int, rows: int = 3, chunks: int = 3, resident: int = 3, launches: int = 2,
        max_steps: int = 100000) -> Optional[str]:
    """None when every launch finished with every row's exact result in every program of the row, else what
    went wrong. The grid is one program per item, as the kernel's; `resident` of them run at once."""
    rng = random.Random(seed)
    model = _Model(variant, rows, chunks, rng)
    for launch in range(launches):
        model.new_launch(launch)
        model.results = {}
        grid = rows * chunks
        waiting = list(range(grid))
        rng.shuffle(waiting)  # the hardware starts blocks in no promised order
        running, laggard, last = {}, None, None
        burst = rng.choice((0.0, 0.5, 0.9))
        for _ in range(max_steps):
            while waiting and len(running) < resident:
                p = _Program(waiting.pop())
                running[p.pid] = (p, model.program(p))
                laggard = laggard if laggard is not None else p.pid
            if not running:
                break
            progress = [pid for pid, (p, _) in running.items()
                        if p.waiting_on is None or model.mem[("arrived", p.waiting_on)] >= chunks]
            if not progress:  # the counts are atomics: no flush of a buffered store can raise one
                return f"launch {launch}: deadlock, programs {sorted(running)} all wait"
            if rng.random() < 0.3:  # a buffered store reaches memory
                holders = [p for p, _ in running.values() if p.pending]
                if holders:
                    p = rng.choice(holders)
                    model.flush(p, rng.choice(list(p.pending)))
            if last in progress and rng.random() < burst:  # runs of one program: any arrival order is reached
                pid = last
            else:
                weights = [0.02 if pid == laggard and len(progress) > 1 else 1.0 for pid in progress]
                pid = rng.choices(progress, weights)[0]
            last = pid
            p, steps = running[pid]
            try:
                next(steps)
            except StopIteration:
                model.flush(p)
                del running[pid]
        else:
            return f"launch {launch}: did not finish in {max_steps} steps"
        for row in range(rows):
            got = model.results.get(row, {})
            want = expected(launch, row, chunks)
            if len(got) != chunks:
                return f"launch {launch}, row {row}: {len(got)} of {chunks} programs finished"
            wrong = {k: r for k, r in got.items() if r != want}
            if wrong:
                got = sorted(set(map(str, wrong.values())))
                return f"launch {launch}, row {row}: ranks {sorted(wrong)} got {got}, expected {want!r}"
    return None
