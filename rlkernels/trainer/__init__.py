"""The thin RL trainer (docs/design.md §10): `train(Config(...))` or `rlkernels train`.

`Config` and `from_args` import neither torch nor transformers (the command line's `--help` and flag errors);
`train` and `loss_head` import them on first use."""
from .run_config import Config, from_args

__all__ = ["Config", "from_args", "train", "loss_head"]


def __getattr__(name: str):
    if name == "train":
        from .loop import train
        return train
    if name == "loss_head":
        from .model import loss_head
        return loss_head
    raise AttributeError(f"module 'rlkernels.trainer' has no attribute {name!r}")
