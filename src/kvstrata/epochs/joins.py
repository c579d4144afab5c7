"""epochs/joins.py: ``Joins``, the weights generation this instance has *joined* per namespace, and the
rule that decides it (see ``epochs`` for generations).

Why: a reset made on one instance after a weight update starts a new generation. Every other
instance still holds the old weights until it updates them and resets too; if it adopted the new
epoch at once, it would save KV of the old weights under it (its own GPU cache serves it those
prompts again), and the instance that reset would load them. So an instance serves and saves only
the epochs of the generation it has joined:

- the first epoch it reads of a namespace is joined (it started after that epoch was made);
- an epoch of the generation it has joined is joined (a flush keeps the generation);
- an epoch of generation 0 (made because the stored one was lost or bad) is joined, unless the
  instance is behind: state loss costs hits, never availability;
- an epoch of another generation (a reset made elsewhere) leaves it *behind*: it serves and saves
  nothing of the namespace, whatever epoch comes next (flushes and state loss included: it still
  holds the weights it had), until its own reset (``join``). That reset joins the current epoch
  instead of starting yet another generation, so that in a loop where every instance updates its
  weights and then resets, the resets do not keep putting each other behind.
"""

from __future__ import annotations

import logging

from kvstrata.epochs.base import generation

log = logging.getLogger(__name__)


class Joins:
    """Per namespace, the generation joined, or behind. No lock of its own: the epoch store calls
    it under its lock, so that a namespace's current epoch and whether it is joined change
    together (a lookup that sees the new epoch also sees that it is not joined)."""

    def __init__(self) -> None:
        self._generation: dict[bytes, int | None] = {}  # seed -> the generation joined; None: behind
        self._warned: dict[bytes, int] = {}  # seed -> the epoch last logged as not joined

    def seen(self, ns_seed: bytes, epoch: int) -> bool:
        """``epoch`` is the namespace's current epoch (read, or written by a flush of this
        instance). True when it leaves the namespace behind for an epoch not logged yet: the
        caller then calls ``warn_behind`` (outside its lock)."""
        gen = generation(epoch)
        if ns_seed not in self._generation:  # the first read: this instance started after it
            self._generation[ns_seed] = gen
            return False
        mine = self._generation[ns_seed]
        if mine is not None and gen in (mine, 0):
            self._generation[ns_seed] = gen
            return False
        self._generation[ns_seed] = None
        if self._warned.get(ns_seed) == epoch:
            return False
        self._warned[ns_seed] = epoch
        return True

    def join(self, ns_seed: bytes, epoch: int) -> None:
        """This instance's own reset: it holds the weights of ``epoch``'s generation from now on."""
        self._generation[ns_seed] = generation(epoch)
        self._warned.pop(ns_seed, None)

    def joined(self, ns_seed: bytes) -> bool:
        """Whether the namespace is joined (one never read is: nothing of it is shared yet)."""
        return self._generation.get(ns_seed, 0) is not None

    def behind(self) -> list[bytes]:
        """The namespaces not joined."""
        return [seed for seed, gen in self._generation.items() if gen is None]


def warn_behind(ns_seed: bytes, epoch: int) -> None:
    """Log, once per namespace and epoch, that a reset made elsewhere left this instance behind."""
    log.warning("kvstrata: namespace %s was reset by another instance after a weight update (epoch %016x, "
                "generation %08x); this instance still holds the weights it had, so it serves and saves none of "
                "that namespace's blocks until it resets itself (vLLM: reset_prefix_cache(reset_connector=True)), "
                "which joins that epoch", ns_seed[:8].hex(), epoch, generation(epoch))
