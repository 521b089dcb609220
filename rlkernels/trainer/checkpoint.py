"""checkpoint.pt: the model(s), optimizer, RNG states and step of a run, with its config; written atomically,
read back without running anything in the file, and restored into a resumed run."""
from __future__ import annotations

import dataclasses
import os
import pickle
import random
import re

import torch
import torch.distributed as dist

from . import export, run_folder, sharding
from .distributed import all_sum
from .run_folder import CHECKPOINT
from .state import Run

CHECKPOINT_KEYS = ("config", "step", "kl_coef", "model", "critic", "ref", "optimizer", "eval_reward_before", "rng")


def save(run: Run, step: int) -> None:
    """checkpoint.pt (whole tensors and every rank's random state: under FSDP gathered onto rank 0, so every rank
    takes part) and the model as from_pretrained loads it."""
    cfg, place = run.cfg, run.place
    rngs = [rng_state(place.device)]
    if run.world > 1:
        rngs = [None] * run.world
        dist.all_gather_object(rngs, rng_state(place.device))
    cpu_rngs, cuda_rngs = zip(*rngs)
    model_state = sharding.full_state_dict(run.policy)
    optimizer_state = sharding.optimizer_state_dict(run.engine, run.optimizer)
    critic_state = sharding.full_state_dict(run.critic) if run.critic is not None else None
    ref_state = sharding.full_state_dict(run.ref) if run.ref is not None and not cfg.model else None
    if not run.master:
        return
    state = {
        "config": dataclasses.asdict(cfg), "step": step, "kl_coef": run.beta,
        "model": model_state, "critic": critic_state, "ref": ref_state,
        "optimizer": optimizer_state, "eval_reward_before": run.eval_before,
        "rng": {"torch": list(cpu_rngs), "cuda": list(cuda_rngs) if cuda_rngs[0] is not None else None,
                "python": run.rng.getstate(), "python_global": random.getstate()},
    }
    run_folder.write_atomically(os.path.join(run.logs.out, CHECKPOINT), lambda f: torch.save(state, f))
    if run.folder is not None:
        run.folder.settle()  # an --overwrite's old run: gone now that this one resumes
    export_model(run, model_state)


def restore(run: Run) -> None:
    """A resumed run: the step, β and every random state of its checkpoint (build_update has loaded its weights and
    optimizer state). A new run: one sampling stream per rank."""
    saved, resume, out = run.saved, run.cfg.resume, run.logs.out
    if not saved:
        torch.manual_seed(run.data.seed * 1000 + run.rank + 1)  # CPU and CUDA generators
        return
    try:
        run.start, run.beta, run.eval_before = saved["step"], saved["kl_coef"], saved["eval_reward_before"]
        run.rng.setstate(saved["rng"]["python"])
        random.setstate(saved["rng"]["python_global"])
        cuda_rngs = saved["rng"].get("cuda")  # absent from checkpoints of CPU runs
        set_rng_state(saved["rng"]["torch"][run.rank], cuda_rngs[run.rank] if cuda_rngs else None,
                      run.place.device)
    except (RuntimeError, ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
        raise unfit(resume, e) from None
    run.log(f"resumed at step {run.start} from {resume}")
    checkpoint = resume if os.path.isfile(resume) else os.path.join(resume, CHECKPOINT)
    stale = run.master and export_is_stale(out, checkpoint)
    if all_sum(float(stale)) > 0:  # killed after its checkpoint, before the model export: the export catches up
        export_model(run)
        run.log(f"exported the model of step {run.start} to {out} (the run stopped before writing it)")


def rng_state(device: torch.device):
    """(CPU, CUDA or None) generator states: sampling on a GPU draws from the CUDA generator."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def set_rng_state(cpu, cuda, device: torch.device) -> None:
    """Restore what `rng_state` saved. A checkpoint from a CPU run resumed on a GPU has no CUDA
    state: the CUDA generator keeps its seed (the run goes on, not bit-exactly)."""
    torch.set_rng_state(cpu)
    if cuda is not None and device.type == "cuda":
        torch.cuda.set_rng_state(cuda, device)


def export_model(run: Run, model_state=None) -> None:
    """The policy as from_pretrained loads it, into the run folder (under FSDP every rank takes part, to gather
    `model_state` when it is not given)."""
    if model_state is None and run.meta_policy is not None:
        model_state = sharding.full_state_dict(run.policy)
    if not run.master:
        return
    plain = run.policy if run.meta_policy is None else sharding.with_weights(run.meta_policy, model_state)
    export.save_pretrained(plain, run.tok, run.logs.out, merge_lora=run.cfg.merge_lora)


def export_is_stale(out: str, checkpoint: str) -> bool:
    """Whether the model in `out` is missing or older than `checkpoint` (a run killed between writing its
    checkpoint and the export, or resumed into a new folder)."""
    names = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors")
    times = [os.path.getmtime(os.path.join(out, n)) for n in names if os.path.exists(os.path.join(out, n))]
    return not times or max(times) < os.path.getmtime(checkpoint)


def load_checkpoint(resume: str) -> dict:
    """The checkpoint `--resume` points at (a run folder or the file), checked to be one of this trainer's."""
    path = os.path.join(resume, CHECKPOINT) if os.path.isdir(resume) else resume
    if not os.path.isfile(path):
        raise ValueError(f"--resume: no {CHECKPOINT} in {resume!r}")
    try:
        # tensors and plain Python values only (all a trainer checkpoint holds): a crafted file runs no code
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated, foreign or crafted file: say which flag pointed at it
        msg = str(e)
        name = re.search(r"GLOBAL (\S+)", msg)
        if isinstance(e, pickle.UnpicklingError) and name:
            raise ValueError(f"--resume: refusing {path!r}: it asks for {name.group(1)}, and a checkpoint of "
                             f"rlkernels.train holds only tensors and plain values (nothing in it was run)") from None
        reason = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", msg)
        raise ValueError(f"--resume: cannot read checkpoint {path!r} "
                         f"({type(e).__name__}: {reason.group(1) if reason else _one_line(e)})") from None
    missing = [k for k in CHECKPOINT_KEYS if not isinstance(saved, dict) or k not in saved]
    if missing or not isinstance(saved["config"], dict):
        raise ValueError(f"--resume: {path!r} is not a checkpoint of rlkernels.train "
                         f"(no {', '.join(missing or ['config'])})")
    return saved


def _one_line(e: Exception) -> str:
    """An exception's message on one line, cut to fit an error message."""
    return " ".join(str(e).split())[:300]


def unfit(resume: str, e: Exception) -> ValueError:
    """The error of a checkpoint whose tensors or states do not load into this run."""
    return ValueError(f"--resume: the checkpoint in {resume!r} does not fit this run ({type(e).__name__}: "
                      f"{_one_line(e)})")
