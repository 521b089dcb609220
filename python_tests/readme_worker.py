"""Runs the README's Python quick starts as written, and TRL's own GRPO script through `rlkernels trl grpo`, in a
process of their own (`apply()` patches trl.GRPOTrainer for the whole process) whose Hugging Face cache holds a
tiny stand-in under the README's model name (test_readme_quickstart.py builds it; nothing is downloaded).

    python readme_worker.py RECIPE.yaml RESULT.json    (in the folder the quick starts write to)
"""
import json
import sys

import torch

from doc_blocks import block


def main(recipe: str, result: str) -> None:
    from rlkernels.integrations import trl as rk_trl

    from trl import GRPOTrainer

    fused = []  # our loss, wrapped before the README's apply() installs it on trl.GRPOTrainer
    loss = rk_trl.compute_loss
    rk_trl.compute_loss = lambda self, model, inputs: (fused.append(type(self)), loss(self, model, inputs))[1]
    trl_own = dict(GRPOTrainer.__dict__)
    out = {}

    exec(block("quickstart-trl"), {})
    out["trl"] = {"fused_calls": len(fused), "classes": sorted({f"{c.__module__}.{c.__name__}" for c in fused})}
    for name in ("__init__", "_get_per_token_logps_and_entropies", "_compute_loss"):  # TRL's own again, so that
        setattr(GRPOTrainer, name, trl_own[name])  # `rlkernels trl grpo` must apply() itself
    del GRPOTrainer._rlkernels_applied

    ns = {}
    exec(block("quickstart-transformers"), ns)
    model, ids, adv, mask = ns["model"], ns["input_ids"], ns["adv"], ns["mask"]
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    logp = torch.log_softmax(model(ids).logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    ratio = torch.exp(logp - logp.detach())  # DAPO at ratio 1: the clip does not bind
    (-(adv[:, None] * ratio * mask).sum() / mask.sum()).backward()
    out["transformers"] = {"loss": ns["out"].loss.item(),
                           "grad_diff": max((grads[n] - p.grad).abs().max().item() for n, p in model.named_parameters()),
                           "grad_max": max(p.grad.abs().max().item() for p in model.parameters())}

    from rlkernels.cli import main as rlkernels_main

    before = len(fused)
    rlkernels_main(["trl", "grpo", "--config", recipe])
    out["trl_cli"] = {"fused_calls": len(fused) - before}
    with open(result, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
