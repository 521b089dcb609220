"""The Config's walk through the trainer (benchmarks/config_walk.py): issue 32 item 6 gave the steps parts of the
config instead of the whole Config (11 files, 212 attribute reads before); issue 40 item 12 counts the parts too,
from loop.train. The counter itself is checked on small sources."""
import functools
import textwrap

from benchmarks import config_walk

BEFORE_FILES, BEFORE_READS = 11, 212  # the whole Config alone, outside its home, before issue 32's parts


@functools.lru_cache(maxsize=None)
def _package_walk(parts: bool = True):
    return config_walk.walk(parts=parts)


def _outside_home(report):
    return {name: w for name, w in report.files.items() if name not in config_walk.CONFIG_HOME}


def test_the_whole_config_walk_stays_at_most_half_of_what_it_was():
    files = _outside_home(_package_walk(parts=False))
    reads = sum(w.reads for w in files.values())
    assert len(files) <= BEFORE_FILES // 2, sorted(files)
    assert reads <= BEFORE_READS // 2, {name: w.reads for name, w in files.items()}


def test_the_steps_read_parts_not_the_config():
    files = _package_walk(parts=False).files
    for step in ("generation", "update", "estimators", "data", "rewards", "trackers", "state"):
        assert f"trainer.{step}" not in files


def _report(**modules):
    return config_walk.walk({name.replace("__", "."): textwrap.dedent(text) for name, text in modules.items()})


def test_the_counter_counts_reads_through_every_way_of_holding_the_config():
    report = _report(trainer__loop="""
        from .run_config import Config
        from . import other

        def train(run, settings: Config):
            cfg, rank = run.cfg, run.rank
            x = run.cfg.steps + cfg.lr + getattr(cfg, "seed") + settings.out
            c2 = dataclasses.replace(cfg, steps=1)
            f(c2.out, c2)
            other.c(3)

        def untouched(cfg):
            return cfg.steps
    """, trainer__other="""
        def c(part):
            config = LlamaConfig(n=part.n)
            return Model(config)
    """)
    # train: 5 reads, one hand-on (to f, no function of these files); `untouched` is not reached from train,
    # and other.c's `config` is a transformers config of its own
    assert {name: (w.reads, w.hand_ons, w.functions) for name, w in report.files.items()} == {
        "trainer.loop": (5, 1, 1)}


def test_a_part_and_a_parameter_of_another_name_that_is_handed_it_count():
    report = _report(trainer__loop="""
        from . import config_parts, task
        from .helpers import check

        def train(run):
            run.sampling = config_parts.sampling(run.cfg)
            task.tiny_model(run.sampling, 3)
            task.build(n=2, shape=run.sampling)
            check(run.sampling)
    """, trainer__config_parts="""
        class Sampling:
            n_layer: int

        def sampling(cfg):
            return Sampling(cfg.n_layer)
    """, trainer__task="""
        def tiny_model(shape, n):
            return shape.n_layer + shape.n_embd

        def build(n, shape):
            return shape.n_head

        def check(shape):  # a function of the same name in another module: not the one loop calls
            return shape.n_layer
    """, trainer__helpers="""
        def check(x):
            return 1
    """)
    files = report.files
    assert (files["trainer.task"].reads, files["trainer.task"].functions) == (3, 2)
    assert files["trainer.loop"].hand_ons == 4  # to sampling, tiny_model, build, check
    assert files["trainer.config_parts"].reads == 1
    assert "trainer.helpers" not in files  # handed the part, reads nothing of it


def test_a_forwarder_that_calls_back_up_the_layers_is_a_back_up():
    report = _report(trainer__loop="""
        from . import sharding, generation

        def train(run):
            sharding.gathered(run.engine, generation.sample, run.tok, run.cfg)
            sharding.gathered(run.engine, lambda: generation.sample(run.tok, run.cfg))
    """, trainer__sharding="""
        def gathered(root, fn, *args):
            return fn(*args)
    """, trainer__generation="""
        from . import task

        def sample(tok, cfg):
            return cfg.max_new_tokens
    """, trainer__task="""
        from . import sharding
    """)
    # sharding (layer 0) calls generation (layer 2, above task, above sharding) with the config: one back-up;
    # the thunk hands sharding nothing
    assert report.back_ups == ["trainer.sharding → trainer.generation.sample(cfg)"]
    assert report.files["trainer.sharding"].hand_ons == 1


def test_a_closure_and_a_method_see_the_config_of_their_holder():
    report = _report(trainer__loop="""
        from . import config_parts, generation

        def train(run):
            run.sampling = config_parts.take(run.cfg)
            part = run.sampling
            return gathered(lambda: generation.sample(part)), run.out
    """, trainer__config_parts="""
        def take(cfg):
            return cfg.n
    """, trainer__generation="""
        def sample(part):
            return part.n
    """, trainer__state="""
        class Run:
            @property
            def out(self):
                return self.sampling.out
    """)
    files = report.files
    assert files["trainer.generation"].reads == 1  # handed `part` by the lambda, which sees train's names
    assert (files["trainer.state"].reads, files["trainer.state"].where) == (1, {"out"})


def test_values_mode_follows_a_setting_handed_on_as_a_value():
    sources = dict(trainer__loop="""
        from . import device

        def train(run):
            return device.placement(run.cfg.device)
    """, trainer__device="""
        def placement(device_spec):
            return resolve(device_spec)

        def resolve(spec):
            return spec
    """)
    assert "trainer.device" not in _report(**sources).files  # a plain argument
    values = config_walk.walk({k.replace("__", "."): textwrap.dedent(v) for k, v in sources.items()}, values=True)
    assert values.files["trainer.device"].where == {"placement", "resolve"}
