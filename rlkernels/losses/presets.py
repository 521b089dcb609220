"""The presets of docs/math.md §9. Each returns a `PolicyLossConfig`; any field can be overridden.

The built-in presets are declared with their objectives (`losses/objectives.py`, `Objective.presets`), in the
registry's order; `register` adds a user's. Each preset is a function of this module (`presets.grpo()`).
"""
from __future__ import annotations

from . import objectives
from .config import PolicyLossConfig

_PRESETS = objectives.presets()
NAMES = tuple(_PRESETS)
_BUILT_IN = frozenset(_PRESETS)


def fields(name: str) -> dict:
    """The fields preset `name` sets (a copy; the others keep `PolicyLossConfig`'s defaults)."""
    if name not in _PRESETS:
        raise ValueError(f"preset: expected one of {NAMES}, got {name!r}")
    return dict(_PRESETS[name])


def get(name: str, **overrides) -> PolicyLossConfig:
    """The preset called `name` with `overrides` applied."""
    merged = {**fields(name), **overrides}
    if merged.get("agg") == "constant" and merged.get("norm_length") is None:
        raise ValueError(
            f"norm_length: the {name!r} preset divides the summed loss by a constant length (Dr. GRPO) and has no "
            f"default; pass the maximum completion length, e.g. presets.{name}(norm_length=max_completion_length)"
        )
    try:
        return PolicyLossConfig.of(**merged)
    except ValueError as err:
        if str(err).startswith("fields: unknown"):
            raise ValueError(f"overrides{str(err)[len('fields'):]}") from None
        raise


def register(name: str, *, replace: bool = False, **preset_fields) -> None:
    """Add preset `name` with these `PolicyLossConfig` fields, its objective's own scalars among them by name (a
    user's, say for an objective of `register_objective`); it joins `NAMES`, so the trainer and the verl adapter
    offer it. Validated now."""
    global NAMES
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"name: expected an identifier, got {name!r}")
    if name in _PRESETS and (not replace or name in _BUILT_IN):
        raise ValueError(f"name: preset {name!r} exists" + (" (a built-in)" if name in _BUILT_IN else
                                                             "; pass replace=True to replace it"))
    # validated as a config (a Dr. GRPO-like preset leaves norm_length to its caller, as `get` says)
    PolicyLossConfig.of(**{**preset_fields, **({"norm_length": 1} if preset_fields.get("agg") == "constant" else {})})
    _PRESETS[name] = dict(preset_fields)
    NAMES = tuple(_PRESETS)


def unregister(name: str) -> None:
    """Remove a user's preset."""
    global NAMES
    if name in _BUILT_IN or name not in _PRESETS:
        raise ValueError(f"name: expected a registered user preset, got {name!r}")
    del _PRESETS[name]
    NAMES = tuple(_PRESETS)


def _unregister_presets_of(objective: str) -> None:
    """A plug-in's presets go with it (`objectives.unregister_objective`)."""
    for name in [n for n in NAMES if n not in _BUILT_IN and _PRESETS[n].get("objective") == objective]:
        unregister(name)


objectives.on_unregister(_unregister_presets_of)


def _preset(name):
    def make(**overrides) -> PolicyLossConfig:
        return get(name, **overrides)

    make.__name__ = name
    make.__doc__ = f"The `{name}` preset (docs/math.md §9, Presets): {_PRESETS[name]}."
    return make


# presets.ppo, presets.grpo, ...: one function per built-in preset
globals().update({name: _preset(name) for name in NAMES})
