"""adapters/logs.py: kvstrata's log lines in the engine's log.

vLLM configures handlers for its own ``vllm`` logger only (``propagate`` off, nothing on the
root), so lines of any other logger below WARNING are lost, and warnings go out through Python's
last-resort handler without the engine's format. SGLang configures the root logger instead, which
``kvstrata`` reaches by propagation. ``follow_engine_logging`` makes the ``kvstrata`` logger write
through the engine logger's own handlers, at its level, when the engine logger has handlers and
nobody configured ``kvstrata`` already (an operator's logging config wins).
"""

from __future__ import annotations

import logging

OURS = "kvstrata"


def follow_engine_logging(engine_logger: str) -> bool:
    """Route ``kvstrata``'s records through the handlers of ``engine_logger``; True if it did."""
    ours, engine = logging.getLogger(OURS), logging.getLogger(engine_logger)
    if ours.handlers or not engine.handlers:
        return False
    for handler in engine.handlers:
        ours.addHandler(handler)
    ours.setLevel(engine.getEffectiveLevel())
    ours.propagate = False  # the engine's handlers only: not a second copy through the root
    return True
