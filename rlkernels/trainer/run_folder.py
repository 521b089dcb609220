"""The run folder (--out): created and checked before any model loads, and written so that a folder that stops
taking files mid-run (made read-only, a full disk) fails with one line naming --out, not an OSError traceback."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

from . import export

CHECKPOINT = "checkpoint.pt"


@contextlib.contextmanager
def writing(out_dir: str):
    """Turn an OSError inside the block (the writes that are not `write_file`'s or checkpoint.py's: TensorBoard's
    and W&B's writers, the model export, the plot) into a ValueError naming --out, `out_dir` and the file."""
    try:
        yield
    except OSError as e:
        file = f"{e.filename}: " if e.filename else ""
        raise ValueError(f"--out: cannot write in {out_dir!r} ({file}{e.strerror or e})") from None


def write_file(path: str, text: str, mode: str) -> None:
    """Write or append `text`; a full disk (or a folder gone read-only) is a one-line error naming --out."""
    try:
        with open(path, mode) as f:
            f.write(text)
    except OSError as e:
        raise ValueError(f"--out: cannot write {path} ({e.strerror or e})") from None


def prepare_out_dir(out: str) -> None:
    """Create `out` and check that it takes files: now, not after warm-up and evaluation."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out: {out!r} is a file, not a folder")
    try:
        os.makedirs(out, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise ValueError(f"--out: cannot write in {out!r} ({e.strerror or e})") from None
    stale = os.path.join(out, CHECKPOINT + ".tmp")
    if os.path.exists(stale):  # a checkpoint write cut short; the checkpoint beside it is the last whole one
        os.remove(stale)
        print(f"removed {stale}: a checkpoint write that did not finish")
    shutil.rmtree(os.path.join(out, export.TMP), ignore_errors=True)  # a model export cut short
