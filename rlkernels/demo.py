"""`rlkernels bench` (or `python -m rlkernels.demo`): log-probs and a GRPO loss over a tiny `transformers` model.

Builds a small random causal LM from a config (nothing is downloaded), samples groups of
completions, and computes the GRPO loss of the logits twice: with rlkernels
(`token_logprobs` + `policy_loss`) and written plainly (log_softmax + gather, as TRL does).
Prints both losses, the largest gradient difference, and the time (median of warm calls) and
extra peak memory (first call) of each path, each measured in a fresh process, then the speed-up
and the memory saved, also drawn as a PNG (`--png`; skipped, with a note, without matplotlib).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time

import torch

from . import advantages, backend_info, policy_loss, presets, token_logprobs
from ._peak_memory import peak_since, reset_peak
from ._pyplot import pyplot


def _setup(args):
    """The model's logits for a batch of prompts+completions, and everything the loss needs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.seq_len + 1)
    model = LlamaForCausalLM(config).eval()
    batch = args.groups * args.group_size
    input_ids = torch.randint(0, args.vocab, (batch, args.seq_len + 1))
    with torch.no_grad():
        # position t scores token t+1; contiguous, so both paths start from the same tensor
        logits = model(input_ids).logits[:, :-1].float().contiguous()
    targets = input_ids[:, 1:]
    mask = torch.arange(args.seq_len)[None, :] < torch.randint(args.seq_len // 2, args.seq_len + 1, (batch, 1))
    rewards = torch.randint(0, 2, (batch,)).float()
    adv = advantages.group_normalized(rewards, group_size=args.group_size)
    with torch.no_grad():
        ref_logp = torch.log_softmax(logits + 0.1 * torch.randn_like(logits), -1).gather(-1, targets[..., None])[..., 0]
    return logits, targets, mask, adv, ref_logp


def _loss_rlkernels(logits, targets, mask, adv, ref_logp, backend):
    logp = token_logprobs(logits, targets, backend=backend)
    return policy_loss(logp, adv, mask, presets.grpo(), ref_logp=ref_logp).loss


def _loss_plain(logits, targets, mask, adv, ref_logp, backend):
    """GRPO written plainly over a materialised log_softmax (TRL's selective_log_softmax pattern)."""
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    ratio = torch.exp(logp - logp.detach())
    surrogate = torch.maximum(-adv[:, None] * ratio, -adv[:, None] * ratio.clamp(0.8, 1.2))
    delta = ref_logp - logp
    per_token = surrogate + 0.04 * (torch.exp(delta) - delta - 1)
    m = mask.float()
    rows = m.sum(-1)
    return ((per_token * m).sum(-1) / rows.clamp(min=1)).sum() / (rows > 0).sum()


_PATHS = {"rlkernels": _loss_rlkernels, "plain": _loss_plain}


def _measure(path, args, backend, queue, reps=3):
    """(median seconds of `reps` warm forward + backward calls, extra peak bytes of the first call).
    The memory is read on the first call, before freed pages can be reused; the time on later ones,
    after the one-time costs of a first call (op registration, lazy imports) that no training step pays."""
    torch.set_num_threads(args.threads)
    logits, *rest = _setup(args)
    logits.requires_grad_(True)
    start_rss = reset_peak()
    _PATHS[path](logits, *rest, backend).backward()
    peak = peak_since(start_rss)
    times = []
    for _ in range(reps):
        logits.grad = None
        start = time.perf_counter()
        _PATHS[path](logits, *rest, backend).backward()
        times.append(time.perf_counter() - start)
    queue.put((statistics.median(times), peak))


def _loss_and_grad(path, inputs, backend):
    logits, *rest = inputs
    logits = logits.detach().requires_grad_(True)
    loss = _PATHS[path](logits, *rest, backend)
    loss.backward()
    return loss.item(), logits.grad


def _draw(path, timings, title) -> bool:
    """Two bar charts, forward + backward time and extra peak memory, per path; False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    names = list(timings)
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(8, 3.2))
    # short axis labels, the details in the titles: a long y-label runs off a 3-inch-high figure
    ax_t.bar(names, [timings[k][0] * 1e3 for k in names], color=["tab:green", "tab:gray"])
    ax_t.set(title="forward + backward\n(median of warm calls)", ylabel="ms")
    ax_m.bar(names, [timings[k][1] / 2**20 for k in names], color=["tab:green", "tab:gray"])
    ax_m.set(title="extra peak memory\n(first call)", ylabel="MiB")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def main(argv=None):
    parser = argparse.ArgumentParser(prog="rlkernels bench", description=__doc__.split("\n\n")[1],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--vocab", type=int, default=32768, help="vocabulary size V of the model")
    parser.add_argument("--seq-len", type=int, default=256, help="completion tokens per row")
    parser.add_argument("--groups", type=int, default=2, help="prompts (GRPO groups)")
    parser.add_argument("--group-size", type=int, default=4, help="completions per prompt")
    parser.add_argument("--backend", default=None, help="rlkernels backend: cuda, triton, cpu or torch; none = auto")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads of each "
                        "measuring process")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the model and the batch")
    parser.add_argument("--png", default="rlkernels-demo.png", help="where to draw the comparison ('' for none)")
    args = parser.parse_args(argv)

    print("backends:", {k: v["available"] for k, v in backend_info().items()})
    n = args.groups * args.group_size * args.seq_len
    print(f"tokens N = {n}, vocabulary V = {args.vocab}: fp32 logits are {n * args.vocab * 4 / 2**20:.0f} MiB")
    inputs = _setup(args)
    (loss_k, grad_k), (loss_p, grad_p) = (_loss_and_grad(path, inputs, args.backend) for path in _PATHS)
    ctx = mp.get_context("spawn")  # a fresh process per path, so each peak is its own
    timings = {}
    for path in _PATHS:
        queue = ctx.Queue()
        proc = ctx.Process(target=_measure, args=(path, args, args.backend, queue))
        proc.start()
        timings[path] = queue.get()
        proc.join()
    (t_k, mem_k), (t_p, mem_p) = timings["rlkernels"], timings["plain"]
    print(f"{'path':<28}{'GRPO loss':>14}{'fwd+bwd s':>12}{'extra peak MiB':>16}")
    print(f"{'rlkernels':<28}{loss_k:>14.6f}{t_k:>12.3f}{mem_k / 2**20:>16.0f}")
    print(f"{'plain log_softmax + gather':<28}{loss_p:>14.6f}{t_p:>12.3f}{mem_p / 2**20:>16.0f}")
    print(f"rlkernels: {t_p / t_k:.1f}x the speed, {(mem_p - mem_k) / 2**20:.0f} MiB less extra peak memory")
    if args.png:
        drawn = _draw(args.png, timings, f"GRPO loss, N = {n}, V = {args.vocab}, fp32 logits")
        print(f"wrote {args.png}" if drawn else "no PNG: matplotlib is not installed")
    diff = (grad_k - grad_p).abs().max().item()
    print(f"max |∂loss/∂logits| difference: {diff:.2e}")
    if abs(loss_k - loss_p) > 1e-4 * max(1.0, abs(loss_p)) or diff > 1e-5:
        print("the two paths disagree", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
