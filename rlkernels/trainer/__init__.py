"""The thin RL trainer (docs/design.md §10): `train(Config(...))` or `python -m rlkernels.train`."""
from .config import Config, from_args
from .loop import loss_head, train

__all__ = ["Config", "from_args", "train", "loss_head"]
