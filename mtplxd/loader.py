"""Loading the model, for the daemon (rank 0) and for every follower rank alike.

The daemon (mtplxd/daemon.py) and the ranks (mtplxd/ranks/) both import this; neither
imports the other.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: the engine loads on the worker thread
    from engine.engine import Engine


def load_model(path: Path, group: Any = None) -> Engine:
    """Runs on the scheduler's worker thread (a follower's main thread); `group`:
    the ranks to split the model over (mtplxd/ranks/)."""
    import engine  # noqa: F401  (sets up BLAS before mlx.core loads)
    from engine.engine import Engine
    from mtplxd.store.models import touch_last_used

    loaded = Engine.load(path, group=group)
    touch_last_used(loaded.path)  # `mtplxd models` shows when each model was last used
    return loaded
