"""The run folder (--out): created and checked before any model loads, and written so that a folder that stops
taking files mid-run (made read-only, a full disk) fails with one line naming --out, not an OSError traceback.
A folder that holds a run is continued with --resume or replaced with --overwrite, never silently; one run at a
time writes it (a lock file held while it runs); a run that fails before writing anything leaves no folder."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Optional

try:
    import fcntl
except ImportError:  # Windows: runs are not locked
    fcntl = None

CHECKPOINT = "checkpoint.pt"
LOCK = ".rlkernels.lock"
MARKER = ".rlkernels-run"  # written into every folder a run claims: what it may write into again
RUN_FILES = (CHECKPOINT, "metrics.jsonl", "summary.json")  # what says a folder holds a run


@contextlib.contextmanager
def writing(out_dir: str):
    """Turn an OSError inside the block (the writes that are not `write_file`'s or checkpoint.py's: TensorBoard's
    and W&B's writers, the model export, the plot) into a ValueError naming --out, `out_dir` and the file."""
    try:
        yield
    except OSError as e:
        file = f"{e.filename}: " if e.filename else ""
        raise ValueError(f"--out: cannot write in {out_dir!r} ({file}{e.strerror or e})") from None
    except Exception as e:  # safetensors' own error class for the same failures (a full disk, a read-only folder)
        if type(e).__name__ != "SafetensorError":
            raise
        raise ValueError(f"--out: cannot write in {out_dir!r} (safetensors: {' '.join(str(e).split())[:200]})") from None


def write_file(path: str, text: str, mode: str) -> None:
    """Write or append `text`; a full disk (or a folder gone read-only) is a one-line error naming --out."""
    try:
        with open(path, mode) as f:
            f.write(text)
    except OSError as e:
        raise ValueError(f"--out: cannot write {path} ({e.strerror or e})") from None


class Claim:
    """A run's hold on its folder: the lock, and whether the run created the folder (`release` removes it if the
    run leaves it empty)."""

    def __init__(self, out: str, created: bool, lock_file):
        self.out, self.created, self._lock_file = out, created, lock_file

    def release(self) -> None:
        if self._lock_file is not None:
            # closing releases the lock; the file stays: deleting it would let a run that opened it before and one
            # that creates it anew both hold "the" lock
            self._lock_file.close()
        with contextlib.suppress(OSError):
            if self.created and set(os.listdir(self.out)) <= {LOCK, MARKER}:  # a run that wrote nothing
                shutil.rmtree(self.out)


def prepare_out_dir(out: str, resuming: bool = False, overwrite: bool = False) -> Claim:
    """Create `out`, check that it takes files (now, not after warm-up and evaluation) and that it holds no
    other run, and lock it for this run."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out: {out!r} is a file, not a folder")
    held = [name for name in RUN_FILES if os.path.exists(os.path.join(out, name))]
    theirs = sorted(set(os.listdir(out)) - {LOCK, MARKER}) if os.path.isdir(out) else []
    if theirs and not held and not os.path.exists(os.path.join(out, MARKER)):  # a model folder, the user's notes
        shown = ", ".join(theirs[:5]) + (", ..." if len(theirs) > 5 else "")
        raise ValueError(f"--out: {out!r} holds files no run of this trainer wrote ({shown}); a run writes only into "
                         f"a new or empty folder or a run folder of its own: choose another --out")
    if held and not resuming and not overwrite:
        raise ValueError(f"--out: {out!r} holds a run ({', '.join(held)}); continue it with --resume {out}, "
                         f"replace it with --overwrite, or choose another --out")
    created = not os.path.isdir(out)
    try:
        os.makedirs(out, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
        lock_file = _lock(out)
        with open(os.path.join(out, MARKER), "w") as f:
            f.write("a run folder of rlkernels train: --resume continues it, --overwrite replaces it\n")
    except OSError as e:
        raise ValueError(f"--out: cannot write in {out!r} ({e.strerror or e})") from None
    claim = Claim(out, created, lock_file)
    try:
        _clean_up_cut_short(out)
    except BaseException:
        claim.release()
        raise
    return claim


def _lock(out: str):
    """The open lock file of `out`, locked for this process; a ValueError if another run holds it."""
    if fcntl is None:
        return None
    f = open(os.path.join(out, LOCK), "w")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise ValueError(f"--out: another run is writing {out!r} (it holds {LOCK}); wait for it to end, or "
                         f"choose another --out") from None
    return f


def _clean_up_cut_short(out: str) -> None:
    """Remove what a run killed mid-write left: a partial checkpoint and a partial model export."""
    stale = os.path.join(out, CHECKPOINT + ".tmp")
    if os.path.exists(stale):  # a checkpoint write cut short; the checkpoint beside it is the last whole one
        os.remove(stale)
        print(f"removed {stale}: a checkpoint write that did not finish")
    from . import export  # transformers: not for the flags' checks, which import this module through trackers

    shutil.rmtree(os.path.join(out, export.TMP), ignore_errors=True)  # a model export cut short
