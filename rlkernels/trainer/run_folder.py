"""A run folder that stops taking files mid-run (made read-only, a full disk): the writes into it that are not
`loop.write_file`'s or `loop.save_checkpoint`'s (TensorBoard's and W&B's writers, the model export, the plot)
fail with one line naming --out and the folder, not an OSError traceback."""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def writing(out_dir: str):
    """Turn an OSError inside the block into a ValueError naming --out, `out_dir` and the file."""
    try:
        yield
    except OSError as e:
        file = f"{e.filename}: " if e.filename else ""
        raise ValueError(f"--out: cannot write in {out_dir!r} ({file}{e.strerror or e})") from None
