"""The trainer's --device and --dtype (rlkernels/trainer/device.py): resolution, errors, bfloat16
runs on the CPU with float32 weights, exact resume at bfloat16, and a CUDA run where there is a GPU.

Runs reuse test_trainer's tiny config: a few seconds each on 2 cores."""
import dataclasses
import json

import pytest
import torch
from test_trainer import TINY, _strip, check_run, run

import rlkernels
from rlkernels.train import main
from rlkernels.trainer import Config, device, from_args, run_config, train


def test_auto_is_cpu_and_float32_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg, _ = from_args([])
    assert (cfg.device, cfg.dtype) == ("auto", "auto")
    assert device.placement(cfg.device, cfg.dtype) == device.Placement(torch.device("cpu"), torch.float32)
    assert device.Placement(torch.device("cpu"), torch.float32).describe() == {
        "device": "cpu", "dtype": "float32", "backend": None}


@pytest.mark.parametrize("spec", ["cuda", "cuda:1"])
def test_cuda_without_cuda_is_a_clear_error(monkeypatch, capsys, tmp_path, spec):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    message = rf"^--device {spec}: CUDA is not available here; this machine has only cpu \(.*\) \(use --device cpu"
    with pytest.raises(ValueError, match=message):
        from_args(["--device", spec])
    with pytest.raises(ValueError, match=message):
        train(Config(**{**TINY, "device": spec, "out": str(tmp_path)}))
    assert main(["--device", spec]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rlkernels.train: error: --device {spec}: CUDA is not available") and err.count("\n") == 1


def _fake_gpus(monkeypatch, count, bf16):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Old GPU")


def test_resolution_on_gpus(monkeypatch):
    """auto picks the GPU (cuda:LOCAL_RANK under torchrun) and bfloat16 where the GPU has it."""
    _fake_gpus(monkeypatch, 2, bf16=True)
    cuda = torch.device("cuda", 1)
    assert device.resolve_device("auto", local_rank=1, world=2) == cuda
    assert device.resolve_device("cuda:1") == cuda and device.resolve_device("cpu") == torch.device("cpu")
    assert device.resolve_dtype("auto", cuda) == torch.bfloat16
    assert device.resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert device.backend(cuda) == "nccl" and device.backend(torch.device("cpu")) == "gloo"
    with pytest.raises(ValueError, match="--device cuda:1: with 2 processes each rank takes cuda:LOCAL_RANK"):
        device.resolve_device("cuda:1", local_rank=0, world=2)
    with pytest.raises(ValueError, match=r"--device cuda: rank 2 needs cuda:2, and this machine has cpu and cuda:0, "
                                         r"cuda:1"):
        device.resolve_device("cuda", local_rank=2, world=3)
    with pytest.raises(ValueError, match="--device cuda:2: no such device"):
        from_args(["--device", "cuda:2"])
    _fake_gpus(monkeypatch, 1, bf16=False)
    assert device.resolve_dtype("auto", torch.device("cuda", 0)) == torch.float32
    with pytest.raises(ValueError, match=r"--dtype bfloat16: cuda:0 \(Old GPU\) has no bfloat16; use --dtype float32"):
        device.resolve_dtype("bfloat16", torch.device("cuda", 0))


def test_resume_takes_the_device_from_its_flags_and_the_dtype_from_the_run(tmp_path):
    saved = {**dataclasses.asdict(Config(**TINY)), "device": "cuda:0", "dtype": "bfloat16"}
    cfg = run_config.merge_resume(Config(resume=str(tmp_path)), saved)
    assert (cfg.device, cfg.dtype, cfg.steps) == ("auto", "bfloat16", TINY["steps"])
    assert run_config.merge_resume(Config(resume=str(tmp_path), dtype="float32"), saved).dtype == "float32"
    del saved["device"], saved["dtype"]  # a checkpoint from before the flags: it ran in float32
    assert run_config.merge_resume(Config(resume=str(tmp_path)), saved).dtype == "float32"
    assert run_config.merge_resume(Config(resume=str(tmp_path), dtype="bfloat16"), saved).dtype == "bfloat16"


def _spy_on_the_loss_head(monkeypatch):
    """The dtypes of the hidden states and lm_head weight that reach the fused op."""
    seen, real = [], rlkernels.fused_linear_policy_loss

    def spy(hidden, weight, *args, **kw):
        seen.append((hidden.dtype, weight.dtype, torch.is_autocast_enabled(hidden.device.type)))
        return real(hidden, weight, *args, **kw)

    monkeypatch.setattr(rlkernels, "fused_linear_policy_loss", spy)
    return seen


def test_bfloat16_on_cpu_trains_with_float32_weights(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    seen = _spy_on_the_loss_head(monkeypatch)
    summary, rows = run(tmp_path, dtype="bfloat16", steps=2)
    check_run(tmp_path, summary, rows, 2)
    assert seen and set(seen) == {(torch.bfloat16, torch.bfloat16, False)}  # the op runs outside autocast
    assert rows[0]["ratio_max"] < 3  # ℓ_old and the update's log-probs come from the same bfloat16 head
    assert (summary["device"], summary["dtype"], summary["backend"]) == ("cpu", "bfloat16", None)
    assert json.loads((tmp_path / "summary.json").read_text())["dtype"] == "bfloat16"
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert {w.dtype for w in ckpt["model"].values()} == {torch.float32}
    assert ckpt["rng"]["cuda"] is None
    assert {s["exp_avg"].dtype for s in ckpt["optimizer"]["state"].values()} == {torch.float32}
    assert AutoModelForCausalLM.from_pretrained(tmp_path).dtype == torch.float32


def test_float32_runs_without_autocast(tmp_path, monkeypatch):
    seen = _spy_on_the_loss_head(monkeypatch)
    summary, _ = run(tmp_path, steps=1, warmup_steps=0)
    assert set(seen) == {(torch.float32, torch.float32, False)} and summary["dtype"] == "float32"


def test_resume_after_bfloat16_is_exact(tmp_path):
    _, full = run(tmp_path / "full", dtype="bfloat16", steps=4)
    run(tmp_path / "half", dtype="bfloat16", steps=2)
    summary = train(Config(resume=str(tmp_path / "half"), steps=4, progress=False))
    resumed = [json.loads(line) for line in open(tmp_path / "half" / "metrics.jsonl")]
    assert _strip(resumed) == _strip(full) and summary["dtype"] == "bfloat16"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_run_resumes_exactly_and_on_the_cpu(tmp_path):
    _, full = run(tmp_path / "full", device="cuda", steps=4)
    summary, _ = run(tmp_path / "half", device="cuda", steps=2)
    assert summary["device"] == "cuda:0" and summary["dtype"] == ("bfloat16" if torch.cuda.is_bf16_supported() else
                                                                  "float32")
    ckpt = torch.load(tmp_path / "half" / "checkpoint.pt", weights_only=True)
    assert ckpt["rng"]["cuda"] is not None and {w.device.type for w in ckpt["model"].values()} == {"cuda"}
    train(Config(resume=str(tmp_path / "half"), device="cuda", steps=4, progress=False))
    resumed = [json.loads(line) for line in open(tmp_path / "half" / "metrics.jsonl")]
    assert _strip(resumed) == _strip(full)
    on_cpu = train(Config(resume=str(tmp_path / "half"), device="cpu", steps=5, progress=False))
    assert on_cpu["device"] == "cpu" and on_cpu["steps"] == 5
