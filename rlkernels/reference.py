"""The naive mathematical truth of rlkernels (docs/math.md; the § numbers below are its sections).

Every kernel and every vectorised implementation is tested against this file. It is written
to be read next to the spec: full log_softmax, everything materialised, Python loops over rows
and groups. It depends on torch only, computes in the dtype of its inputs (fp16/bf16 upcast to
fp32, fp64 kept), and is differentiable by ordinary autograd (`sg` = `.detach()`).
"""
import math

import torch


def _dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _clamp(x, lo, hi):
    """torch.clamp that accepts both bounds None."""
    return x if lo is None and hi is None else torch.clamp(x, lo, hi)


def _groups(B, group_ids=None, group_size=None):
    """List of row-index lists, one per group (group_ids wins; neither = one group of all rows)."""
    if group_ids is not None:
        groups = {}
        for i, g in enumerate(group_ids.tolist()):
            groups.setdefault(g, []).append(i)
        return list(groups.values())
    if group_size is not None:
        return [list(range(s, s + group_size)) for s in range(0, B, group_size)]
    return [list(range(B))]


def _mean(xs):
    """Mean of a non-empty list of numbers or 0-d tensors."""
    return sum(xs) / len(xs)


def _bessel_std(x):
    """Bessel-corrected std of a 1-D tensor; 0 for fewer than two values."""
    n = x.numel()
    if n < 2:
        return x.new_zeros(())
    return torch.sqrt(((x - x.mean()) ** 2).sum() / (n - 1))


# ---------------------------------------------------------------------------------------------
# §2 per-token log-probs and entropy

def token_logprobs(logits, targets, temperature=1.0, softcap=None):
    """(logp, entropy) of shape targets.shape; fp64 if logits are fp64, else fp32. softcap c: of
    the capped logits c·tanh(z/c) (a −inf logit stays −inf)."""
    z = logits.to(_dtype(logits))
    if softcap is not None:                              # §2: y = c·tanh(z/c)
        z = torch.where(z == float("-inf"), z, softcap * torch.tanh(z / softcap))
    x = z / temperature                                  # x_v = y_v / τ
    logp_all = torch.log_softmax(x, dim=-1)              # x_v - lse, materialised
    logp = logp_all.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    # H = -Σ p log p; entries with p = 0 (logit -inf) contribute 0. The inner where keeps
    # 0·(-inf) out of both the value and the gradient.
    nonzero = logp_all != float("-inf")  # a NaN row stays NaN (in H too)
    safe = torch.where(nonzero, logp_all, torch.zeros_like(logp_all))
    entropy = -torch.where(nonzero, safe.exp() * safe, torch.zeros_like(safe)).sum(-1)
    return logp, entropy


# ---------------------------------------------------------------------------------------------
# §8 aggregation, shared by policy_loss and value_loss

def _aggregate(row_losses, agg, T, zero, num_items=None, num_seqs=None, norm_length=None):
    """row_losses: list of per-token loss vectors of the non-empty rows (valid tokens only)."""
    n_rows = len(row_losses) if num_seqs is None else float(num_seqs)
    n_tok = sum(r.numel() for r in row_losses) if num_items is None else float(num_items)
    total = zero
    for r in row_losses:
        if agg == "seq_mean_token_mean":
            total = total + r.sum() / r.numel()                 # Σ_t m·loss / L_i
        else:
            total = total + r.sum()                             # Σ_t m·loss
    if agg == "token_mean":
        divisor = n_tok
    elif agg in ("seq_mean_token_mean", "seq_mean_token_sum"):
        divisor = n_rows
    elif agg == "constant":
        divisor = n_rows * (T if norm_length is None else norm_length)
    else:
        raise ValueError(f"unknown agg {agg!r}")
    if divisor == 0:
        return total * 0                                        # loss 0, zero gradient
    return total / divisor


def _masked_metric(values, dtype, reduce="mean"):
    """Masked mean (or max) over the valid tokens of all rows, detached; 0 when there are none."""
    if not values:
        return torch.zeros((), dtype=dtype)
    v = torch.cat([x.detach().reshape(-1).to(dtype) for x in values])
    return v.max() if reduce == "max" else v.mean()


# ---------------------------------------------------------------------------------------------
# §3-§10 the policy loss

def _band(config):
    """Ratio-space clip band (1 - ε_low, 1 + ε_high); None = no bound on that side."""
    eps_low, eps_high = config.clip_low, config.clip_high
    return (None if eps_low is None else 1 - eps_low), (None if eps_high is None else 1 + eps_high)


def _clipped(x, lo, hi, a=None):
    """(low, high) flags as TRL counts them: x < lo with A < 0, x > hi with A > 0 (A optional)."""
    low = x < lo if lo is not None else torch.zeros_like(x, dtype=torch.bool)
    high = x > hi if hi is not None else torch.zeros_like(x, dtype=torch.bool)
    return (low, high) if a is None else (low & (a < 0), high & (a > 0))


def _clip_surrogate(w, a, config):
    """§5 max(-A·w', -A·clip(w, 1-ε_low, 1+ε_high)), w' = min(w, delta); dual clip if A < 0."""
    lo, hi = _band(config)
    delta, c = config.delta, config.dual_clip
    w_unclipped = w if delta is None else torch.clamp(w, max=delta)
    loss = torch.maximum(-a * w_unclipped, -a * _clamp(w, lo, hi))
    if c is not None:
        loss = torch.where(a < 0, torch.minimum(loss, -c * a), loss)
    return (loss,) + _clipped(w, lo, hi, a)


def _soft_gate(w, a, config):
    """§5 SAPO: -A · σ(τ(w - 1)) · 4/τ, τ = τ_pos where A > 0, else τ_neg."""
    tau = torch.where(a > 0, torch.tensor(float(config.sapo_tau_pos), dtype=w.dtype),
                      torch.tensor(float(config.sapo_tau_neg), dtype=w.dtype))
    return -a * torch.sigmoid(tau * (w - 1)) * 4 / tau


def _dppo_inside(l, lo, a, config, divergence):
    """§5 DPPO: True where the token is inside the divergence trust region (per token, detached)."""
    eps_low, eps_high = config.clip_low, config.clip_high
    p, q = torch.exp(l.detach()), torch.exp(lo)
    out = []
    for t in range(l.numel()):
        if divergence == "tv":
            up_ok, down_ok = p[t] - q[t] <= eps_high, p[t] - q[t] >= -eps_low
        else:   # KL(Bernoulli(q) || Bernoulli(p)), with TRL/verl's 1e-8 guards
            kl = q[t] * (lo[t] - l[t].detach()) + (1 - q[t]) * torch.log((1 - q[t] + 1e-8) / (1 - p[t] + 1e-8))
            up_ok, down_ok = (kl <= eps_high) | (p[t] <= q[t]), (kl <= eps_low) | (p[t] >= q[t])
        out.append(bool(up_ok) if a[t] > 0 else bool(down_ok))
    return torch.tensor(out, dtype=torch.bool)


def _kl(delta, estimator, C):
    """§6 with Δ = ℓ_ref - ℓ (unclamped): k1, k2, k3 of clamp(Δ); verl's kl, mse, abs of Δ itself and its
    low_var_kl, k3 clamped to ±10; "+": that value with the gradient of Δ²/2 (straight-through)."""
    d = torch.clamp(delta, -C, C)
    value = {"k1": lambda: -d, "k2": lambda: d ** 2 / 2, "k3": lambda: torch.exp(d) - d - 1,
             "kl": lambda: -delta, "mse": lambda: delta ** 2 / 2, "abs": lambda: torch.abs(delta),
             "low_var_kl": lambda: torch.clamp(torch.exp(d) - d - 1, -10, 10)}[estimator.rstrip("+")]()
    if estimator.endswith("+"):
        return delta ** 2 / 2 - (delta ** 2 / 2).detach() + value.detach()
    return value


def _rollout_statistic(r, estimator):
    """§7 rejection sampling: k1, k2 or k3 of r = clamp(ℓ_old - ℓ_rollout) (the KL between the two policies)."""
    return {"k1": lambda: -r, "k2": lambda: r ** 2 / 2, "k3": lambda: torch.exp(r) - 1 - r}[estimator]()


def _rollout_correction(config, old, rollout, valid, is_weights, C):
    """§7 rollout correction from the config: (the mask less the tokens the rejection tests drop, the importance
    weights (B, T) times the rollout IS weights). Every test and the weights read the given mask."""
    B, T = valid.shape
    kept = valid.clone()
    for name, lower, upper in config.rollout_rs:
        level, _, estimator = name.rpartition("_")
        for i in range(B):
            if not bool(valid[i].any()):
                continue
            stat = _rollout_statistic(torch.clamp(old[i][valid[i]] - rollout[i][valid[i]], -C, C), estimator)
            if level != "token":      # one statistic for the row: its tokens are kept or dropped together
                stat = {"seq_sum": stat.sum, "seq_mean": stat.mean, "seq_max": stat.max}[level]().expand(stat.numel())
            ok = ~torch.isnan(stat)
            if lower is not None:
                ok = ok & (stat >= lower)
            if upper is not None:
                ok = ok & (stat <= upper)
            kept[i, valid[i]] = kept[i, valid[i]] & ok   # each test on the given mask, all of them kept
    level = config.rollout_is
    if level is None:
        return kept, is_weights
    lower, upper = config.rollout_is_lower, config.rollout_is_upper
    w = torch.zeros(B, T, dtype=old.dtype)
    for i in range(B):
        if not bool(valid[i].any()):
            continue
        r = torch.nan_to_num(old[i][valid[i]] - rollout[i][valid[i]], nan=0.0)   # NaN: a token the sampler lacks
        r = r.sum().expand(r.numel()) if level == "sequence" else r
        wi = torch.exp(torch.clamp(r, -C, C))
        if config.rollout_is_mode == "truncate":
            wi = _clamp(wi, lower, upper)
        else:                                       # IcePop: 0 outside [lower, upper]
            outside = torch.zeros_like(wi, dtype=torch.bool)
            if lower is not None:
                outside = outside | (wi < lower)
            if upper is not None:
                outside = outside | (wi > upper)
            wi = torch.where(outside, torch.zeros_like(wi), wi)
        w[i, valid[i]] = wi
    rows = [i for i in range(B) if bool(valid[i].any())]
    if config.rollout_is_batch_normalize and rows:   # divided by the mean over the tokens, or the rows
        mean = w[valid].mean() if level == "token" else _mean([w[i][valid[i]][0] for i in rows])
        if mean > 1e-8:
            w = w / mean
    if is_weights is not None:
        given = is_weights.detach().to(old.dtype)
        w = w * (given.reshape(B, 1) if given.numel() == B else given)
    return kept, w


class _Row:
    """The valid tokens of one row i (vectors of length L_i) and what the objectives read of its row and group: each
    objective's truth below is a function of it."""

    def __init__(self, **fields):
        self.__dict__.update(fields)

    @property
    def log_s(self):                    # §4 GSPO: log s_i = mean_t (ℓ - ℓ_old), clamped
        return torch.clamp((self.l - self.lo).mean(), -self.C, self.C)


# §5 each objective at the token ratio w_t: (surrogate per token, clipped below, clipped above)
def _token_clip(r, config):
    return _clip_surrogate(r.w_tok, r.a, config)


def _token_cispo(r, config):            # §5 -sg(clip(w)) A ℓ
    return (-_clamp(r.w_tok, *_band(config)).detach() * r.a * r.l, *_clipped(r.w_tok, *_band(config)))


def _token_spo(r, config):              # §5 -(A w - |A|/(2ε) (w - 1)²)
    return -(r.a * r.w_tok - r.a.abs() / (2 * config.spo_eps) * (r.w_tok - 1) ** 2), r.none, r.none


def _token_reinforce(r, config):        # §5 -A ℓ
    return -r.a * r.l, r.none, r.none


def _token_sapo(r, config):             # §5 soft gate
    return _soft_gate(r.w_tok, r.a, config), r.none, r.none


def _token_dppo(r, config):             # §5 -A sg(min(w, cap)) ℓ inside the trust region
    inside = _dppo_inside(r.l, r.lo, r.a, config, config.objective[5:])
    cap = config.ratio_cap
    weight = (r.w_tok if cap is None else torch.clamp(r.w_tok, max=cap)).detach()
    return -r.a * weight * r.l * inside.to(r.dt), ~inside & (r.a < 0), ~inside & (r.a > 0)


def _token_dro(r, config):              # §5 -(A ℓ - β/2 (ℓ - ℓ_old)²)
    return -(r.a * r.l - 0.5 * config.dro_beta * (r.l - r.lo) ** 2), r.none, r.none


def _token_topr(r, config):             # §5 -A ℓ for A ≥ 0, -sg(clip(w, 0, 1)) A ℓ for A < 0
    weight = torch.where(r.a < 0, torch.clamp(r.w_tok, 0, 1), torch.ones_like(r.w_tok)).detach()
    return -weight * r.a * r.l, r.none, (r.w_tok > 1) & (r.a < 0)


def _token_clip_cov(r, config):         # §5 PPO clip, no gradient on the chosen tokens
    surr, low, high = _clip_surrogate(r.w_tok, r.a, config)
    surr = torch.where(r.chosen, torch.zeros((), dtype=r.dt), surr)
    return surr, low | (r.chosen & (r.a < 0)), high | (r.chosen & (r.a > 0))


def _token_kl_cov(r, config):           # §5 -A w, + coef |ℓ - ℓ_old| on the chosen tokens
    penalty = torch.where(r.chosen, config.kl_cov_coef * (r.l - r.lo).abs(), torch.zeros((), dtype=r.dt))
    return -r.a * r.w_tok + penalty, r.none, r.none


def _token_gppo(r, config):             # §5 PPO's clip, but a clipped token keeps -β·bound·A·∇ℓ
    lo_b, hi_b = _band(config)
    low, high = _clipped(r.w_tok, lo_b, hi_b, r.a)
    d = torch.clamp(r.l - r.lo, -r.C, r.C)
    bound = torch.where(low, torch.tensor(config.gppo_beta_low * lo_b, dtype=r.dt), config.gppo_beta_high * hi_b)
    surr = -r.a * torch.where(low | high, bound * torch.exp(d - d.detach()), r.w_tok)
    if config.dual_clip is not None:
        surr = torch.where(r.a < 0, torch.minimum(surr, -config.dual_clip * r.a), surr)
    return surr, low, high


_TOKEN_OBJECTIVES = {"clip": _token_clip, "cispo": _token_cispo, "reinforce": _token_reinforce, "sapo": _token_sapo,
                     "dppo_tv": _token_dppo, "dppo_kl": _token_dppo, "dro": _token_dro, "topr": _token_topr,
                     "clip_cov": _token_clip_cov, "kl_cov": _token_kl_cov, "gppo": _token_gppo,
                     "spo": _token_spo}


# §4-§5 the sequence-level ratios, each with the objectives it takes: (surrogate per token, clipped below, clipped
# above, ratio metric per token)
def _gspo(r, config):                   # GSPO: s_i broadcast to the row
    s = torch.exp(r.log_s)
    if config.objective == "sapo":
        surr, low, high = _soft_gate(s, r.a_row, config).expand(r.L), r.none, r.none
    elif config.objective == "cispo":   # TRL's sequence-level CISPO: -sg(clip(s_i)) A ℓ per token
        surr = -_clamp(s, *_band(config)).detach() * r.a * r.l
        low, high = (x.expand(r.L) for x in _clipped(s, *_band(config)))
    else:
        surr, low, high = (x.expand(r.L) for x in _clip_surrogate(s, r.a_row, config))
    return surr, low, high, s.expand(r.L)


def _gspo_token(r, config):             # GSPO-token: sg(log s_i) + ℓ - sg(ℓ)
    w = torch.exp(r.log_s.detach() + r.l - r.l.detach())
    if config.objective == "sapo":
        surr, low, high = _soft_gate(w, r.a, config), r.none, r.none
    else:
        surr, low, high = _clip_surrogate(w, r.a, config)
    return surr, low, high, torch.exp(r.log_s).expand(r.L)


def _vespo(r, config):                  # VESPO: -sg(φ(w_i)) A ℓ
    log_w = torch.clamp(r.l - r.lo, -r.C, r.C).sum()
    if r.is_weights is not None:        # TRL: the importance weights enter w_i, not the per-token loss
        log_w = log_w + torch.clamp(torch.log(r.is_weights), math.log(1e-8), r.C).sum()
    log_w = torch.clamp(log_w, math.log(1e-8), r.C).detach()
    w = torch.exp(log_w)
    pos = bool(r.a_row >= 0)
    k = getattr(config, "vespo_k_pos" if pos else "vespo_k_neg")
    lam = max(getattr(config, "vespo_lambda_pos" if pos else "vespo_lambda_neg"), 1e-4)
    phi = torch.exp(lam + k * log_w - lam * w)
    phi = phi if bool(torch.isfinite(phi)) else torch.zeros_like(phi)
    return -phi * r.a * r.l, r.none, r.none, w.expand(r.L)


def _topr_trajectory(r, config):        # TOPR at the trajectory ratio π(τ)/μ(τ)
    w = torch.exp(torch.clamp((r.l - r.lo).sum(), -r.C, r.C)).detach()
    surr = -(torch.clamp(w, 0, 1) if bool(r.a_row < 0) else torch.ones_like(w)) * r.a * r.l
    return surr, r.none, ((w > 1) & (r.a_row < 0)).expand(r.L), w.expand(r.L)


def _fspo(r, config):                   # FSPO: S_i = Σ_t (ℓ - ℓ_old), √L band
    S = torch.clamp((r.l - r.lo).sum(), -r.C, r.C)
    band = (-config.fspo_c_low * math.sqrt(r.L), config.fspo_c_high * math.sqrt(r.L))
    row = -torch.minimum(torch.exp(S) * r.a_row, torch.exp(torch.clamp(S, *band)) * r.a_row)
    low, high = (x.expand(r.L) for x in _clipped(S, *band, r.a_row))
    return row.expand(r.L), low, high, torch.exp(S).expand(r.L)


def _sequence_sum(r, config):
    return {"vespo": _vespo, "topr": _topr_trajectory}.get(config.objective, _fspo)(r, config)


def _gepo(r, config):                   # GEPO: log w_i = mean_t ℓ - log Ê_g
    w = torch.exp(torch.clamp(r.l.mean() - r.log_E, -r.C, r.C))
    surr, low, high = (x.expand(r.L) for x in _clip_surrogate(w, r.a_row, config))
    return surr, low, high, w.expand(r.L)


def _gmpo(r, config):                   # GMPO: sign-aware log-space clip per token
    d = torch.clamp(r.l - r.lo, -r.C, r.C)
    band = (None if config.clip_low is None else -config.clip_low, config.clip_high)
    sgn = torch.sign(r.a_row)
    d_tilde = sgn * torch.minimum(sgn * d, sgn * _clamp(d, *band))
    surr = (-r.a_row * torch.exp(d_tilde.mean())).expand(r.L)   # row loss -A_i s̃_i
    low, high = _clipped(d, *band, r.a_row)
    return surr, low, high, torch.exp(d.mean()).expand(r.L)


def _snis(r, config):                   # -sg(ŵ_i)(R_i - sg(b_g)) · Σ_t ℓ
    surr = (-r.w_hat * (r.reward - r.baseline) * r.l.sum()).expand(r.L)
    return surr, r.none, r.none, torch.exp(torch.clamp((r.l - r.lo).sum(), -r.C, r.C)).expand(r.L)


_SEQUENCE_RATIOS = {"sequence": _gspo, "sequence_token": _gspo_token, "sequence_sum": _sequence_sum,
                    "group_expectation": _gepo, "geometric": _gmpo, "snis": _snis}


def _surrogate(r, config):
    """(surrogate, clipped below, clipped above, ratio metric) of row `r`, per valid token."""
    if config.ratio == "token":
        if config.objective not in _TOKEN_OBJECTIVES:
            raise ValueError(f"unknown objective {config.objective!r}")
        return (*_TOKEN_OBJECTIVES[config.objective](r, config), r.w_tok)
    if config.ratio not in _SEQUENCE_RATIOS:
        raise ValueError(f"unknown ratio {config.ratio!r}")
    return _SEQUENCE_RATIOS[config.ratio](r, config)


def _group_quantities(logp, old, rows, valid, rewards, config, group_ids, dt):
    """§4 group-level quantities over the non-empty rows of each group: GEPO's log Ê_g, SNIS's ŵ_j and b_g."""
    B = logp.shape[0]
    log_E, w_hat, baseline = {}, {}, {}
    for g in _groups(B, group_ids, config.group_size):
        g = [j for j in g if j in rows]
        if not g:
            continue
        if config.ratio == "group_expectation":
            # log Ê_g = logsumexp_j(2 log q_j) - logsumexp_j(log q_j), log q_j = mean_t ℓ_old
            log_q = torch.stack([old[j][valid[j]].mean() for j in g])
            for j in g:
                log_E[j] = torch.logsumexp(2 * log_q, 0) - torch.logsumexp(log_q, 0)
        else:
            # ρ_j = π/π_old of the whole sequence, unclamped; ŵ_j = ρ_j / mean_g ρ
            # = n·e^{log ρ_j − lse_g log ρ}; b_g = mean_g ŵ_j R_j  (constants)
            log_rho = torch.stack([(logp[j][valid[j]] - old[j][valid[j]]).sum() for j in g]).detach()
            for j, w in zip(g, len(g) * torch.softmax(log_rho, 0)):
                w_hat[j] = w
            for j in g:
                baseline[j] = _mean([w_hat[k] * rewards[k].to(dt) for k in g])
    return log_E, w_hat, baseline


def _covariance_choice(logp, old, advantages, valid, config, C):
    """§5 Clip-Cov / KL-Cov: the batch-level choice of tokens (i, t) by the covariance of A and ℓ."""
    B, T = logp.shape
    cells = [(i, t) for i in range(B) for t in range(T) if bool(valid[i, t])]   # row-major
    if not cells:
        return set()
    A = [float(advantages[i, t]) for i, t in cells]
    lp = [float(logp[i, t].detach()) for i, t in cells]
    mean_A, mean_l = sum(A) / len(A), sum(lp) / len(lp)
    cov = [(x - mean_A) * (y - mean_l) for x, y in zip(A, lp)]
    if config.objective == "kl_cov":
        k = max(1, int(len(cells) * config.kl_cov_ratio))
        top = sorted(range(len(cells)), key=lambda j: -cov[j])[:k]   # stable: ties by position
        return {cells[j] for j in top}
    lo_, hi_ = _band(config)
    cand = []
    for c, (i, t), x in zip(cov, cells, A):
        w = torch.exp(torch.clamp(logp[i, t].detach() - old[i, t], -C, C))
        clipped = bool(-x * torch.clamp(w, lo_, hi_) > -x * w)
        if not clipped and config.clip_cov_lb < c < config.clip_cov_ub:
            cand.append((i, t))
    k = max(int(config.clip_cov_ratio * len(cells)), 1)
    if config.clip_cov_draw == "device":   # the k candidates of smallest uniform keys
        keys = torch.rand(B, T, device=logp.device)
        return set(sorted(cand, key=lambda it: (float(keys[it]), it[0] * T + it[1]))[:k])
    if cand:   # verl's draw: torch.randperm(n) on the default generator
        return {cand[j] for j in torch.randperm(len(cand))[:min(k, len(cand))].tolist()}
    return set()


def policy_loss(logp, advantages, mask, config, *, old_logp=None, ref_logp=None, entropy=None,
                group_ids=None, rewards=None, num_items=None, num_seqs=None, is_weights=None, rollout_logp=None):
    """(loss, metrics) of docs/math.md §3-§10 for logp (B, T); `config` is read by attribute name.
    Each non-empty row i is handled on its valid tokens only; sequence-level surrogates are
    broadcast to the row's tokens, then KL/entropy are added per token and §8 aggregates."""
    dt = _dtype(logp)
    logp = logp.to(dt)
    B, T = logp.shape
    valid = mask != 0
    old = logp.detach() if old_logp is None else old_logp.detach().to(dt)   # on-policy: sg(ℓ)
    C = float(config.log_ratio_clamp)                 # every exponentiated log-ratio
    if config.rollout_is is not None or config.rollout_rs:
        if old_logp is None or rollout_logp is None:
            raise ValueError("rollout_logp: config.rollout_is / rollout_rs need old_logp and rollout_logp")
        valid, is_weights = _rollout_correction(config, old, rollout_logp.detach().to(dt), valid, is_weights, C)
    ratio, objective = config.ratio, config.objective
    rows = [i for i in range(B) if bool(valid[i].any())]      # empty rows take part in nothing
    if advantages is not None:
        advantages = advantages.detach().to(dt)
        if advantages.dim() == 1:
            advantages = advantages[:, None].expand(B, T)

    def tok(x, i):                      # the valid tokens of row i, as a vector of length L_i
        return x[i][valid[i]]

    log_E, w_hat, baseline = {}, {}, {}
    if ratio in ("group_expectation", "snis"):
        log_E, w_hat, baseline = _group_quantities(logp, old, rows, valid, rewards, config, group_ids, dt)
    chosen = set()
    if ratio == "token" and objective in ("clip_cov", "kl_cov"):
        chosen = _covariance_choice(logp, old, advantages, valid, config, C)

    rho = config.top_entropy_quantile   # §7 entropy mask: threshold over all valid tokens
    h_thr = None
    if rho is not None and rho < 1 and bool(valid.any()):
        h_thr = torch.quantile(entropy.detach().to(dt)[valid], 1 - rho)
    row_losses = []
    m_ratio, m_low, m_high, m_kl, m_akl, m_ent, m_bonus = [], [], [], [], [], [], []
    for i in rows:
        l, lo = tok(logp, i), tok(old, i)
        L = l.numel()
        a = tok(advantages, i) if advantages is not None else torch.zeros_like(l)
        a_row = a[0]                                      # one advantage per row (seq ratios)
        w_tok = torch.exp(torch.clamp(l - lo, -C, C))      # §4 token ratio
        w_is = None
        if is_weights is not None and objective == "vespo":
            w_is = is_weights.detach().to(dt)
            w_is = tok(w_is.reshape(B, 1).expand(B, T) if w_is.numel() == B else w_is, i)
        cols = torch.nonzero(valid[i]).reshape(-1).tolist()
        r = _Row(l=l, lo=lo, a=a, a_row=a_row, w_tok=w_tok, L=L, C=C, dt=dt, none=torch.zeros(L, dtype=torch.bool),
                 chosen=torch.tensor([(i, t) in chosen for t in cols], dtype=torch.bool), is_weights=w_is,
                 log_E=log_E.get(i), w_hat=w_hat.get(i), baseline=baseline.get(i),
                 reward=None if rewards is None else rewards[i].to(dt))
        surr, low, high, r_metric = _surrogate(r, config)

        loss_tok = surr
        omega = torch.ones(L, dtype=dt)      # §7 ω: importance weights times the off-policy mask
        if is_weights is not None and objective != "vespo":
            w_is = is_weights.detach().to(dt)
            omega = omega * tok(w_is.reshape(B, 1).expand(B, T) if w_is.numel() == B else w_is, i)
        if h_thr is not None:                # keep the tokens with the top ρ entropies of the call
            omega = omega * (tok(entropy.detach().to(dt), i) >= h_thr).to(dt)
        thr = config.off_policy_mask
        if thr is not None:                  # keep unless A < 0 and mean(ℓ_rollout - ℓ) > thr
            src = lo if rollout_logp is None else tok(rollout_logp.detach().to(dt), i)
            gap = float(torch.nan_to_num(src - l.detach(), nan=0.0).mean())
            omega = omega * ((a >= 0) | (gap <= thr)).to(dt)
        if (is_weights is not None and objective != "vespo") or thr is not None or h_thr is not None:
            loss_tok = surr * omega
            low, high = low & (omega > 0), high & (omega > 0)   # §10: a zero-weight token is not clipped
        # §6 KL to the reference: Δ = ℓ_ref - ℓ, the estimator, value clamp, optional w_tok factor;
        # the metric reports the k added to the loss, or plain k3 when no KL is in the loss
        if ref_logp is not None:
            coef, est, kl_clamp = config.kl_coef, config.kl_estimator, config.kl_clamp
            d_ref = tok(ref_logp.detach().to(dt), i) - l
            if coef != 0 and est is not None:
                k = _kl(d_ref, est, C)
                if kl_clamp is not None:
                    k = torch.clamp(k, -kl_clamp, kl_clamp)
                if config.kl_bias_correction:   # with the ratio's gradient: the token's, or the row's
                    k = k * (w_tok if config.kl_bias_ratio == "token" else torch.exp(r.log_s))
                loss_tok = loss_tok + coef * k
            else:
                k = _kl(d_ref, "k3", C)
            m_kl.append(k)
        # §7 entropy bonus (gradient flows into H)
        if entropy is not None:
            H = tok(entropy.to(dt), i)
            if config.entropy_coef != 0 and config.entropy_agg is None:
                loss_tok = loss_tok - config.entropy_coef * H
            m_ent.append(H)
            m_bonus.append(H if h_thr is None else H[tok(entropy.detach().to(dt), i) >= h_thr])  # §7: its tokens
        row_losses.append(loss_tok)

        # §10 metrics, per valid token
        m_ratio.append(r_metric)
        m_low.append(low)
        m_high.append(high)
        d_old = torch.clamp(lo - l, -C, C)
        m_akl.append(torch.exp(d_old) - d_old - 1)

    zero = logp[valid].clamp(-1.0, 1.0).sum() * 0   # keeps the graph when there are no rows (finite at ℓ = −inf)
    loss = _aggregate(row_losses, config.agg, T, zero, num_items, num_seqs,
                      config.norm_length)
    if entropy is not None and config.entropy_coef != 0 and config.entropy_agg == "token_mean":
        every_h = torch.cat([h.reshape(-1) for h in m_bonus] + [zero.reshape(1)])   # §7: its own token mean
        loss = loss - config.entropy_coef * every_h.sum() / max(every_h.numel() - 1, 1)
    low_frac, high_frac = _masked_metric(m_low, dt), _masked_metric(m_high, dt)
    metrics = dict(
        kl=_masked_metric(m_kl, dt), clip_frac=low_frac + high_frac, clip_frac_low=low_frac,
        clip_frac_high=high_frac, ratio_mean=_masked_metric(m_ratio, dt),
        ratio_max=_masked_metric(m_ratio, dt, "max"), approx_kl=_masked_metric(m_akl, dt),
    )
    if entropy is not None:
        metrics["entropy"] = _masked_metric(m_ent, dt)
    return loss, metrics


# ---------------------------------------------------------------------------------------------
# §12 value loss

def value_loss(values, old_values, returns, mask, clip=0.2, agg="token_mean", *,
               num_items=None, num_seqs=None, norm_length=None):
    """½ · agg(max((V - R̂)², (clip(V, V_old ± ε) - R̂)²)); metric vf_clip_frac."""
    dt = _dtype(values)
    values, old_values, returns = values.to(dt), old_values.to(dt), returns.to(dt)
    B, T = values.shape
    valid = mask != 0
    row_losses, clipped = [], []
    for i in range(B):
        if not bool(valid[i].any()):
            continue
        v, v_old, R = values[i][valid[i]], old_values[i][valid[i]], returns[i][valid[i]]
        sq = (v - R) ** 2
        if clip is None:
            row_losses.append(0.5 * sq)
            continue
        sq_clipped = (torch.maximum(torch.minimum(v, v_old + clip), v_old - clip) - R) ** 2
        row_losses.append(0.5 * torch.maximum(sq, sq_clipped))
        clipped.append(sq_clipped > sq)
    loss = _aggregate(row_losses, agg, T, values[valid].sum() * 0, num_items, num_seqs, norm_length)
    return loss, {"vf_clip_frac": _masked_metric(clipped, dt)}


# ---------------------------------------------------------------------------------------------
# §13-§14 advantages and sampling

def gae(rewards, values, mask, gamma=1.0, lam=1.0, whiten=True):
    """verl's compute_gae_advantage_return: masked positions carry the next value and the running
    advantage unchanged; returns = advantages + values before whitening."""
    dt = torch.promote_types(_dtype(rewards), _dtype(values))
    rewards, values, m = rewards.to(dt), values.to(dt), (mask != 0).to(dt)
    B, T = rewards.shape
    next_value = torch.zeros(B, dtype=dt)
    last_gae = torch.zeros(B, dtype=dt)
    adv = [None] * T
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        gae_t = delta + gamma * lam * last_gae
        next_value = values[:, t] * m[:, t] + (1 - m[:, t]) * next_value
        last_gae = gae_t * m[:, t] + (1 - m[:, t]) * last_gae
        adv[t] = last_gae
    advantages = torch.stack(adv, dim=1)
    returns = advantages + values
    if whiten:   # (A - mean)/sqrt(var + 1e-8) over valid tokens, Bessel var (0 below 2 tokens)
        xs = advantages[mask != 0]
        n = xs.numel()
        mean = xs.sum() / n if n > 0 else torch.zeros((), dtype=dt)
        var = ((xs - mean) ** 2).sum() / (n - 1) if n >= 2 else torch.zeros((), dtype=dt)
        advantages = (advantages - mean) / torch.sqrt(var + 1e-8)
    return advantages, returns


def _normalize_within(R, groups, eps, scale="group"):
    """(R - μ_g)/(σ_g + ε) per group ("batch": σ of the whole batch; None: no division)."""
    out = torch.zeros_like(R)
    sigma_batch = _bessel_std(R)
    for g in groups:
        mu, sigma = R[g].mean(), _bessel_std(R[g])
        divisor = {"group": sigma + eps, "batch": sigma_batch + eps, None: 1.0}[scale]
        for i in g:
            out[i] = (R[i] - mu) / divisor
    return out


def group_normalized(rewards, group_ids=None, *, group_size=None, scale="group", eps=1e-6):
    """GRPO: (R - μ_g)/(σ_g + ε); "batch": σ of the whole batch; None: R - μ_g (Dr. GRPO)."""
    R = rewards.to(_dtype(rewards))
    return _normalize_within(R, _groups(R.shape[0], group_ids, group_size), eps, scale)


def rloo(rewards, group_ids=None, *, group_size=None):
    """R_i - mean_{j≠i in g} R_j; a group of one gets 0 (no leave-one-out baseline exists)."""
    R = rewards.to(_dtype(rewards))
    out = torch.zeros_like(R)
    for g in _groups(R.shape[0], group_ids, group_size):
        for i in g:
            others = [R[j] for j in g if j != i]
            out[i] = R[i] - _mean(others) if others else 0.0
    return out


def tree_grpo(rewards, group_ids, tree_ids, eps=1e-6):
    """(R - μ_prompt)/(σ_prompt + ε) + (R - μ_tree)/(σ_tree + ε); a tree = rows sharing both
    the prompt group id and the tree id."""
    R = rewards.to(_dtype(rewards))
    prompts = _groups(R.shape[0], group_ids)
    trees = {}
    for i, key in enumerate(zip(group_ids.tolist(), tree_ids.tolist())):
        trees.setdefault(key, []).append(i)
    return _normalize_within(R, prompts, eps) + _normalize_within(R, list(trees.values()), eps)


def pods_select(rewards, m, group_ids=None, *, group_size=None):
    """Per group, keep the m rollouts of maximum population reward variance: try every k in 0..m
    (k highest + m-k lowest, stable ascending sort), first best k wins. Groups of <= m keep all."""
    keep = []
    for g in _groups(rewards.shape[0], group_ids, group_size):
        if len(g) <= m:
            keep += g
            continue
        order = sorted(g, key=lambda j: float(rewards[j]))     # stable: ties by row index
        best, best_var = None, None
        for k in range(m + 1):
            chosen = order[:m - k] + (order[len(order) - k:] if k else [])
            var = rewards[chosen].double().var(unbiased=False)
            if best_var is None or var > best_var:
                best, best_var = chosen, var
        keep += best
    return torch.tensor(sorted(keep), dtype=torch.long)


def overlong_penalty(lengths, max_len, buffer, penalty_factor=1.0):
    """DAPO soft overlong punishment: 0 up to max_len - buffer, linear to -1 at max_len, then -1,
    times penalty_factor."""
    out = []
    for n in lengths.reshape(-1).tolist():
        if n <= max_len - buffer:
            p = 0.0
        elif n <= max_len:
            p = (max_len - buffer - n) / buffer
        else:
            p = -1.0
        out.append(p * penalty_factor)
    dt = lengths.dtype if lengths.is_floating_point() else torch.float32
    return torch.tensor(out, dtype=dt).reshape(lengths.shape)


def filter_uniform_groups(rewards, group_ids=None, *, group_size=None):
    """DAPO dynamic sampling: keep mask, False for every row of a group whose rewards are all equal
    (a group of one is uniform)."""
    keep = torch.zeros(rewards.shape[0], dtype=torch.bool)
    for g in _groups(rewards.shape[0], group_ids, group_size):
        uniform = all(float(rewards[j]) == float(rewards[g[0]]) for j in g)
        for i in g:
            keep[i] = not uniform
    return keep
