"""matplotlib's pyplot on the file-only Agg backend, for the PNGs the demo and the trainer draw; None when
matplotlib is not installed (it is an optional dependency: the callers then skip their plot, with a note)."""
from __future__ import annotations


def pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
