"""Objectives registered by a user in plain PyTorch (`rlkernels.register_objective`): validated, listed, and run by
`policy_loss` and both fused ops (their general path) with the values of the built-in objective they re-implement,
checked against rlkernels/reference.py on fresh random inputs."""
from __future__ import annotations

import warnings

import pytest
import torch

import rlkernels
from rlkernels import presets, reference
from rlkernels.losses import objectives

from loss_inputs import random_loss_inputs
from plugin_objectives import PLUGINS, ppo_clip, registered, spo


@pytest.fixture
def plugin():
    with registered("my_dapo"):  # my_clip (token and sequence ratios) and a DAPO-like preset of it
        yield


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("ratio,builtin", [("token", "dapo"), ("sequence", "gspo")])
def test_plugin_equals_the_builtin_it_rewrites(plugin, ratio, builtin):
    base = presets.get(builtin)
    mine = base.replace(objective="my_clip")
    for seed in range(3):
        inputs = random_loss_inputs(noise=0.3, per_token_adv=ratio == "token", seed=seed)
        logp = inputs["logp"].double().requires_grad_(True)
        kw = dict(old_logp=inputs["old_logp"].double())
        want, _ = reference.policy_loss(logp, inputs["advantages"].double(), inputs["mask"], base, **kw)
        got = rlkernels.policy_loss(logp, inputs["advantages"].double(), inputs["mask"], mine, **kw)
        _close(got.loss, want)
        (g1,) = torch.autograd.grad(got.loss, logp)
        (g2,) = torch.autograd.grad(want, logp)
        _close(g1, g2)
        assert got.metrics["clip_frac"] == rlkernels.policy_loss(
            logp, inputs["advantages"].double(), inputs["mask"], base, **kw).metrics["clip_frac"]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_plugin_runs_on_both_fused_ops(plugin, backend):
    if not rlkernels.backend_info()[backend]["available"]:
        pytest.skip(rlkernels.backend_info()[backend]["reason"])
    g = torch.Generator().manual_seed(7)
    B, T, H, V = 3, 6, 8, 37
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    weight = (torch.randn(V, H, generator=g, dtype=torch.float64) * 0.3).requires_grad_(True)
    targets = torch.randint(0, V, (B, T), generator=g)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.3
    old = torch.log_softmax(hidden @ weight.detach().T, -1).gather(-1, targets[..., None])[..., 0] + \
        0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    config = presets.get("my_dapo")
    logits = hidden @ weight.T
    logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    want, _ = reference.policy_loss(logp, adv, mask, presets.dapo(), old_logp=old)
    (want_grad,) = torch.autograd.grad(want, weight)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a plug-in has no kernel entry by design: no general-path warning
        fused = rlkernels.fused_policy_loss(hidden @ weight.T, targets, adv, mask, config, old_logp=old,
                                            backend=backend)
        linear = rlkernels.fused_linear_policy_loss(hidden, weight, targets, adv, mask, config, old_logp=old,
                                                    backend=backend)
    for out in (fused, linear):
        _close(out.loss, want)
        (grad,) = torch.autograd.grad(out.loss, weight)
        _close(grad, want_grad)


def test_plugin_is_listed_and_validated(plugin):
    assert "my_clip" in objectives.names() and "my_clip" in objectives.taking("sequence")
    assert "my_dapo" in presets.NAMES
    with pytest.raises(TypeError, match="clip_low: expected a real number"):
        presets.get("my_dapo", clip_low=None)  # clip=True: the bounds are required
    with pytest.raises(ValueError, match="objective: 'my_clip' cannot be used with ratio='geometric'"):
        presets.get("my_dapo", ratio="geometric")
    with pytest.raises(ValueError, match="exists; pass replace=True"):
        rlkernels.register_objective("my_clip", ppo_clip)
    rlkernels.register_objective("my_clip", ppo_clip, ratios="token", clip=True, replace=True)
    assert objectives.get("my_clip").ratios == ("token",)


def test_registration_errors_name_the_argument():
    with pytest.raises(ValueError, match="a built-in"):
        rlkernels.register_objective("clip", ppo_clip, replace=True)
    with pytest.raises(ValueError, match="name: expected an identifier"):
        rlkernels.register_objective("my-loss", ppo_clip)
    with pytest.raises(ValueError, match="ratios: expected a non-empty subset"):
        rlkernels.register_objective("mine", ppo_clip, ratios=("geometric",))
    with pytest.raises(TypeError, match="surrogate: expected a callable"):
        rlkernels.register_objective("mine", 3)
    with pytest.raises(ValueError, match="objective: expected one of"):
        rlkernels.PolicyLossConfig(objective="never_registered")
    with pytest.raises(ValueError, match="a built-in"):
        rlkernels.unregister_objective("clip")
    assert "mine" not in objectives.names()


def test_a_wrong_output_names_the_objective():
    rlkernels.register_objective("bad_shape", lambda *, logp, **_: logp.sum(-1))
    try:
        inputs = random_loss_inputs(noise=0.1, seed=0)
        with pytest.raises(ValueError, match=r"objective 'bad_shape': its surrogate must return a floating \(B, T\)"):
            rlkernels.policy_loss(inputs["logp"], inputs["advantages"], inputs["mask"],
                                  rlkernels.PolicyLossConfig(objective="bad_shape", clip_low=None, clip_high=None))
    finally:
        rlkernels.unregister_objective("bad_shape")


def test_plugin_trains_the_demo(plugin, tmp_path):
    """The bundled trainer takes a registered preset as --algo: a short run of the demo's task trains with it."""
    import json
    import math
    import os

    from rlkernels.trainer import Config, train

    summary = train(Config(n_layer=1, n_embd=32, n_head=2, digits=1, eval_size=16, warmup_steps=5, warmup_batch=16,
                           prompts_per_step=4, num_generations=4, max_new_tokens=3, steps=2, eval_every=5,
                           progress=False, algo="my_dapo", out=str(tmp_path)))
    rows = [json.loads(line) for line in open(os.path.join(tmp_path, "metrics.jsonl"))]
    assert summary["algo"] == "my_dapo" and [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in rows)


def test_plugin_is_a_verl_loss(plugin):
    """`rlkernels_my_dapo` under verl: the same loss and gradient as `rlkernels_dapo`, verl's settings mapped alike."""
    verl = pytest.importorskip("rlkernels.integrations.verl")
    pytest.importorskip("verl")
    g = torch.Generator().manual_seed(3)
    logp = (-torch.rand(4, 9, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    old = logp.detach() + 0.3 * torch.randn(4, 9, generator=g, dtype=torch.float64)
    adv = torch.randn(4, 9, generator=g, dtype=torch.float64)
    mask = torch.rand(4, 9, generator=g) > 0.2
    config = {"clip_ratio_low": 0.1, "clip_ratio_high": 0.3}
    out = {}
    for name in ("my_dapo", "dapo"):
        loss, _ = verl.policy_loss_fn(name)(old_log_prob=old, log_prob=logp, advantages=adv, response_mask=mask,
                                            loss_agg_mode="token-mean", config=config)
        out[name] = (loss, *torch.autograd.grad(loss, logp))
    _close(out["my_dapo"][0], out["dapo"][0])
    _close(out["my_dapo"][1], out["dapo"][1])


def _spo_by_hand(logp, old, adv, mask, eps):
    """SPO's token mean, written out here: −(A·w − |A|/(2ε)·(w − 1)²), w = e^(ℓ − ℓ_old)."""
    w = torch.exp(torch.where(mask, logp - old, torch.zeros_like(logp)))
    adv = adv[:, None].expand_as(w) if adv.dim() == 1 else adv
    s = -(adv * w - adv.abs() / (2 * eps) * (w - 1) ** 2)
    return torch.where(mask, s, torch.zeros_like(s)).sum() / mask.sum()


def test_plugin_scalar_is_declared_validated_and_set():
    """SPO's ε is the plug-in's own scalar: its default, the preset's value, an override, `replace` and
    `PolicyLossConfig(scalars=...)` set it; the loss reads it; a bad value or an undeclared name is refused."""
    with registered("my_spo"):
        assert presets.get("my_spo").my_eps == 0.3  # the preset's
        assert rlkernels.PolicyLossConfig(objective="my_spo").my_eps == 0.2  # the declared default
        cfg = presets.get("my_spo", my_eps=0.5)
        assert cfg.my_eps == 0.5 and cfg.replace(my_eps=0.7).my_eps == 0.7
        assert cfg == rlkernels.PolicyLossConfig(objective="my_spo", scalars={"my_eps": 0.5})
        assert cfg.replace(objective="clip", clip_low=0.2, clip_high=0.2).scalars == ()  # not the clip's
        inputs = random_loss_inputs(noise=0.3, seed=4)
        args = (inputs["logp"], inputs["advantages"], inputs["mask"])
        for eps in (0.3, 0.5):
            got = rlkernels.policy_loss(*args, presets.get("my_spo", my_eps=eps), old_logp=inputs["old_logp"])
            _close(got.loss, _spo_by_hand(*args[:1], inputs["old_logp"], *args[1:], eps))
        with pytest.raises(ValueError, match=r"my_eps: expected a finite number in \(0, inf\)"):
            presets.get("my_spo", my_eps=0.0)
        with pytest.raises(ValueError, match=r"overrides: unknown PolicyLossConfig fields \['my_epsilon'\]"):
            presets.get("my_spo", my_epsilon=0.5)
        with pytest.raises(ValueError, match=r"scalars: objective 'clip' declares \(\)"):
            rlkernels.PolicyLossConfig(scalars={"my_eps": 0.5})
        with pytest.raises(ValueError, match="scalars: expected identifiers that are not PolicyLossConfig fields"):
            rlkernels.register_objective("clashing", spo, scalars={"clip_low": 0.1})
        with pytest.raises(ValueError, match=r"scalars\['eps'\] default: expected a finite number"):
            rlkernels.register_objective("bad_default", spo, scalars={"eps": objectives.Scalar(-1.0, low=0.0)})
    assert "clashing" not in objectives.names() and "bad_default" not in objectives.names()


def test_unregistering_an_objective_removes_its_presets():
    """Its presets go with it: neither `presets.NAMES` (the trainer's --algo, verl's rlkernels_<preset>) nor
    `presets.get` offers them."""
    with registered("my_spo"):
        assert "my_spo" in presets.NAMES
        rlkernels.unregister_objective("my_spo")
        assert "my_spo" not in presets.NAMES and "my_spo" not in objectives.names()
        with pytest.raises(ValueError, match="preset: expected one of"):
            presets.get("my_spo")


@pytest.mark.parametrize("ratio,builtin,surrogate", [("group_expectation", "gepo", "clip"),
                                                     ("sequence_sum", "topr", "topr")])
def test_plugin_takes_the_trajectory_and_grouped_ratios(ratio, builtin, surrogate):
    """A plug-in at GEPO's group ratio (PPO's clip) and at the trajectory ratio (TOPR's truncation, written as a
    user would) equals the built-in, against the oracle."""
    def topr(*, ratio, advantages, logp, **_):
        weight = torch.where(advantages < 0, ratio.detach().clamp(0, 1), torch.ones_like(ratio))
        return -weight * advantages * logp

    fn = ppo_clip if surrogate == "clip" else topr
    rlkernels.register_objective("my_ratio", fn, ratios=(ratio,), clip=surrogate == "clip")
    try:
        base = presets.get(builtin, ratio=ratio, group_size=3)
        mine = base.replace(objective="my_ratio")
        inputs = random_loss_inputs(noise=0.3, seed=5)
        logp = inputs["logp"].requires_grad_(True)
        kw = dict(old_logp=inputs["old_logp"], group_ids=inputs["group_ids"])
        want, _ = reference.policy_loss(logp, inputs["advantages"], inputs["mask"], base, **kw)
        got = rlkernels.policy_loss(logp, inputs["advantages"], inputs["mask"], mine, **kw)
        _close(got.loss, want)
        _close(*(torch.autograd.grad(x, logp)[0] for x in (got.loss, want)))
    finally:
        rlkernels.unregister_objective("my_ratio")


def test_plugin_scalar_is_set_by_verl_and_trl():
    """SPO's ε from verl's `policy_loss.my_eps` (0.5, not the preset's 0.3) and from TRL's argument `my_eps` on
    the trainer's args, under `rlkernels_my_spo`; the loss is SPO's at that ε."""
    verl = pytest.importorskip("rlkernels.integrations.verl")
    pytest.importorskip("verl")
    trl = pytest.importorskip("rlkernels.integrations.trl")
    from types import SimpleNamespace

    with registered("my_spo"):
        inputs = random_loss_inputs(noise=0.3, per_token_adv=True, empty_rows=(), seed=6)
        logp, old, adv, mask = (inputs[k] for k in ("logp", "old_logp", "advantages", "mask"))
        loss, _ = verl.policy_loss_fn("my_spo")(old_log_prob=old, log_prob=logp, advantages=adv,
                                                response_mask=mask, config={"policy_loss": {"my_eps": 0.5}})
        _close(loss, _spo_by_hand(logp, old, adv, mask, 0.5))
        assert verl.loss_config("my_spo", {"policy_loss": {}}).my_eps == 0.3  # absent: the preset's
        with pytest.raises(ValueError, match="policy_loss.my_eps: expected a finite number"):
            verl.loss_config("my_spo", {"policy_loss": {"my_eps": -1}})
        trainer = SimpleNamespace(args=SimpleNamespace(my_eps=0.5), loss_type="rlkernels_my_spo",
                                  importance_sampling_level="token", beta=0.0, off_policy_mask_threshold=None,
                                  top_entropy_quantile=1.0, max_completion_length=8)
        cfg, why = trl.loss_config(trainer)
        assert cfg == presets.get("my_spo", my_eps=0.5, kl_estimator=None, kl_coef=0.0), why
        trainer.args = SimpleNamespace()  # a GRPOConfig without the argument: the preset's
        assert trl.loss_config(trainer)[0].my_eps == 0.3


@pytest.mark.parametrize("preset", sorted(PLUGINS))
def test_every_plugin_runs_on_the_fused_ops_as_the_spec(preset):
    """Each plug-in of plugin_objectives.py, at its preset, through the fused op on logits of the CPU backend: the
    loss and gradient of `policy_loss` (the spec) at the same log-probs, without a case written for it."""
    if not rlkernels.backend_info()["cpu"]["available"]:
        pytest.skip(rlkernels.backend_info()["cpu"]["reason"])
    g = torch.Generator().manual_seed(11)
    B, T, V = 4, 5, 13
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64).requires_grad_(True)
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.3
    with registered(preset):
        config = presets.get(preset)
        adv = torch.randn((B, T) if config.ratio == "token" else (B,), generator=g, dtype=torch.float64)
        logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
        old = logp.detach() + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
        want = rlkernels.policy_loss(logp, adv, mask, config, old_logp=old).loss
        got = rlkernels.fused_policy_loss(logits, targets, adv, mask, config, old_logp=old, backend="cpu").loss
        _close(got, want)
        _close(*(torch.autograd.grad(x, logits)[0] for x in (got, want)))


def test_a_wrong_entry_is_refused_with_a_value_error():
    """`_declare` raises, not asserts (`python -O` removes asserts): a bad clip kind, a ratio that does not exist, a
    verl key for a field the objective does not read."""
    surrogate = {"token": objectives.PLUGIN_RATIOS["token"]}
    for entry, message in [(dict(clip="bogus"), "clip expected one of"),
                           (dict(surrogates={"nope": surrogate["token"]}), "ratios expected a non-empty subset"),
                           (dict(verl=objectives.Verl(keys={"dro_beta": ("policy_loss.dro_beta", None)})),
                            "verl keys or TRL arguments for fields it does not read")]:
        with pytest.raises(ValueError, match=message):
            objectives._declare(objectives.Objective(**{"name": "wrong", "surrogates": surrogate, **entry}))
    assert "wrong" not in objectives.names()
