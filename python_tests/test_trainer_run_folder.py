"""The run folder under faults (issue 26): a `--resume` that cannot rewrite metrics.jsonl leaves it whole, and a
folder that stops taking files mid-run (TensorBoard's writer, the model export) is a one-line error naming --out
and the folder, not an OSError traceback. Root writes into read-only folders, so the refusals are simulated where
the writes happen. Runs reuse test_trainer's tiny config: seconds each."""
import errno
import os
import json

import pytest
from test_trainer import run

from rlkernels.train import main
from rlkernels.trainer import outputs

ROWS = [{"step": s, "reward_mean": s / 10} for s in range(1, 9)]


def test_a_full_disk_while_resume_rewrites_metrics_loses_no_row(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    dumps, written = outputs.dumps, []

    def full_after_two_rows(obj, **kw):
        if len(written) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(obj)
        return dumps(obj, **kw)

    monkeypatch.setattr(outputs, "dumps", full_after_two_rows)
    with pytest.raises(ValueError, match=r"^--out: cannot write .*metrics.jsonl \(No space left on device\); "):
        outputs.truncate_metrics(str(path), str(path), 8)
    assert [json.loads(line) for line in path.read_text().splitlines()] == ROWS
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temporary file left
    monkeypatch.setattr(outputs, "dumps", dumps)
    assert outputs.truncate_metrics(str(path), str(path), 5) == ROWS[:5]
    assert [json.loads(line) for line in path.read_text().splitlines()] == ROWS[:5]


def _denied(*args, **kwargs):
    raise PermissionError(errno.EACCES, "Permission denied", "the file")


@pytest.mark.parametrize("where", ["tensorboard", "export"])
def test_a_run_folder_that_turns_unwritable_is_a_one_line_error(tmp_path, monkeypatch, where):
    extra = {}
    if where == "tensorboard":
        pytest.importorskip("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        monkeypatch.setattr(SummaryWriter, "add_scalar", _denied)
        extra = {"report_to": ["tensorboard"]}
    else:
        from transformers import PreTrainedModel

        monkeypatch.setattr(PreTrainedModel, "save_pretrained", _denied)  # the model export's own writer
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=rf"^--out: cannot write in '{out}' \(the file: Permission denied\)$"):
        run(out, steps=2, **extra)


def test_a_folder_holding_a_run_is_refused_without_resume_or_overwrite(tmp_path, capsys):
    """Issue 33: a second run on one --out replaced the first silently (metrics truncated, checkpoint and model
    overwritten, exit 0)."""
    from rlkernels.train import main
    from test_trainer import TINY

    run(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()] + ["--out", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rlkernels.train: error: --out: '{tmp_path}' holds a run (checkpoint.pt, metrics.jsonl, "
                          f"summary.json); continue it with --resume {tmp_path}") and err.count("\n") == 1
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before  # untouched
    assert main([*argv, "--overwrite"]) == 0
    assert (tmp_path / ".rlkernels.lock").exists()  # kept after the run: deleting it would let two runs hold it (issue 37 item 9)


def test_one_run_at_a_time_writes_a_folder(tmp_path):
    """Two runs on one --out: the later one is refused while the first holds the folder's lock."""
    from rlkernels.trainer import run_folder

    claim = run_folder.prepare_out_dir(str(tmp_path / "run"))
    with pytest.raises(ValueError, match=r"^--out: another run is writing .*run' \(it holds \.rlkernels\.lock\)"):
        run_folder.prepare_out_dir(str(tmp_path / "run"), overwrite=True)
    claim.release()
    run_folder.prepare_out_dir(str(tmp_path / "run")).release()


def test_a_run_that_fails_before_writing_leaves_no_folder(tmp_path, capsys):
    """Issue 33: a run that failed on its reward left an empty --out behind."""
    from rlkernels.train import main
    from test_trainer import TINY

    (tmp_path / "bad_reward.py").write_text("def score(prompt, completion, answer):\n    raise KeyError('oops')\n")
    out = tmp_path / "run"
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()]
    assert main([*argv, "--out", str(out), "--reward", f"{tmp_path / 'bad_reward.py'}:score"]) == 2
    assert "score raised KeyError ('oops')" in capsys.readouterr().err
    assert not out.exists()


def test_the_lock_cannot_be_held_twice_after_a_release(tmp_path):
    """Issue 37 item 9: the lock file was deleted on release, so a run that had opened it before and one that
    created it anew could both hold it. Forced interleaving: B opens the lock file while A holds it, A releases,
    C claims the folder; B's lock on what it opened must then fail."""
    import fcntl

    from rlkernels.trainer import run_folder

    out = str(tmp_path / "o")
    a = run_folder.prepare_out_dir(out)
    (tmp_path / "o" / "metrics.jsonl").write_text("")  # the run wrote something: the folder stays
    b = open(os.path.join(out, run_folder.LOCK), "w")
    a.release()
    c = run_folder.prepare_out_dir(out, resuming=True)
    with pytest.raises(BlockingIOError):
        fcntl.flock(b, fcntl.LOCK_EX | fcntl.LOCK_NB)
    b.close()
    c.release()


def test_a_folder_of_the_users_own_files_is_refused(tmp_path):
    """Issue 37 item 7: `--out` equal to `--model` replaced the base model's weights and tokenizer, and a folder of
    the user's files (their config.json, notes) was written over; now refused, naming --out, untouched."""
    from test_trainer import _local_checkpoint

    from rlkernels.trainer import run_folder

    _local_checkpoint(tmp_path / "m")
    before = {p.name: p.read_bytes() for p in (tmp_path / "m").iterdir()}
    (tmp_path / "d.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "1+2=", "answer": "3"}\n')
    code = main(["--model", str(tmp_path / "m"), "--dataset", str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "m"),
                 "--steps", "1", "--progress", "false"])
    assert code == 2 and {p.name: p.read_bytes() for p in (tmp_path / "m").iterdir()} == before
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="^--out: .*mine' holds files no run of this trainer wrote \\(notes.txt\\)"):
        run_folder.prepare_out_dir(str(tmp_path / "mine"), overwrite=True)
    claim = run_folder.prepare_out_dir(str(tmp_path / "new"))  # a new folder is claimed, and marked as a run's
    claim.release()
    assert not (tmp_path / "new").exists()  # nothing written: nothing left


def _files(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and p.name != ".rlkernels.lock"}


def test_overwrite_removes_only_what_a_run_wrote(tmp_path):
    """Issue 37 item 7: --overwrite replaced files by name, so the old run's other outputs stayed beside the new
    run's; a file of the user's in the run folder stays, every file the old run wrote (its marker lists them) goes."""
    from rlkernels.trainer import run_folder

    run(tmp_path, steps=1)
    run_folder.write_file(str(tmp_path / "old-extra.bin"), "an output only the old run wrote", "w")
    (tmp_path / "notes.txt").write_text("keep me")  # the user's, written after the run
    run(tmp_path, steps=2, overwrite=True)
    names = {p.name for p in tmp_path.iterdir()}
    assert "old-extra.bin" not in names and (tmp_path / "notes.txt").read_text() == "keep me"
    assert names - set(run_folder.written(str(tmp_path))) == {"notes.txt", ".rlkernels.lock", ".rlkernels-run"}
    assert "notes.txt" not in run_folder.written(str(tmp_path))


@pytest.mark.parametrize("how", ["killed", "failed"])
def test_an_overwrite_cut_short_before_its_first_checkpoint_gives_the_old_run_back(tmp_path, monkeypatch, how):
    """Issue 37 item 8: an --overwrite run killed before its first checkpoint left the old checkpoint beside the new
    run's metrics; --resume then continued the old run over the new rows. Now the old run comes back whole (at
    the failed run's end, or at the next start after a kill) and --resume continues it."""
    from rlkernels.trainer import checkpoint, run_folder

    run(tmp_path, steps=2)
    (tmp_path / "notes.txt").write_text("keep me")
    before = _files(tmp_path)

    def cut_short(run, step):
        raise RuntimeError("cut short")  # where the new run's first checkpoint would be written

    monkeypatch.setattr(checkpoint, "save", cut_short)
    if how == "killed":  # a kill runs no clean-up; the process's end releases the lock
        monkeypatch.setattr(run_folder.Claim, "release", lambda self: self._lock_file.close())
    with pytest.raises(RuntimeError, match="cut short"):
        run(tmp_path, steps=2, overwrite=True, seed=7)
    monkeypatch.undo()
    if how == "killed":
        assert os.path.isdir(tmp_path / run_folder.REPLACED)  # the new run's rows beside the set-aside old run
        run_folder.prepare_out_dir(str(tmp_path), resuming=True).release()
    assert _files(tmp_path) == before and not os.path.exists(tmp_path / run_folder.REPLACED)
    _, rows = run(tmp_path, steps=3, resume=str(tmp_path))
    old = [json.loads(line) for line in before["metrics.jsonl"].decode().splitlines()]
    assert rows[:2] == old and [r["step"] for r in rows] == [1, 2, 3]
