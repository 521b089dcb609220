"""The thin RL trainer (docs/design.md §10): `train(Config(...))` or `python -m rlkernels.train`."""
from .run_config import Config, from_args
from .loop import train
from .model import loss_head

__all__ = ["Config", "from_args", "train", "loss_head"]
