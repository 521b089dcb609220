"""`Run`: one run's state, the object train() passes from phase to phase (loop.py)."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from .run_config import Config


def quiet(*args, **kwargs) -> None:
    """`log` on ranks other than 0: one line per message, not one per rank."""


@dataclasses.dataclass
class Run:
    cfg: Config
    place: Any  # device.Placement
    rank: int
    world: int
    stop: Any  # stop.StopRequest
    saved: Optional[dict]  # the checkpoint a resumed run continues, else None
    t_start: float
    # the task and the policy
    tok: Any = None
    train_set: list = None
    eval_set: list = None
    held_out: str = ""  # what the eval set is, for the log
    reward_fn: Any = None
    reward_context: Any = None  # rewards.RewardContext: TRL's trainer_state, log_metric, log_extra
    rng: Any = None  # prompt order, mini-batch order, tree cut depths
    policy: Any = None
    head_args: dict = None
    # the parts of `cfg` that the steps take (config_parts.py)
    data: Any = None
    warmup: Any = None
    sampling: Any = None
    optim: Any = None
    logs: Any = None
    # the update
    loss_cfg: Any = None
    adv: Any = None  # config_parts.Advantages: the estimator and its settings
    beta: float = 0.0  # the KL coefficient: PPO's adapts
    ref: Any = None
    critic: Any = None
    meta_policy: Any = None  # under FSDP, rank 0's plain copy of the policy for the export
    engine: Any = None
    optimizer: Any = None
    params: list = None
    # progress
    start: int = 0  # the step a resumed run continues after
    eval_before: Optional[float] = None
    skipped_total: int = 0
    stopped: bool = False  # by a signal, at a checkpoint (stop.py)
    folder: Any = None  # run_folder.Claim of --out, on rank 0
    last: dict = dataclasses.field(default_factory=dict)  # the last metrics row
    outputs: Any = None  # outputs.RunLog: metrics, completions, trackers, the progress bar

    @property
    def master(self) -> bool:
        return self.rank == 0

    @property
    def has_answers(self) -> bool:
        """Whether the prompts carry the answer column that exact, regex and the warm-up read."""
        return all("answer" in examples[0] for examples in (self.train_set, self.eval_set) if examples)

    @property
    def out_dir(self) -> str:
        return self.logs.out

    def log(self, *args, **kwargs) -> None:
        (print if self.master else quiet)(*args, **kwargs)
