"""rlkernels: fused kernels for the loss head of RL fine-tuning of language models.

Layers (docs/design.md §1), bottom up: the shared helpers; `kernels` (passes over logits) and
`losses` (RL objectives), which do not know each other, with `advantages` / `sampling` beside them;
`ops` (autograd-aware torch.library ops, backend dispatch) on kernels and losses; then
`integrations`, `trainer` and the command line. `reference` (the naive truth) is imported by none.

The public names are imported on first use (PEP 562), so that the `rlkernels` command answers `--help` and
flag errors without importing torch; `import rlkernels` alone registers no op.
"""
import importlib

__version__ = "0.1.0"
__all__ = [
    "token_logprobs",
    "fused_policy_loss",
    "linear_token_logprobs",
    "fused_linear_policy_loss",
    "policy_loss",
    "value_loss",
    "rollout_is_weights",
    "rollout_rejection_mask",
    "PolicyLossConfig",
    "LossOutput",
    "presets",
    "register_objective",
    "unregister_objective",
    "advantages",
    "sampling",
    "backend_info",
]


def _public(name: str):
    """The public name `name`, from the module that defines it (the imports below are the whole list)."""
    if name in ("advantages", "sampling"):
        return importlib.import_module(f".{name}", __name__)
    if name == "backend_info":
        from ._backend import backend_info
        return backend_info
    if name in ("token_logprobs", "fused_policy_loss", "linear_token_logprobs", "fused_linear_policy_loss"):
        from . import ops
        return getattr(ops, name)
    from . import losses  # LossOutput, PolicyLossConfig, policy_loss, presets, rollout_*, value_loss
    return getattr(losses, name)


def __getattr__(name: str):
    if name not in __all__:  # a submodule (`rlkernels.ops`), as after the eager imports this package once made
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'rlkernels' has no attribute {name!r}") from None
    value = _public(name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__():
    return sorted({*globals(), *__all__})
