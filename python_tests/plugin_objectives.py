"""Objectives and presets a user registers from outside rlkernels, in plain PyTorch (`rlkernels.register_objective`,
`presets.register`), for the tests of the plug-in paths: a token-level one with PPO's clip, a sequence-level one
without a clip and SPO with a scalar of its own."""
from __future__ import annotations

import contextlib

import torch

import rlkernels
from rlkernels import presets
from rlkernels.losses import objectives


def ppo_clip(*, ratio, advantages, config, **_):
    """PPO's clipped surrogate, written as a user would."""
    clipped = ratio.clamp(1 - config.clip_low, 1 + config.clip_high)
    loss = torch.maximum(-advantages * ratio, -advantages * clipped)
    w = ratio.detach()
    return loss, (w < 1 - config.clip_low) & (advantages < 0), (w > 1 + config.clip_high) & (advantages > 0)


def tanh_weight(*, ratio, advantages, **_):
    """A soft trust region on the sequence ratio: −A·(1 + tanh(s − 1)), whose gradient fades as s leaves 1."""
    return -advantages * (1 + torch.tanh(ratio - 1))


def spo(*, ratio, advantages, config, **_):
    """SPO (Xie et al., ICML 2025): −(A·w − |A|/(2ε)·(w − 1)²), ε its own scalar `my_eps`."""
    return -(advantages * ratio - advantages.abs() / (2 * config.my_eps) * (ratio - 1) ** 2)


# objective -> its own scalars (`register_objective(scalars=...)`)
SCALARS = {"my_spo": {"my_eps": objectives.Scalar(0.2, low=0.0, low_open=True, doc="SPO's ε")}}
# preset -> (objective, its surrogate, the ratios it takes, clip, the preset's fields)
PLUGINS = {
    "my_dapo": ("my_clip", ppo_clip, ("token", "sequence"), True,
                dict(ratio="token", clip_low=0.2, clip_high=0.28, agg="token_mean")),
    "my_seq": ("my_tanh", tanh_weight, ("sequence",), False,
               dict(ratio="sequence", clip_low=None, clip_high=None, agg="seq_mean_token_mean")),
    "my_spo": ("my_spo", spo, ("token", "sequence_sum", "group_expectation"), False,
               dict(ratio="token", my_eps=0.3, agg="token_mean")),
}


def register_objective(preset: str) -> None:
    objective, surrogate, ratios, clip, _ = PLUGINS[preset]
    rlkernels.register_objective(objective, surrogate, ratios=ratios, clip=clip, scalars=SCALARS.get(objective))


def register_preset(preset: str) -> None:
    objective, *_, fields = PLUGINS[preset]
    presets.register(preset, objective=objective, **fields)


@contextlib.contextmanager
def registered(*names: str, preset: bool = True):
    """The plug-ins of `names` registered (their objectives, and their presets unless `preset=False`) inside the
    block; whatever of them is still registered at its end is removed."""
    try:
        for name in names:
            register_objective(name)
            if preset:
                register_preset(name)
        yield
    finally:
        for name in names:
            if name in presets.NAMES:
                presets.unregister(name)
            if PLUGINS[name][0] in objectives.names():
                rlkernels.unregister_objective(PLUGINS[name][0])
