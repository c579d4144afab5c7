"""vLLM's weight updates made in memory, as the scheduler side sees them: whether the engine may use
the store now (``WeightUpdates``), and the hook that tells it of an update (``watch``).

Why a hook. vLLM 0.32 tells a KV connector nothing of a weight update; the connector hears only the
reset, ``reset_prefix_cache(reset_connector=True)`` or the one ``pause_generation(clear_cache=True)``
makes while the engine is paused (``EngineCore._finish_pause`` -> ``_reset_caches``). Every way of
changing the weights of a running engine is a collective RPC to its workers: ``reload_weights``,
``update_weights`` and its ``start_/finish_weight_update`` session (``LLM`` and ``AsyncLLM`` call
them so), a worker extension's own method, a callable. Each passes through
``EngineCore.collective_rpc``, in the process of the scheduler and of this connector's scheduler
side, between engine steps (``LLM.collective_rpc`` in process, a utility call of ``EngineCoreProc``
otherwise). kvstrata wraps it there, so that it sees every such call before it reaches a worker.

The rule, per engine:

- An update made after a reset of this engine with nothing computed since is covered by that reset:
  vLLM's order, ``pause_generation(clear_cache=True)`` (the reset), the update, then
  ``resume_generation()``. Nothing changes: the engine left the old epoch at the reset, and what it
  computes next is of the new weights.
- Any other update takes the engine *off the store* until its next reset: it serves nothing and
  plans no save. That is the old order, update then ``reset_prefix_cache(reset_connector=True)``:
  on a server, engine steps run between the two calls, and what they compute, of the new weights,
  was saved under the old epoch, where the instances still on the old weights loaded it. Saves
  planned before the update (computed with the old weights) complete under the old epoch, where
  they belong.
- The next reset puts the engine back on the store, in a new weights generation or the one another
  instance's reset made (``epochs/joins.py``): one generation per update, whichever order.

What counts as an update (``changes_weights``): vLLM's methods that write the weights, every other
method whose name mentions weights or parameters (worker extensions: ``update_weight``,
``update_named_param``, ...), and any callable (code run on the workers: kvstrata cannot tell what
it changes); not vLLM's read-only ones. A false one costs hits until the next reset, and says so
in the log.

Limits: weights changed without a collective RPC through the engine core (a trainer that holds the
workers' model objects, as with vLLM's ``external_launcher`` executor) are not seen; nor is a reset
made too early, with steps run between it and the update (their KV, of the old weights, goes under
the new generation). The pause rules out both.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Iterator

log = logging.getLogger(__name__)

# vLLM 0.32's worker methods that write the served weights (vllm/v1/worker/gpu_worker.py, worker_base.py)
WRITES = frozenset({"reload_weights", "update_weights", "start_weight_update", "start_draft_weight_update",
                    "finish_weight_update", "reset_weights", "load_model", "apply_model"})
# and those whose names mention weights but that write none
READS = frozenset({"compute_weight_checksums", "init_weight_transfer_engine", "shutdown_weight_transfer_engine",
                   "supports_draft_weight_updates"})
_MARK = "kvstrata_watches"  # set on the wrapper installed here: a second install is a no-op


def changes_weights(method: object) -> bool:
    """Whether a collective RPC of ``method`` (a worker method's name, or a callable) may change the
    served weights."""
    if not isinstance(method, str):
        return True  # code run on the workers: it may write anything
    if method in READS:
        return False
    name = method.lower()
    return method in WRITES or "weight" in name or "param" in name


class WeightUpdates:
    """One engine's weight updates, as its scheduler side sees them (see the module docstring).
    Called on the engine core's thread only: its steps, utility calls and collective RPCs run one
    at a time there."""

    def __init__(self) -> None:
        self._covered = False  # a reset was made and no step computed anything since
        self._off = False  # weights updated since the last reset, not covered by it

    @property
    def off(self) -> bool:
        """Whether the engine serves and saves nothing until its next reset."""
        return self._off

    def updated(self, method: object) -> None:
        """A collective RPC that may change the weights (``method``) is about to reach the workers."""
        if self._covered or self._off:
            return
        self._off = True
        log.warning("kvstrata: the weights may change in memory (%s) without a reset before it: kvstrata serves "
                    "and saves nothing until reset_prefix_cache(reset_connector=True). Update the weights between "
                    "pause_generation(clear_cache=True) and resume_generation() instead",
                    getattr(method, "__name__", method))

    def stepped(self, scheduled_tokens: int) -> None:
        """An engine step was planned, computing ``scheduled_tokens`` tokens."""
        if scheduled_tokens:
            self._covered = False

    def reset(self) -> None:
        """The engine reset (vLLM's ``reset_cache``): back on the store, and an update made before
        the next step is covered."""
        if self._off:
            log.info("kvstrata: reset after a weight update; serving and saving again")
        self._off = False
        self._covered = True


def watch() -> bool:
    """Install the hook in this process (once): every ``EngineCore.collective_rpc`` that may change
    the weights tells the ``WeightUpdates`` of that engine's connector first. False when vLLM's
    engine core could not be hooked (logged)."""
    try:
        from vllm.v1.engine.core import EngineCore
    except ImportError as e:
        log.warning("kvstrata: cannot hook vLLM's collective RPCs (%s): a weight update made in memory is seen only "
                    "at the reset; update weights between pause_generation(clear_cache=True) and resume", e)
        return False
    return hook(EngineCore)


def hook(engine_core: type) -> bool:
    """Wrap ``engine_core.collective_rpc`` (vLLM's ``EngineCore``, whose ``scheduler.connector`` is
    this engine's connector). False if the class has no such method."""
    original = getattr(engine_core, "collective_rpc", None)
    if original is None:
        log.warning("kvstrata: %s has no collective_rpc: a weight update made in memory is seen only at the reset",
                    engine_core.__name__)
        return False
    if getattr(original, _MARK, False):
        return True

    @functools.wraps(original)
    def collective_rpc(self: Any, method: Any, *args: Any, **kwargs: Any) -> Any:
        if changes_weights(method):
            for updates in _watched(getattr(getattr(self, "scheduler", None), "connector", None)):
                updates.updated(method)
        return original(self, method, *args, **kwargs)

    setattr(collective_rpc, _MARK, True)
    engine_core.collective_rpc = collective_rpc  # type: ignore[attr-defined]
    log.debug("kvstrata: watching %s.collective_rpc for weight updates", engine_core.__name__)
    return True


def _watched(connector: Any) -> Iterator[WeightUpdates]:
    """The ``WeightUpdates`` of kvstrata's connectors among ``connector`` (vLLM's ``MultiConnector``
    holds several: its ``sub_connectors``)."""
    for c in getattr(connector, "sub_connectors", None) or ([connector] if connector is not None else []):
        updates = getattr(c, "weight_updates", None)
        if isinstance(updates, WeightUpdates):
            yield updates
