"""rlkernels: fused kernels for the loss head of RL fine-tuning of language models.

Layers (docs/design.md §1), bottom up: the shared helpers; `kernels` (passes over logits) and
`losses` (RL objectives), which do not know each other, with `advantages` / `sampling` beside them;
`ops` (autograd-aware torch.library ops, backend dispatch) on kernels and losses; then
`integrations`, `trainer` and the command line. `reference` (the naive truth) is imported by none.

The public names are imported on first use (PEP 562), so that the `rlkernels` command answers `--help` and
flag errors without importing torch. The ops (`torch.ops.rlkernels_C.*`, `torch.ops.rlkernels.*`) are defined as
soon as both rlkernels and torch are imported, in either order (`_define_ops_with_torch`): an exported or compiled
graph finds them before any rlkernels function has run.
"""
import importlib
import importlib.abc
import importlib.util
import sys
import warnings

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
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'rlkernels' has no attribute {name!r}") from None
    else:
        value = _public(name)
        globals()[name] = value  # once: later lookups do not come here
    if _PENDING:  # torch came in the middle of that import (`_define_ops`): the package is whole now
        _define_ops()
    return value


def __dir__():
    return sorted({*globals(), *__all__})


_PENDING = False  # torch was imported by one of our own modules while it was still being imported


def _define_ops() -> None:
    global _PENDING
    _PENDING = False
    if any(getattr(getattr(m, "__spec__", None), "_initializing", False) for k, m in list(sys.modules.items())
           if k.startswith(__name__ + ".")):
        _PENDING = True  # `from rlkernels import presets` importing torch: define them once that import is done
        return
    try:
        from .ops.token_logprobs import define_available
        define_available()
    except Exception as e:  # never break `import torch` or `import rlkernels`; the first call then says what fails
        warnings.warn(f"rlkernels: its torch ops could not be defined at import ({type(e).__name__}: {e})")


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Defines the ops right after `import torch`, where `import rlkernels` came first (isort's order): torch's own
    loader runs unchanged, then `_define_ops`. It removes itself at that import."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                _define_ops()

            spec.loader.exec_module = exec_module
        return spec


def _define_ops_with_torch() -> None:
    if "torch" in sys.modules:
        _define_ops()
    elif not any(isinstance(f, _AfterTorch) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorch())


_define_ops_with_torch()
