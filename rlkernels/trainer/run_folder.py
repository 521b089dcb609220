"""The run folder (--out): created and checked before any model loads, and written so that a folder that stops
taking files mid-run (made read-only, a full disk) fails with one line naming --out, not an OSError traceback.
A folder that holds a run is continued with --resume or replaced with --overwrite, never silently; one run at a
time writes it (a lock file held while it runs); a run that fails before writing anything leaves no folder.

A run writes only into a new or empty folder or one a run marked as its own (MARKER), and the marker lists every
name a run wrote there (`record`, called before each write): what `--overwrite` removes, and nothing else. An
overwrite is atomic from the user's view: the old run's files are set aside (REPLACED) and removed only once the
new run has its first checkpoint (or its summary); a new run that fails before that, or is killed, gives the old
run back (at its end, or at the next start in the folder)."""
from __future__ import annotations

import contextlib
import fnmatch
import os
import shutil
import tempfile

try:
    import fcntl
except ImportError:  # Windows: runs are not locked
    fcntl = None

CHECKPOINT = "checkpoint.pt"
LOCK = ".rlkernels.lock"
MARKER = ".rlkernels-run"  # written into every folder a run claims: what it may write into again
EXPORT_TMP = ".hf.tmp"  # the model export writes its files here first, then moves them into the folder one by one
REPLACED = ".rlkernels-replaced"  # the run an --overwrite replaces, until the new one has its first checkpoint
RUN_FILES = (CHECKPOINT, "metrics.jsonl", "summary.json")  # what says a folder holds a run
OURS = {LOCK, MARKER, REPLACED}
# what a run wrote, in a folder of a version that kept no list: its logs, checkpoint, trackers and model export
UNLISTED_RUN_FILES = (*RUN_FILES, CHECKPOINT + ".tmp", "completions.jsonl", "metrics.png", "events.out.tfevents.*",
                      "wandb", EXPORT_TMP, "config.json", "generation_config.json", "model.safetensors",
                      "model-*-of-*.safetensors", "model.safetensors.index.json", "adapter_config.json",
                      "adapter_model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                      "chat_template.jinja")
_HEADER = "# a run folder of rlkernels train (--resume continues it, --overwrite replaces it); what runs wrote here:\n"


def record(path: str) -> None:
    """List `path` in its folder's marker as written by a run (before it is written: a kill mid-write leaves it
    listed). Nothing in a folder without a marker (a file outside a run folder)."""
    folder, name = os.path.split(os.path.abspath(path))
    marker = os.path.join(folder, MARKER)
    if os.path.isfile(marker) and name not in written(folder):
        with open(marker, "a") as f:
            f.write(name + "\n")


def written(folder: str) -> list:
    """The names the marker of `folder` lists as written by its runs."""
    with open(os.path.join(folder, MARKER)) as f:
        return [line.rstrip("\n") for line in f if line.strip() and not line.startswith("#")]


@contextlib.contextmanager
def writing(out_dir: str):
    """Turn an OSError inside the block (the writes that are not `write_file`'s or checkpoint.py's: TensorBoard's
    and W&B's writers, the model export) into a ValueError naming --out, `out_dir` and the file."""
    try:
        yield
    except OSError as e:
        file = f"{e.filename}: " if e.filename else ""
        raise ValueError(f"--out: cannot write in {out_dir!r} ({file}{e.strerror or e})") from None
    except Exception as e:  # safetensors' own error class for the same failures (a full disk, a read-only folder)
        if type(e).__name__ != "SafetensorError":
            raise
        raise ValueError(f"--out: cannot write in {out_dir!r} (safetensors: {' '.join(str(e).split())[:200]})") from None


def write_atomically(path: str, write) -> None:
    """`write(f)` (a binary file) into `path` whole or not at all: into a temporary file, synced, then renamed over
    `path`, so that a kill or a full disk leaves the old file or the new one, never a torn one. A failure is a
    one-line error naming --out, with the temporary file removed."""
    tmp = path + ".tmp"
    try:
        record(tmp)
        record(path)
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it the file (else a crash can leave it empty)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # torch.save on a full disk says "basic_ios::clear" or "unexpected pos"
        with contextlib.suppress(OSError):
            os.remove(tmp)
        why = (e.strerror if isinstance(e, OSError) and e.strerror else
               "the disk is full or the file cannot grow" if "unexpected pos" in str(e) or "basic_ios" in str(e) else
               " ".join(str(e).split())[:200])
        raise ValueError(f"--out: cannot write {path} ({why})") from None


def write_file(path: str, text, mode: str) -> None:
    """Write or append `text` (bytes with mode "wb"); a full disk (or a folder gone read-only) is a one-line error naming --out."""
    try:
        if mode != "a" or not os.path.exists(path):  # an append to a file it made: listed then (not every step)
            record(path)
        with open(path, mode) as f:
            f.write(text)
    except OSError as e:
        raise ValueError(f"--out: cannot write {path} ({e.strerror or e})") from None


class Claim:
    """A run's hold on its folder: the lock, whether the run created the folder (`release` removes it if the
    run leaves it empty), and the run an --overwrite set aside (`settle` removes it, `release` gives it back)."""

    def __init__(self, out: str, created: bool, lock_file):
        self.out, self.created, self._lock_file = out, created, lock_file
        self.replacing = False

    def settle(self) -> None:
        """The new run has a checkpoint (or its summary): the run it replaces is gone for good."""
        if self.replacing:
            shutil.rmtree(os.path.join(self.out, REPLACED))
            self.replacing = False

    def release(self) -> None:
        if self.replacing:  # failed or stopped before its first checkpoint: the folder holds the old run again
            _give_back_replaced(self.out)
        if self._lock_file is not None:
            # closing releases the lock; the file stays: deleting it would let a run that opened it before and one
            # that creates it anew both hold "the" lock
            self._lock_file.close()
        with contextlib.suppress(OSError):
            if self.created and set(os.listdir(self.out)) <= OURS:  # a run that wrote nothing
                shutil.rmtree(self.out)


def prepare_out_dir(out: str, resuming: bool = False, overwrite: bool = False) -> Claim:
    """Create `out`, check that it takes files (now, not after warm-up and evaluation), that it is new, empty or a
    run folder, and that it holds no other run unless resumed or overwritten, and lock it for this run."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out: {out!r} is a file, not a folder")
    theirs = sorted(set(os.listdir(out)) - OURS) if os.path.isdir(out) else []
    ours = any(os.path.exists(os.path.join(out, name)) for name in (*RUN_FILES, MARKER, REPLACED))
    if theirs and not ours:  # a model folder (--out equal to --model), the user's notes
        shown = ", ".join(theirs[:5]) + (", ..." if len(theirs) > 5 else "")
        raise ValueError(f"--out: {out!r} holds files no run of this trainer wrote ({shown}); a run writes only into "
                         f"a new or empty folder or a run folder of its own: choose another --out")
    created = not os.path.isdir(out)
    try:
        os.makedirs(out, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
        lock_file = _lock(out)
    except OSError as e:
        raise ValueError(f"--out: cannot write in {out!r} ({e.strerror or e})") from None
    claim = Claim(out, created, lock_file)
    try:
        if os.path.isdir(os.path.join(out, REPLACED)):  # an --overwrite killed before its first checkpoint
            _give_back_replaced(out)
        held = [name for name in RUN_FILES if os.path.exists(os.path.join(out, name))]
        if held and not resuming and not overwrite:
            raise ValueError(f"--out: {out!r} holds a run ({', '.join(held)}); continue it with --resume {out}, "
                             f"replace it with --overwrite, or choose another --out")
        if held and not resuming:
            _set_aside(out)
            claim.replacing = True
        try:
            if not os.path.isfile(os.path.join(out, MARKER)):
                with open(os.path.join(out, MARKER), "w") as f:
                    f.write(_HEADER)
        except OSError as e:
            raise ValueError(f"--out: cannot write in {out!r} ({e.strerror or e})") from None
        _clean_up_cut_short(out)
    except BaseException:
        claim.release()
        raise
    return claim


def _set_aside(out: str) -> None:
    """Move what the runs in `out` wrote (its marker's list; by name in a folder without one) into REPLACED."""
    aside = os.path.join(out, REPLACED)
    os.mkdir(aside)
    marker = os.path.join(out, MARKER)
    if os.path.isfile(marker):
        names = written(out)
        os.replace(marker, os.path.join(aside, MARKER))  # first: a kill from here on leaves no marker of the old run
    else:
        names = [n for n in os.listdir(out) if any(fnmatch.fnmatch(n, p) for p in UNLISTED_RUN_FILES)]
    for name in names:
        if os.path.lexists(os.path.join(out, name)):
            os.replace(os.path.join(out, name), os.path.join(aside, name))


def _give_back_replaced(out: str) -> None:
    """Undo an --overwrite whose run did not reach its first checkpoint: remove what that run wrote (its marker's
    list) and move the old run's files back."""
    aside = os.path.join(out, REPLACED)
    if os.path.isfile(os.path.join(out, MARKER)):
        for name in written(out):
            path = os.path.join(out, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            elif os.path.lexists(path):
                os.remove(path)
        os.remove(os.path.join(out, MARKER))
    for name in os.listdir(aside):
        os.replace(os.path.join(aside, name), os.path.join(out, name))
    os.rmdir(aside)
    print(f"{out}: the run an --overwrite replaced is back (the new run stopped before its first checkpoint)")


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
    shutil.rmtree(os.path.join(out, EXPORT_TMP), ignore_errors=True)  # a model export cut short
