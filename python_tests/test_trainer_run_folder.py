"""The run folder under faults (issue 26): a `--resume` that cannot rewrite metrics.jsonl leaves it whole, and a
folder that stops taking files mid-run (TensorBoard's writer, the model export) is a one-line error naming --out
and the folder, not an OSError traceback. Root writes into read-only folders, so the refusals are simulated where
the writes happen. Runs reuse test_trainer's tiny config: seconds each."""
import errno
import json

import pytest
from test_trainer import run

from rlkernels.trainer import export, outputs

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
        monkeypatch.setattr(export, "save_pretrained", _denied)
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=rf"^--out: cannot write in '{out}' \(the file: Permission denied\)$"):
        run(out, steps=2, **extra)
