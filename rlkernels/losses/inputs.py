"""`LossInputs`: the `(B, T)` inputs of one policy-loss call besides the log-probs and entropy.

Built by keyword, validated once, read by every path that evaluates the loss: `policy_loss`
(the spec, on `(B, T)` log-probs), the fused ops (whose kernels take the inputs per token, flat)
and the hidden-state path (chunk by chunk, through `flat`). Values are not masked here: the
spec masks what it reads (`masked`, a `Batch`), the kernels read the mask.

No check reads a tensor's values on the host: value checks on device tensors are
`torch._assert_async` (no synchronisation), and the counts of the aggregation stay tensors.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .._checks import FLOAT_DTYPES, check_mask, check_on_device, check_real, check_tensor
from .._groups import check_group_size, check_ids, group_index
from .config import SEQUENCE_RATIOS, PolicyLossConfig
from .objectives import GROUPED_RATIOS
from .rollout_correction import rollout_is_weights, rollout_rejection_mask
from .batch import Batch


@dataclasses.dataclass
class LossInputs:
    mask: Tensor  # (B, T) bool
    adv: Optional[Tensor]  # (B, T) advantages (a broadcast view of adv_row for per-row ones), detached
    adv_row: Optional[Tensor]  # (B,) one advantage per row, when given so or the ratio needs it
    old_logp: Optional[Tensor]  # (B, T) ℓ_old, detached; None: on-policy
    ref_logp: Optional[Tensor]  # (B, T) ℓ_ref, detached; None: no reference
    rewards: Optional[Tensor]  # (B,), snis only
    group: Optional[Tensor]  # (B,) group index in [0, num_groups), grouped ratios from group_ids only
    num_groups: int
    group_size: Optional[int]  # or: the groups are contiguous runs of this many rows (config.group_size)
    num_items: Optional[float]
    num_seqs: Optional[float]
    dtype: torch.dtype  # the dtype every float input was converted to
    is_weights: Optional[Tensor] = None  # (B, T) importance weights of the surrogate terms, detached
    rollout_logp: Optional[Tensor] = None  # (B, T) the sampler's log-probs, detached (the off-policy mask)
    entropy_quantile_group: Optional[object] = None  # process group of top_entropy_quantile's quantile, or None

    @classmethod
    def build(
        cls,
        config: PolicyLossConfig,
        *,
        shape: Tuple[int, int],
        dtype: torch.dtype,
        device: torch.device,
        mask: Tensor,
        advantages: Optional[Tensor] = None,
        old_logp: Optional[Tensor] = None,
        ref_logp: Optional[Tensor] = None,
        group_ids: Optional[Tensor] = None,
        rewards: Optional[Tensor] = None,
        num_items: Optional[float] = None,
        num_seqs: Optional[float] = None,
        is_weights: Optional[Tensor] = None,
        rollout_logp: Optional[Tensor] = None,
        entropy_quantile_group=None,
        what: str = "logp",
    ) -> "LossInputs":
        """Validate the inputs of a `(B, T)` = `shape` batch; `what` names where the shape comes from."""
        if not isinstance(config, PolicyLossConfig):
            raise TypeError(f"config: expected a PolicyLossConfig (see rlkernels.presets), got {type(config).__name__}")
        B, T = shape
        # contiguous: the kernels' inputs are flat views of it and of what is formed from it (a transposed mask)
        mask = check_mask("mask", _per_token("mask", mask, shape, device, what, dtypes=None)).contiguous()

        def float_input(name, t):
            if t is None:
                return None
            return _per_token(name, t, shape, device, what).detach().to(dtype)

        old_logp, ref_logp = float_input("old_logp", old_logp), float_input("ref_logp", ref_logp)
        if config.kl_coef > 0 and ref_logp is None:
            raise ValueError(f"ref_logp: required when kl_coef > 0 (kl_coef={config.kl_coef})")
        num_items, num_seqs = count("num_items", num_items, dtype), count("num_seqs", num_seqs, dtype)
        adv, adv_row = _advantages(advantages, mask, config, shape, dtype, device, what)
        if config.ratio == "snis":
            if rewards is None:
                raise ValueError("rewards: required for ratio='snis' (it takes rewards in place of advantages)")
            check_tensor("rewards", rewards, shape=(B,), dtypes=FLOAT_DTYPES, device=device)
            rewards = rewards.detach().to(dtype)
        group, num_groups, group_size = _groups(config, group_ids, B, device, what)
        is_weights = _is_weights(is_weights, mask, shape, dtype, device, what)
        rollout_logp = float_input("rollout_logp", rollout_logp)
        if config.rollout_is is not None or config.rollout_rs:
            mask, is_weights = _rollout_correction(config, mask, old_logp, rollout_logp, is_weights)
        if entropy_quantile_group is not None and not isinstance(entropy_quantile_group, dist.ProcessGroup):
            raise TypeError("entropy_quantile_group: expected a torch.distributed.ProcessGroup, got "
                            f"{type(entropy_quantile_group).__name__}")
        return cls(mask, adv, adv_row, old_logp, ref_logp, rewards, group, num_groups, group_size, num_items, num_seqs,
                   dtype, is_weights, rollout_logp, entropy_quantile_group)

    def flat(self, name: str) -> Optional[Tensor]:
        """Input `name` as a contiguous `(B·T,)` vector (None stays None), for the kernels."""
        t = getattr(self, name)
        return None if t is None else t.reshape(-1).contiguous()

    def masked(self, logp: Tensor, entropy: Optional[Tensor], config: PolicyLossConfig
               ) -> Tuple[Batch, Optional[Tensor], Optional[Tensor]]:
        """(`Batch`, ℓ_ref, H) at log-probs `logp (B, T)`, every masked position zeroed, so padding
        can hold anything."""
        zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
        where = lambda t: None if t is None else torch.where(self.mask, t, zero)  # noqa: E731
        if entropy is not None:
            check_tensor("entropy", entropy, dtypes=FLOAT_DTYPES)
            if entropy.shape != logp.shape:
                raise ValueError(f"entropy: expected shape {tuple(logp.shape)} matching logp, "
                                 f"got {tuple(entropy.shape)}")
            entropy = entropy.to(logp.dtype)
        if config.entropy_coef != 0 and entropy is None:
            raise ValueError(f"entropy: required when entropy_coef != 0 (entropy_coef={config.entropy_coef})")
        if config.top_entropy_quantile is not None and entropy is None:
            raise ValueError(f"entropy: required when top_entropy_quantile is set ({config.top_entropy_quantile})")
        logp_m = where(logp)
        old = logp_m.detach() if self.old_logp is None else where(self.old_logp)
        batch = Batch(inputs=self, logp=logp_m, old_logp=old, adv=where(self.adv),
                      lengths=self.mask.sum(-1).to(logp.dtype))
        return batch, where(self.ref_logp), where(entropy)


# The keyword arguments of a loss call that go to `LossInputs.build` as they are: declared once, in
# its signature; `policy_loss` and the fused ops take them as `**loss_args` (`takes_loss_args`).
LOSS_ARGS = ("old_logp", "ref_logp", "group_ids", "rewards", "num_items", "num_seqs", "is_weights", "rollout_logp",
             "entropy_quantile_group")


def takes_loss_args(fn: Callable) -> Callable:
    """`fn(..., **loss_args)` with `LOSS_ARGS` as keyword-only arguments in its signature (what `help`,
    IDEs and `inspect` show), declared by `LossInputs.build`; another keyword is a TypeError naming `fn`."""
    sig = inspect.signature(fn)
    own = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    build = inspect.signature(LossInputs.build).parameters
    first_keyword = next((i for i, p in enumerate(own) if p.kind is inspect.Parameter.KEYWORD_ONLY), len(own))
    params = own[:first_keyword] + [build[name] for name in LOSS_ARGS] + own[first_keyword:]
    known = frozenset(p.name for p in params)

    @functools.wraps(fn)
    def with_loss_args(*args, **kwargs):
        for name in kwargs:
            if name not in known:
                raise TypeError(f"{fn.__name__}() got an unexpected keyword argument {name!r}")
        return fn(*args, **kwargs)

    with_loss_args.__signature__ = sig.replace(parameters=params)
    return with_loss_args


def count(name, x, dtype):
    """A global count of the aggregation (None: the call's own), > 0 with a finite inverse in `dtype`."""
    if x is None:
        return None
    x = check_real(name, x, 0, lo_open=True)
    tiny = torch.finfo(dtype).tiny
    if x < tiny:
        raise ValueError(f"{name}: expected a count >= {tiny:.3g} (the aggregation divides by it in {dtype}), "
                         f"got {x!r}")
    return x


def _groups(config: PolicyLossConfig, group_ids, B, device, what):
    """(group index or None, number of groups, size of contiguous groups or None) of a grouped ratio. `group_ids`
    are checked whatever the ratio; given with `config.group_size`, they must describe the same groups."""
    if group_ids is not None:
        check_ids("group_ids", group_ids, B, device, ref_name=f"{what} rows")
    if config.ratio not in GROUPED_RATIOS:
        return None, 0, None
    if group_ids is None and config.group_size is None:
        raise ValueError(f"group_ids: ratio={config.ratio!r} needs group_ids or config.group_size")
    if config.group_size is None:
        group, num_groups = group_index(B, group_ids, None, device, ref_name=f"{what} rows", exact_count=False)
        return group, num_groups, None
    size = check_group_size(B, config.group_size)  # contiguous runs of rows: reductions over a view, no index
    if group_ids is not None:
        runs = group_ids.reshape(-1, size)
        heads = runs[:, 0].sort().values
        check_on_device((runs == runs[:, :1]).all() & (heads[1:] != heads[:-1]).all(),
                        f"group_ids: expected the groups of config.group_size={size} (contiguous runs of {size} rows, "
                        "one id each), got other groups; pass one of the two")
    return None, B // size, size


def _per_token(name, t, shape, device, what, dtypes=FLOAT_DTYPES):
    check_tensor(name, t, dtypes=dtypes)
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)} matching {what}, got {tuple(t.shape)}")
    if t.device != torch.device(device):
        raise ValueError(f"{name}: expected a tensor on {device} like {what}, got one on {t.device}")
    return t


def _is_weights(w, mask, shape, dtype, device, what):
    """Importance weights per token `(B, T)` (or one per row, `(B,)` / `(B, 1)`), detached; finite and
    ≥ 0 on the tokens of the mask (checked on the device; padding may hold anything)."""
    if w is None:
        return None
    check_tensor("is_weights", w, dtypes=FLOAT_DTYPES)
    if w.device != torch.device(device):
        raise ValueError(f"is_weights: expected a tensor on {device} like {what}, got one on {w.device}")
    B, T = shape
    if tuple(w.shape) in ((B,), (B, 1)):
        w = w.reshape(B, 1).expand(B, T)
    elif tuple(w.shape) != (B, T):
        raise ValueError(f"is_weights: expected shape ({B}, {T}), ({B}, 1) or ({B},) matching {what}, got "
                         f"{tuple(w.shape)}")
    w = w.detach().to(dtype)
    valid = torch.where(mask, w, torch.zeros((), dtype=dtype, device=device))
    check_on_device(((valid >= 0) & (valid < float("inf"))).all(), "is_weights: expected finite values >= 0")
    return w


def _rollout_correction(config: PolicyLossConfig, mask, old_logp, rollout_logp, is_weights):
    """(the mask less the tokens rejection sampling drops, the importance weights times the rollout
    correction's), both from ℓ_old and the sampler's ℓ_rollout on the given mask (docs/math.md §7)."""
    if old_logp is None or rollout_logp is None:
        raise ValueError("rollout_logp: config.rollout_is / rollout_rs compare old_logp with the sampler's "
                         "rollout_logp; pass both")
    kept = mask
    for test in config.rejection_tests():  # each on the given mask, as verl's options
        kept = kept & rollout_rejection_mask(old_logp, rollout_logp, mask, log_ratio_clamp=config.log_ratio_clamp,
                                             **test)
    if config.rollout_is is not None:
        w = rollout_is_weights(old_logp, rollout_logp, mask, level=config.rollout_is, mode=config.rollout_is_mode,
                               lower=config.rollout_is_lower, upper=config.rollout_is_upper,
                               batch_normalize=config.rollout_is_batch_normalize,
                               log_ratio_clamp=config.log_ratio_clamp)
        is_weights = w if is_weights is None else is_weights * w
    return kept, is_weights


def _advantages(advantages, mask, config, shape, dtype, device, what):
    """(A per token, A per row or None); sequence-level ratios need one advantage per row."""
    if advantages is None:
        if config.ratio == "snis":
            return None, None
        raise ValueError(f"advantages: required for ratio={config.ratio!r}")
    check_tensor("advantages", advantages, dtypes=FLOAT_DTYPES)
    if advantages.device != torch.device(device):
        raise ValueError(f"advantages: expected a tensor on {device} like {what}, got one on {advantages.device}")
    B, T = shape
    if tuple(advantages.shape) == (B,):
        row = advantages.detach().to(dtype)
        return row[:, None].expand(B, T), row
    if tuple(advantages.shape) != (B, T):
        raise ValueError(f"advantages: expected shape ({B},) or ({B}, {T}) matching {what}, got {tuple(advantages.shape)}")
    adv = advantages.detach().to(dtype)
    if config.ratio not in SEQUENCE_RATIOS:
        return adv, None
    zero = torch.zeros((), dtype=dtype, device=device)
    adv = torch.where(mask, adv, zero)
    row = adv.sum(-1) / mask.sum(-1).clamp(min=1)
    spread = torch.where(mask, adv - row[:, None], zero).abs().amax()
    check_on_device(
        spread <= 1e-6 * (1 + row.abs().max()),
        f"advantages: ratio={config.ratio!r} needs one advantage per row, but a (B, T) advantage varies within a "
        "row; pass (B,) advantages, or use ratio='sequence_token' for per-token advantages",
    )
    return row[:, None].expand(B, T), row
