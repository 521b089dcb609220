"""Issue 32 item 6: the trainer's steps take the parts of the config they use (trainer/config_parts.py), so that the
whole Config's walk through the trainer is at most half of what it was (11 files, 212 attribute reads, counted by
benchmarks/config_walk.py before the parts). The counter itself is checked on a small source."""
import ast
import textwrap

from benchmarks import config_walk

BEFORE_FILES, BEFORE_READS = 11, 212


def test_the_config_walk_stays_at_most_half_of_what_it_was():
    files = config_walk.walk()
    reads = sum(w.reads for w in files.values())
    assert len(files) <= BEFORE_FILES // 2, sorted(files)
    assert reads <= BEFORE_READS // 2, {name: w.reads for name, w in files.items()}


def test_the_steps_read_parts_not_the_config():
    files = config_walk.walk()
    for step in ("generation.py", "update.py", "estimators.py", "data.py", "rewards.py", "trackers.py", "state.py"):
        assert f"rlkernels/trainer/{step}" not in files


def _walk(source):
    tree = ast.parse(textwrap.dedent(source))
    return [config_walk._walk_scope(scope) for scope in config_walk._scopes(tree)]


def test_the_counter_counts_reads_through_every_way_of_holding_the_config():
    walks = _walk("""
        def a(run, step):
            cfg, rank = run.cfg, run.rank
            x = run.cfg.steps + cfg.lr + getattr(cfg, "seed")
            c2 = dataclasses.replace(cfg, steps=1)
            f(c2.out, c2)

        def b(settings: Config):
            return settings.out

        def c(part):
            config = LlamaConfig(n=part.n)
            return Model(config)
    """)
    module, a, b, c = walks
    assert module.reads == -1  # no config at the top level
    assert (a.reads, a.hand_ons) == (4, 1)
    assert (b.reads, b.hand_ons) == (1, 0)
    assert c.reads == -1  # a transformers config of its own


def test_a_parameter_of_another_name_that_is_handed_the_config_counts():
    caller = ast.parse(textwrap.dedent("""
        def load_policy(run):
            cfg = run.cfg
            return task.tiny_model(cfg, 3), build(n=2, shape=cfg)
    """))
    callee = ast.parse(textwrap.dedent("""
        def tiny_model(shape, n):
            return shape.n_layer + shape.n_embd

        def build(n, shape):
            return shape.n_head

        def untouched(shape):
            return shape.n_layer
    """))
    given = config_walk._handed_to([caller, callee])
    assert config_walk._walk_tree(callee, given) == (3, 0)
