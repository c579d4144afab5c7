"""The suite's count of engine starts: one JSON line per start, appended to the file
``$KVSTRATA_ENGINE_STARTS`` names, by every process the suite runs (tests/conftest.py prints the
tally). The launchers here call ``note_start``; ``count_engine_starts`` makes kvstrata's own
launcher (``kvstrata.tools.serving.Server``) call it too."""

from __future__ import annotations

import contextlib
import json
import os
import sys

STARTS_ENV = "KVSTRATA_ENGINE_STARTS"


def note_start(kind: str) -> None:
    """Append one JSON line about this engine start to ``$KVSTRATA_ENGINE_STARTS``, if set."""
    path = os.environ.get(STARTS_ENV)
    if path:
        with contextlib.suppress(OSError), open(path, "a") as f:
            f.write(json.dumps({"kind": kind, "pid": os.getpid(), "argv0": os.path.basename(sys.argv[0]),
                                "test": os.environ.get("PYTEST_CURRENT_TEST", "")}) + "\n")


def count_engine_starts() -> None:
    """Count the engines ``kvstrata.tools.serving.Server`` starts in this process (once)."""
    from kvstrata.tools import serving

    if note_start not in serving.START_LISTENERS:
        serving.START_LISTENERS.append(note_start)
