"""The P/D roles of the vLLM connector (``kv_role``): what a prefill and a decode instance do
beyond ``kv_both``'s save-what-you-compute, load-what-is-stored. One object per scheduler side,
``make_role``; ``Role`` (``kv_both``) does nothing extra, so the scheduler calls it unconditionally.

- ``kv_producer`` (a prefill instance, ``Producer``) saves as ``kv_both`` does and publishes
  before it answers. vLLM sends a request's answer at the end of the engine step that finished
  it, after the connector has read the step's reports. A finished request that saved anything
  keeps its blocks (vLLM's delayed freeing: ``request_finished`` returns True); once every save op
  of the request is settled, ``publish`` waits, inside that same step, for the store's queued
  writes (the shared tier's among them), so a decode instance asked after the answer finds every
  block. The scheduler then names the request in the next step's metadata, every worker reports
  it as ``finished_sending`` and vLLM frees its blocks. The wait is bounded
  (``saves.publish_wait_ms``); a block the shared tier refused or a dropped save is a miss on the
  decode side, never a wrong block.
- ``kv_consumer`` (a decode instance, ``Consumer``) loads as ``kv_both`` does and, with
  ``saves.consumer: computed`` (the default), stores only what its own forward passes compute: a
  request's saves start after the tokens it had when first scheduled (vLLM's prefix cache and
  kvstrata's hit), and the blocks it loads from the shared tier get no copy on its disk tier.
  ``all`` makes it store as ``kv_both``.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from kvstrata.config import StrataConfig
from kvstrata.store import StoreProtocol

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger(__name__)


class Role:
    """``kv_both``: saves what it computes, loads what is stored, frees blocks at once."""

    name = "kv_both"
    local_copy = True  # blocks loaded from the shared tier are also written to the disk tier

    def planning(self, st: Any, block_size: int) -> None:
        """The request ``st`` (the scheduler's ``Pending``) is planned in this step."""

    def saving(self, req_id: str, op_id: int) -> None:
        """A save op of ``req_id`` went to the workers."""

    def settled(self, req_id: str, op_id: int) -> None:
        """Every rank reported the save op: it is committed (or aborted) now."""

    def finished(self, req_id: str) -> bool:
        """``request_finished``'s answer: whether vLLM keeps the request's blocks for us."""
        return False

    def publish(self) -> None:
        """End of a step's reports, before the step's answers go out."""

    def take_sent(self) -> set[str]:
        """Requests the workers report as ``finished_sending`` this step."""
        return set()


class Consumer(Role):
    """``kv_consumer`` with ``saves.consumer: computed``: stores only what it computes."""

    name = "kv_consumer"
    local_copy = False

    def planning(self, st: Any, block_size: int) -> None:
        if st.scheduled:
            return
        st.scheduled, req = True, st.request
        had = req.num_computed_tokens  # vLLM's prefix cache and kvstrata's hit, not computed here
        st.saved_full = max(st.saved_full, had // block_size)
        if had > req.num_prompt_tokens // block_size * block_size:
            st.tail_saved = True  # the partial tail was (partly) loaded


class Producer(Role):
    """``kv_producer``: finished requests' blocks are published before their answers leave."""

    name = "kv_producer"

    def __init__(self, store: StoreProtocol, wait_ms: int) -> None:
        self._store = store
        self._wait_s = wait_ms / 1000
        self._open: dict[str, set[int]] = {}  # request -> its save ops not reported by every rank yet
        self._saved: set[str] = set()  # live requests that sent a save (something to publish)
        self._held: set[str] = set()  # finished requests whose blocks vLLM keeps until we report them
        self._sent: set[str] = set()  # published: reported as finished_sending at the next step

    def saving(self, req_id: str, op_id: int) -> None:
        self._open.setdefault(req_id, set()).add(op_id)
        self._saved.add(req_id)

    def settled(self, req_id: str, op_id: int) -> None:
        ops = self._open.get(req_id)
        if ops is not None:
            ops.discard(op_id)
            if not ops:
                del self._open[req_id]

    def finished(self, req_id: str) -> bool:
        if req_id not in self._saved:
            return False  # nothing of its own to publish (a whole hit)
        self._saved.discard(req_id)
        self._held.add(req_id)
        return True

    def publish(self) -> None:
        ready = {r for r in self._held if r not in self._open}
        if not ready:
            return
        started = time.perf_counter()
        if not self._store.flush(self._wait_s):
            log.warning("kvstrata: saves of %d finished requests not all written after %.0f ms; their answers "
                        "go out now", len(ready), self._wait_s * 1000)
        log.debug("kvstrata: %d finished requests published in %.1f ms", len(ready),
                  (time.perf_counter() - started) * 1000)
        self._held -= ready
        self._sent |= ready

    def take_sent(self) -> set[str]:
        sent, self._sent = self._sent, set()
        return sent


def make_role(vllm_config: "VllmConfig", cfg: StrataConfig, store: StoreProtocol) -> Role:
    """The role object of this instance's ``kv_role`` (vLLM validated it; None is ``kv_both``)."""
    role = vllm_config.kv_transfer_config.kv_role or "kv_both"
    if role == "kv_producer":
        if not cfg.remote.enabled:
            log.warning("kvstrata: kv_producer without a shared tier (remote.enabled: false): decode "
                        "instances find only what they share with its disk tier")
        return Producer(store, cfg.saves.publish_wait_ms)
    if role == "kv_consumer" and cfg.saves.consumer == "computed":
        return Consumer()
    assert role in ("kv_both", "kv_consumer"), role
    return Role()
