"""`rlkernels.integrations.verl`: the registered losses equal verl's own policy losses (value and
gradient w.r.t. log_prob) where the two overlap, under every `loss_agg_mode`, with verl's global
batch counts and with rollout correction weights. Skipped only when verl cannot be imported."""
from __future__ import annotations

import os

import pytest
import torch

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
from verl.workers.config import ActorConfig  # noqa: E402
from verl.workers.config.actor import PolicyLossConfig as VerlPolicyLossConfig  # noqa: E402

import plugin_objectives  # noqa: E402
import rlkernels  # noqa: E402
from doc_blocks import block  # noqa: E402
from rlkernels import presets  # noqa: E402
from rlkernels.integrations import verl as rk_verl  # noqa: E402

AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
# dp_size 2 with global counts (what verl's ppo_loss fills in), or none (the micro-batch's own counts).
BATCH_INFO = [{}, {"dp_size": 2, "batch_num_tokens": 50, "global_batch_size": 11, "loss_scale_factor": 16}]


def _actor_config(**fields):
    cfg = ActorConfig(strategy="fsdp", rollout_n=3, ppo_micro_batch_size_per_gpu=2, **fields)
    return cfg


def _inputs(B=6, T=13, *, spread=0.3, empty_row=True, seed=0):
    """fp64 log-probs (leaf), old log-probs off by up to `spread`, per-row advantages as verl's GRPO gives them
    ((B, T), constant within a row), a right-padded mask with ragged lengths (one empty row if asked)."""
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    # per-row scale, so some rows sit inside a narrow clip band and others outside it
    scale = spread * torch.rand(B, 1, generator=g, dtype=torch.float64) * torch.linspace(0.05, 2, B, dtype=torch.float64)[:, None]
    old = logp.detach() + scale * torch.randn(B, T, generator=g, dtype=torch.float64)
    sign = 1 - 2 * (torch.arange(B, dtype=torch.float64)[:, None] % 2)  # alternate, so both signs meet large ratios
    adv = (torch.randn(B, 1, generator=g, dtype=torch.float64).abs() * sign).expand(B, T).contiguous()
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    if empty_row:
        lengths[2] = 0
    mask = torch.arange(T)[None] < lengths[:, None]
    weights = torch.rand(B, T, generator=g, dtype=torch.float64) + 0.5
    return logp, old, adv, mask, weights


def _loss_and_grad(fn, logp, old, adv, mask, mode, cfg, weights):
    loss, metrics = fn(old_log_prob=old, log_prob=logp, advantages=adv, response_mask=mask, loss_agg_mode=mode,
                       config=cfg, rollout_is_weights=weights)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad, metrics


def _compare(verl_name, ours, mode, cfg, *, weights=False, metrics=(), **input_kw):
    logp, old, adv, mask, w = _inputs(**input_kw)
    w = w if weights else None
    torch.manual_seed(0)  # Clip-Cov draws its tokens from torch's RNG: the same state for both
    ref = _loss_and_grad(core_algos.get_policy_loss_fn(verl_name), logp, old, adv, mask, mode, cfg, w)
    torch.manual_seed(0)
    got = _loss_and_grad(rk_verl.policy_loss_fn(ours), logp, old, adv, mask, mode, cfg, w)
    assert ref[0].abs() > 1e-6, "a vacuous comparison"
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-6, atol=1e-9)
    for key in metrics:
        assert got[2][key] == pytest.approx(ref[2][key], rel=1e-6, abs=1e-9), key
    return ref, got


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("info", BATCH_INFO)
@pytest.mark.parametrize("weights", [False, True])
def test_vanilla_dual_clip_is_ppo(mode, info, weights):
    cfg = _actor_config(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode=mode)
    cfg.global_batch_info.update(info)
    ref, _ = _compare("vanilla", "ppo", mode, cfg, weights=weights, spread=3.0,
                      metrics=("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"))
    assert ref[2]["actor/pg_clipfrac_lower"] > 0, "the dual clip is active somewhere"


@pytest.mark.parametrize("preset", ["dapo", "grpo", "dr_grpo"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_vanilla_without_dual_clip(preset, mode):
    # verl always applies its dual clip; a huge clip_ratio_c turns it off, leaving the plain PPO clip
    cfg = _actor_config(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=1e9, loss_agg_mode=mode)
    _compare("vanilla", preset, mode, cfg, spread=1.5, metrics=("actor/pg_clipfrac", "actor/ppo_kl"))


# verl's gspo is the gspo_token form; our sequence-ratio gspo has the same gradient, and with per-token rollout
# weights (which vary within a row here) it is evaluated in the GSPO-token form, as verl combines them.
@pytest.mark.parametrize("ours,weights", [("gspo_token", False), ("gspo_token", True), ("gspo", False),
                                          ("gspo", True)])
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("info", BATCH_INFO)
def test_gspo(ours, weights, mode, info):
    cfg = _actor_config(clip_ratio_low=3e-4, clip_ratio_high=4e-4, loss_agg_mode=mode)
    cfg.global_batch_info.update(info)
    ref, got = _compare("gspo", ours, mode, cfg, weights=weights, spread=1e-2, metrics=("actor/ppo_kl",))
    assert 0 < ref[2]["actor/pg_clipfrac"] < 1, "both clipped and unclipped rows"


@pytest.mark.parametrize("weights", [False, True])
def test_luspo_is_gspo_summed_over_tokens(weights):
    # LUSPO = GSPO's sequence ratio with each row's loss summed over its tokens: verl's gspo under seq-mean-token-sum
    mode = "seq-mean-token-sum"
    cfg = _actor_config(clip_ratio_low=3e-4, clip_ratio_high=4e-4, loss_agg_mode=mode)
    ref, _ = _compare("gspo", "luspo", mode, cfg, weights=weights, spread=1e-2, metrics=("actor/ppo_kl",))
    assert 0 < ref[2]["actor/pg_clipfrac"] < 1


# verl 0.9.1's own losses that rlkernels presets of the same name reproduce: (verl fields, spread, metrics compared)
NEW_OBJECTIVES = {
    "sapo": (dict(tau_pos=1.3, tau_neg=0.7), ("actor/ppo_kl",)),
    "gpg": ({}, ()),
    "dppo_tv": (dict(clip_ratio_low=0.15, clip_ratio_high=0.1, clip_ratio_c=2.0),
                ("actor/pg_clipfrac", "actor/ppo_kl")),
    "dppo_kl": (dict(clip_ratio_low=0.05, clip_ratio_high=0.03, clip_ratio_c=2.0),
                ("actor/pg_clipfrac", "actor/ppo_kl")),
    "clip_cov": (dict(clip_ratio_low=0.2, clip_ratio_high=0.28,
                      policy_loss=VerlPolicyLossConfig(clip_cov_ratio=0.2, clip_cov_lb=0.0, clip_cov_ub=2.0)),
                 ("actor/ppo_kl",)),  # verl's pg_clipfrac counts the chosen tokens only; ours the PPO clip too
    "kl_cov": (dict(policy_loss=VerlPolicyLossConfig(kl_cov_ratio=0.2, ppo_kl_coef=0.5)), ()),
    "dro": (dict(policy_loss=VerlPolicyLossConfig(dro_beta=0.3)), ("actor/ppo_kl",)),
}


@pytest.mark.parametrize("name", list(NEW_OBJECTIVES))
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("info", BATCH_INFO)
@pytest.mark.parametrize("weights", [False, True])
def test_new_objectives_equal_verl(name, mode, info, weights):
    """rlkernels_<name> = verl's <name> in fp64: loss and gradient, every loss_agg_mode (verl's sapo ignores it
    and always aggregates seq-mean-token-mean: so does rlkernels_sapo), global counts, rollout weights."""
    fields, metrics = NEW_OBJECTIVES[name]
    cfg = _actor_config(loss_agg_mode=mode, **fields)
    cfg.global_batch_info.update(info)
    ref, got = _compare(name, name, mode, cfg, weights=weights, spread=1.5, metrics=metrics)
    if name in ("dppo_tv", "dppo_kl", "clip_cov"):
        assert ref[2]["actor/pg_clipfrac"] > 0, "some tokens are masked or clipped"
    if name == "clip_cov":  # some tokens were chosen by the covariance draw: the loss is not the plain clip's
        vanilla = _actor_config(loss_agg_mode=mode, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=1e9)
        vanilla.global_batch_info.update(info)
        plain, _ = _compare("vanilla", "dapo", mode, vanilla, weights=weights, spread=1.5)
        assert not torch.allclose(plain[1], ref[1])


def test_new_objectives_read_verls_config():
    pl = VerlPolicyLossConfig(clip_cov_ratio=0.01, clip_cov_lb=0.5, clip_cov_ub=3.0, kl_cov_ratio=0.02, ppo_kl_coef=0.7,
                              dro_beta=0.4)
    cfg = _actor_config(clip_ratio_low=0.1, clip_ratio_high=0.12, clip_ratio_c=7.0, tau_pos=1.5, tau_neg=2.5,
                        policy_loss=pl)
    assert rk_verl.loss_config("sapo", cfg) == presets.sapo(sapo_tau_pos=1.5, sapo_tau_neg=2.5)
    assert rk_verl.loss_config("dppo_tv", cfg) == presets.dppo_tv(clip_low=0.1, clip_high=0.12, ratio_cap=7.0)
    assert rk_verl.loss_config("clip_cov", cfg) == presets.clip_cov(clip_low=0.1, clip_high=0.12, clip_cov_ratio=0.01,
                                                                    clip_cov_lb=0.5, clip_cov_ub=3.0,
                                                                    clip_cov_draw="verl")
    assert rk_verl.loss_config("kl_cov", cfg) == presets.kl_cov(kl_cov_ratio=0.02, kl_cov_coef=0.7)
    assert rk_verl.loss_config("dro", cfg) == presets.dro(dro_beta=0.4)
    with pytest.raises(ValueError, match="dro_beta"):  # verl's dro has no default β either
        rk_verl.loss_config("dro", _actor_config())
    # dr_grpo under seq-mean-token-sum-norm: the constant is verl's loss_scale_factor (or its padded length)
    logp, old, adv, mask, _ = _inputs()
    fields, _ = rk_verl.aggregation("seq-mean-token-sum-norm", mask, _actor_config())
    assert rk_verl.loss_config("dr_grpo", _actor_config(), **fields).norm_length == mask.shape[-1]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("weights", [False, True])
def test_cispo(mode, weights):
    cfg = _actor_config(clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode=mode)
    _compare("cispo", "cispo", mode, cfg, weights=weights, spread=1.5, metrics=("actor/ppo_kl",))


@pytest.mark.parametrize("weights", [False, True])
def test_geo_mean_is_gmpo(weights):
    # verl's geo_mean averages over all rows (it ignores loss_agg_mode): equal without empty rows.
    # Its pg_clipfrac counts any clipped δ with A > 0 (ours: the clip removes the gradient), so not compared.
    mode = "seq-mean-token-mean"
    cfg = _actor_config(clip_ratio_low=0.4, clip_ratio_high=0.4, loss_agg_mode=mode)
    _compare("geo_mean", "gmpo", mode, cfg, weights=weights, spread=1.0, empty_row=False, metrics=("actor/ppo_kl",))


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("weights", [False, True])
def test_verl_mode_names(mode, weights):
    """rlkernels_<verl mode> under verl's own names: vanilla, and geo_mean with verl's mean over every row
    of the micro-batch (an empty one included), whatever loss_agg_mode and the global counts."""
    for verl_name, info in (("vanilla", {}), ("geo_mean", {"dp_size": 2, "global_batch_size": 13})):
        cfg = _actor_config(clip_ratio_low=0.3, clip_ratio_high=0.3, clip_ratio_c=3.0, loss_agg_mode=mode)
        cfg.global_batch_info.update(info)
        logp, old, adv, mask, w = _inputs(spread=1.0)
        w = w if weights else None
        ref = _loss_and_grad(core_algos.get_policy_loss_fn(verl_name), logp, old, adv, mask, mode, cfg, w)
        got = _loss_and_grad(rk_verl.verl_mode_fn(verl_name), logp, old, adv, mask, mode, cfg, w)
        assert ref[0].abs() > 1e-6
        torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-9, msg=verl_name)
        torch.testing.assert_close(got[1], ref[1], rtol=1e-6, atol=1e-9, msg=verl_name)


@pytest.mark.parametrize("verl_name,ours", [("vanilla", "ppo"), ("gspo", "gspo"), ("geo_mean", "geo_mean"),
                                            ("cispo", "cispo"), ("clip_cov", "clip_cov")])
def test_zero_rollout_weights(verl_name, ours):
    """IcePop's masked weights (0 on some tokens, a whole row here) weight the loss as verl's do: loss and gradient."""
    cfg = _actor_config(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode="token-mean",
                        policy_loss=VerlPolicyLossConfig(clip_cov_ratio=0.2, clip_cov_lb=0.0, clip_cov_ub=2.0))
    logp, old, adv, mask, w = _inputs(spread=1.0, empty_row=False)
    w[0, :3], w[3] = 0.0, 0.0
    fn = rk_verl.verl_mode_fn(ours) if ours in rk_verl.VERL_MODES else rk_verl.policy_loss_fn(ours)
    torch.manual_seed(0)
    ref = _loss_and_grad(core_algos.get_policy_loss_fn(verl_name), logp, old, adv, mask, "token-mean", cfg, w)
    torch.manual_seed(0)
    got = _loss_and_grad(fn, logp, old, adv, mask, "token-mean", cfg, w)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-6, atol=1e-9)


def test_vespo_takes_rollout_weights_into_its_ratio():
    """VESPO's rollout weights ω = π_old/π_rollout enter its sequence ratio, as in the VESPO authors' verl loss
    (w_i = π/π_rollout): the same loss and gradient as ℓ_old lowered by log ω, unweighted."""
    logp, old, adv, mask, w = _inputs(spread=0.2)
    cfg = _actor_config(loss_agg_mode="token-mean")
    fn = rk_verl.policy_loss_fn("vespo")
    weighted = _loss_and_grad(fn, logp, old, adv, mask, "token-mean", cfg, w)
    shifted = _loss_and_grad(fn, logp, old - w.log(), adv, mask, "token-mean", cfg, None)
    torch.testing.assert_close(weighted[0], shifted[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(weighted[1], shifted[1], rtol=1e-12, atol=1e-12)
    plain = _loss_and_grad(fn, logp, old, adv, mask, "token-mean", cfg, None)
    assert not torch.allclose(weighted[1], plain[1] * w)  # not the per-token product of verl's other losses


def test_config_mapping():
    cfg = _actor_config(clip_ratio=0.3, clip_ratio_low=None, clip_ratio_high=0.35, clip_ratio_c=4.0)
    assert rk_verl.loss_config("ppo", cfg) == presets.ppo(clip_low=0.3, clip_high=0.35, dual_clip=4.0)
    # GRPO's KL is verl's use_kl_loss, outside the policy loss; the group size is rollout_n
    assert rk_verl.loss_config("grpo", cfg) == presets.grpo(clip_low=0.3, clip_high=0.35, kl_estimator=None, kl_coef=0.0)
    assert rk_verl.loss_config("gepo", cfg).group_size == 3
    assert rk_verl.loss_config("fspo", cfg) == presets.fspo()  # its √L band is not verl's clip ratio
    assert rk_verl.loss_config("dapo", cfg, clip_high=0.5).clip_high == 0.5  # overrides come last


def test_grouped_presets_run():
    logp, old, adv, mask, _ = _inputs(empty_row=False)
    cfg = _actor_config(loss_agg_mode="seq-mean-token-mean")  # rollout_n=3: two groups of three rows
    for name in ("gepo", "snis", "fspo"):
        loss, metrics = rk_verl.policy_loss_fn(name)(old, logp, adv, mask, "seq-mean-token-mean", cfg)
        (grad,) = torch.autograd.grad(loss, logp)
        assert torch.isfinite(loss) and torch.isfinite(grad).all() and grad.abs().sum() > 0
        assert set(metrics) >= {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}


def test_bad_agg_mode():
    logp, old, adv, mask, _ = _inputs()
    with pytest.raises(ValueError, match="loss_agg_mode"):
        rk_verl.policy_loss_fn("ppo")(old, logp, adv, mask, "token-median", _actor_config())


def test_errors_name_verls_settings():
    """A sequence-level loss given per-token advantages (GAE's): the error names verl's loss_mode, not rlkernels'
    ratio field."""
    logp, old, _, mask, _ = _inputs()
    per_token = torch.randn(logp.shape, dtype=torch.float64)
    with pytest.raises(ValueError) as err:
        rk_verl.policy_loss_fn("gspo")(old, logp, per_token, mask, "token-mean", _actor_config())
    message = str(err.value)
    assert "loss_mode=rlkernels_gspo needs one advantage per response" in message, message
    assert "use loss_mode=rlkernels_gspo_token for per-token advantages" in message and "ratio=" not in message


def test_readme_register(restore_verl):
    exec(block("verl", "docs/integrations.md"), {})
    for name in [*presets.NAMES, *rk_verl.VERL_MODES, "bypass_mode"]:  # the presets, and verl's own names
        assert core_algos.get_policy_loss_fn(f"rlkernels_{name}").__name__ == f"rlkernels_{name}"


def test_readme_hydra_override_registers_the_losses_in_ray_workers(restore_verl):
    """The README's override of `python -m verl.trainer.main_ppo`, applied with Hydra's rules to verl's composed
    config: the hook lands in the runtime_env that main_ppo merges and passes to ray.init, and what it names
    registers the losses (as Ray calls it in each worker); the loss_mode key is verl's."""
    import importlib

    from omegaconf import OmegaConf
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    cfg = OmegaConf.load(os.path.join(os.path.dirname(core_algos.__file__), "..", "config",
                                      "_generated_ppo_trainer.yaml"))
    OmegaConf.set_struct(cfg, True)  # as Hydra composes it: a key that is not there needs `+`
    for override in " ".join(line.split("#")[0] for line in block("verl-override").split("\\\n")).split():
        key, value = override.split("=", 1)
        OmegaConf.update(cfg, key.lstrip("+"), value, force_add=key.startswith("+"))
    assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "rlkernels_gspo"
    hook = OmegaConf.merge(get_ppo_ray_runtime_env(), cfg.ray_kwargs.ray_init.runtime_env).worker_process_setup_hook
    module, name = hook.rsplit(".", 1)
    getattr(importlib.import_module(module), name)()
    assert core_algos.get_policy_loss_fn("rlkernels_gspo").__name__ == "rlkernels_gspo"


# verl's bypass_mode: (loss_type, rollout_is, rollout_is_threshold, rollout_rs, rollout_rs_threshold)
BYPASS_CASES = [
    ("ppo_clip", None, 2.0, None, None),
    ("reinforce", None, 2.0, None, None),
    ("reinforce", "token", 1.5, None, None),
    ("reinforce", "sequence", "0.5_3.0", None, None),
    ("ppo_clip", "token", 2.0, "token_k1", "0.8_1.25"),
    ("reinforce", "token", "0.7_1.6", "seq_mean_k3,token_k2", "0.02,0.3"),
    ("reinforce", "sequence", 4.0, "seq_sum_k1", 3.0),
    ("ppo_clip", None, 2.0, "seq_max_k3,seq_sum_k2,seq_mean_k1", "2.0"),
]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("case", BYPASS_CASES, ids=lambda c: "-".join(str(x) for x in c))
@pytest.mark.parametrize("info", BATCH_INFO, ids=["local", "global"])
def test_bypass_mode(case, mode, info):
    loss_type, level, is_threshold, rs, rs_threshold = case
    correction = dict(loss_type=loss_type, rollout_is=level, rollout_is_threshold=is_threshold, rollout_rs=rs,
                      rollout_rs_threshold=rs_threshold, rollout_is_batch_normalize=level == "token")
    cfg = _actor_config(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode=mode,
                        policy_loss=VerlPolicyLossConfig(loss_mode="bypass_mode", rollout_correction=correction))
    cfg.global_batch_info.update(info)
    logp, old, adv, mask, _ = _inputs(spread=1.0, seed=5)
    ref_loss, ref_grad, _ = _loss_and_grad(core_algos.get_policy_loss_fn("bypass_mode"), logp, old, adv, mask.float(),
                                           mode, cfg, None)
    loss, grad, _ = _loss_and_grad(rk_verl.bypass_mode_fn(), logp, old, adv, mask.float(), mode, cfg, None)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)


def test_bypass_mode_rejects_what_verl_rejects():
    logp, old, adv, mask, _ = _inputs(spread=1.0, seed=5)
    helper = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")
    for rs, threshold in [("token_k1", "0.8_1.25"), ("seq_mean_k3", 0.02), ("seq_max_k2", 0.1), ("seq_sum_k1", 3.0),
                          ("token_k3,seq_mean_k1", "0.05,0.9_1.1")]:
        want, _ = helper.compute_rollout_rejection_mask(logp.detach() - old, mask.float(), rollout_rs=rs,
                                                        rollout_rs_threshold=threshold)
        got = rk_verl._rejection_mask(logp.detach(), old, mask, rs, threshold)
        assert torch.equal(got, want.bool()), rs
        assert 0 < got.sum() < mask.sum(), f"{rs}: the inputs reach both sides of the test"
    with pytest.raises(ValueError, match="rollout_rs"):
        rk_verl._rejection_mask(logp.detach(), old, mask, "token_k4", 1.0)
    with pytest.raises(ValueError, match="rollout_correction"):  # as verl's, which needs it too
        rk_verl.bypass_mode_fn()(old, logp, adv, mask.float(), "token-mean", {"policy_loss": {}}, None)


def test_bad_verl_settings_name_the_field():
    """Values verl's config could hold that rlkernels cannot use fail with the field's name (they once failed in
    int(nan), float('abc') or torch.where's broadcast), and a fractional response_mask is refused: verl would
    weight its tokens, rlkernels' 0/1 masks cannot."""
    logp, old, adv, mask, w = _inputs()
    fn = rk_verl.policy_loss_fn("dr_grpo")
    for scale in (float("nan"), "abc", 0, 2.5):
        cfg = _actor_config()
        cfg.global_batch_info.update(loss_scale_factor=scale)
        with pytest.raises(ValueError, match="loss_scale_factor"):
            fn(old, logp, adv, mask, "seq-mean-token-sum-norm", cfg)
    with pytest.raises(ValueError, match="rollout_is_weights: expected shape"):
        rk_verl.policy_loss_fn("ppo")(old, logp, adv, mask, "token-mean", _actor_config(),
                                      torch.ones(mask.shape[0], mask.shape[1] + 1, dtype=torch.float64))
    fractional = mask.double()
    fractional[0, 0] = 0.5
    with pytest.raises(ValueError, match="response_mask"):
        rk_verl.policy_loss_fn("ppo")(old, logp, adv, fractional, "token-mean", _actor_config())
    for threshold in ("abc", "nan", "0.5_abc", "-1"):
        with pytest.raises(ValueError, match="rollout_rs_threshold"):
            rk_verl._rejection_mask(logp.detach(), old, mask, "token_k2" if "_" not in threshold else "token_k1",
                                    threshold)
    correction = dict(loss_type="reinforce", rollout_is="token", rollout_is_threshold="abc")
    cfg = _actor_config(policy_loss=VerlPolicyLossConfig(loss_mode="bypass_mode", rollout_correction=correction))
    with pytest.raises(ValueError, match="rollout_is_threshold"):
        rk_verl.bypass_mode_fn()(old, logp, adv, mask.float(), "token-mean", cfg, None)


def test_vespo_reads_verls_vespo_keys():
    """`rlkernels_vespo` takes (k, λ) from `policy_loss.vespo.{k_pos, lambda_pos, k_neg, lambda_neg}`, the keys the
    VESPO authors' verl loss reads: its loss is −mean over tokens of sg(φ(w_i))·A·ℓ with φ(w) = e^{λ + k·log w − λw}
    and w_i the row's sequence ratio, here written out directly; without the keys, the preset's (2, 3, 3, 2)."""
    logp, old, adv, mask, _ = _inputs(spread=0.2, empty_row=False)
    keys = {"k_pos": 1.0, "lambda_pos": 0.5, "k_neg": 5.0, "lambda_neg": 4.0}

    def expected(k_pos, lambda_pos, k_neg, lambda_neg):
        log_w = ((logp.detach() - old) * mask).sum(-1)
        pos = adv[:, 0] >= 0
        k, lam = torch.where(pos, k_pos, k_neg), torch.where(pos, lambda_pos, lambda_neg)
        phi = torch.exp(lam + k * log_w - lam * log_w.exp())
        return -(phi[:, None] * adv * logp * mask).sum() / mask.sum()

    fn = rk_verl.policy_loss_fn("vespo")
    for config, want in (({"policy_loss": {"vespo": keys}}, expected(**keys)),
                         ({"policy_loss": {}}, expected(2.0, 3.0, 3.0, 2.0))):
        loss, _ = fn(old_log_prob=old, log_prob=logp, advantages=adv, response_mask=mask, loss_agg_mode="token-mean",
                     config=config)
        (grad,) = torch.autograd.grad(loss, logp)
        (want_grad,) = torch.autograd.grad(want, logp)
        torch.testing.assert_close(loss, want.detach(), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match=r"policy_loss\.vespo\.k_neg"):
        fn(old_log_prob=old, log_prob=logp, advantages=adv, response_mask=mask, loss_agg_mode="token-mean",
           config={"policy_loss": {"vespo": {"k_neg": "x"}}})


# ---- a user's objective and preset, registered from outside rlkernels (python_tests/plugin_objectives.py) ----------
@pytest.fixture
def verl_registry(monkeypatch):
    """verl's registry of policy losses as a test found it, put back afterwards (`register()` wraps it)."""
    monkeypatch.setattr(core_algos, "POLICY_LOSS_REGISTRY", dict(core_algos.POLICY_LOSS_REGISTRY))


# (preset, verl's loss_agg_mode for the preset's agg)
PLUGIN_CASES = [("my_dapo", "token-mean"), ("my_seq", "seq-mean-token-mean")]


@pytest.mark.parametrize("preset,mode", PLUGIN_CASES)
@pytest.mark.parametrize("order", ["preset_first", "register_first"])
def test_a_users_preset_is_a_verl_loss_in_either_order(verl_registry, preset, mode, order):
    """`loss_mode=rlkernels_<preset>` for a preset of a user's objective, registered before `register()` or after it:
    verl's loss and gradient equal the preset called directly (`policy_loss`, verl's clip ratios as its clip), on
    fresh random inputs; unregistered, verl no longer finds it; registered again, it does."""
    with plugin_objectives.registered(preset, preset=False):
        if order == "register_first":
            rk_verl.register()
        plugin_objectives.register_preset(preset)
        if order == "preset_first":
            rk_verl.register()
        cfg = _actor_config(clip_ratio_low=0.1, clip_ratio_high=0.3, loss_agg_mode=mode)
        for seed in range(2):
            logp, old, adv, mask, _ = _inputs(spread=1.0, seed=seed)
            loss, grad, metrics = _loss_and_grad(core_algos.get_policy_loss_fn(f"rlkernels_{preset}"), logp, old,
                                                 adv, mask, mode, cfg, None)
            direct = rlkernels.policy_loss(logp, adv, mask, presets.get(preset, clip_low=0.1, clip_high=0.3),
                                           old_logp=old)
            (direct_grad,) = torch.autograd.grad(direct.loss, logp)
            assert loss.abs() > 1e-6 and grad.abs().sum() > 1e-6, "a vacuous comparison"
            torch.testing.assert_close(loss, direct.loss.detach(), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(grad, direct_grad, rtol=1e-12, atol=1e-12)
            assert metrics["actor/pg_clipfrac"] == pytest.approx(float(direct.metrics["clip_frac"]))
        presets.unregister(preset)
        with pytest.raises(ValueError, match=f"Unsupported loss mode: rlkernels_{preset}"):
            core_algos.get_policy_loss_fn(f"rlkernels_{preset}")
        plugin_objectives.register_preset(preset)
        assert core_algos.get_policy_loss_fn(f"rlkernels_{preset}").__name__ == f"rlkernels_{preset}"


def test_verl_clip_ratios_follow_the_objectives_clip():
    """verl's clip_ratio_low/high become clip_low/clip_high where the preset's objective reads a clip (its registry
    entry's `clip`, a plug-in's too) and nowhere else: a plug-in declared with clip=False keeps its preset's."""
    cfg = _actor_config(clip_ratio_low=0.1, clip_ratio_high=0.3)
    with plugin_objectives.registered("my_dapo", "my_seq"):
        clipped, unclipped = rk_verl.loss_config("my_dapo", cfg), rk_verl.loss_config("my_seq", cfg)
    assert (clipped.clip_low, clipped.clip_high) == (0.1, 0.3)
    assert (unclipped.clip_low, unclipped.clip_high) == (None, None)
    for preset in ("dapo", "cispo", "dppo_tv", "gspo"):
        assert (rk_verl.loss_config(preset, cfg).clip_low, rk_verl.loss_config(preset, cfg).clip_high) == (0.1, 0.3)
    for preset in ("fspo", "topr", "sapo", "snis"):
        own = presets.get(preset)
        assert (rk_verl.loss_config(preset, cfg).clip_low, rk_verl.loss_config(preset, cfg).clip_high) == (
            own.clip_low, own.clip_high), preset


def test_verl_lists_a_users_preset(verl_registry):
    """verl's error for an unknown loss_mode lists the users' presets among its modes; verl's own losses, registered
    before or after `register()`, stay; `register(presets=[...])` registers only those."""
    rk_verl.register()
    core_algos.register_policy_loss("my_own_verl_loss")(core_algos.get_policy_loss_fn("vanilla"))
    with plugin_objectives.registered("my_dapo"):
        with pytest.raises(ValueError, match="Unsupported loss mode: rlkernels_nope") as err:
            core_algos.get_policy_loss_fn("rlkernels_nope")
        assert "'rlkernels_my_dapo'" in str(err.value) and "'vanilla'" in str(err.value)
        assert core_algos.get_policy_loss_fn("my_own_verl_loss") is core_algos.get_policy_loss_fn("vanilla")
        assert rk_verl.register(presets=["my_dapo"], prefix="mine_") == ["mine_my_dapo"]
        assert core_algos.get_policy_loss_fn("mine_my_dapo").__name__ == "rlkernels_my_dapo"
        with pytest.raises(ValueError, match="Unsupported loss mode: mine_dapo"):
            core_algos.get_policy_loss_fn("mine_dapo")
    with pytest.raises(ValueError, match="preset: expected one of"):
        rk_verl.register(presets=["my_dapo"])  # unregistered now


def test_docs_plugin_block_is_a_verl_loss(verl_registry):
    """docs/integrations.md's plug-in, run as written after `register()`: `rlkernels_my_gspo` is verl's loss, equal to
    the preset called directly."""
    rk_verl.register()
    try:
        exec(block("plugin", "docs/integrations.md"), {})
        logp, old, adv, mask, _ = _inputs(spread=1.0, seed=4)
        mode = "seq-mean-token-mean"
        loss, grad, _ = _loss_and_grad(core_algos.get_policy_loss_fn("rlkernels_my_gspo"), logp, old, adv, mask, mode,
                                       _actor_config(loss_agg_mode=mode), None)
        direct = rlkernels.policy_loss(logp, adv, mask, presets.get("my_gspo"), old_logp=old).loss
        assert loss.abs() > 1e-6
        torch.testing.assert_close(loss, direct.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, torch.autograd.grad(direct, logp)[0], rtol=1e-12, atol=1e-12)
    finally:
        if "my_gspo" in presets.NAMES:
            presets.unregister("my_gspo")
        if "soft_trust" in rlkernels.losses.objectives.names():
            rlkernels.unregister_objective("soft_trust")
