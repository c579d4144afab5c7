"""index: the block index, which blocks exist, where, and whether a requested chain may use
them: ``BlockIndex`` (``blockindex``: lookups, pins, commits, eviction) over the rows of
``table`` (``EntryMeta``, one block's entry, and the numpy columns that hold them), found by key
through ``keymap`` (``KeyMap``: key -> row in numpy slots, probed for a whole prompt at once);
``pins`` says who holds a pin and when it ends (``Lease``, a pin's owner token)."""

from kvstrata.index.blockindex import BlockIndex
from kvstrata.index.keymap import KeyMap
from kvstrata.index.pins import Lease, PinCensus
from kvstrata.index.table import EntryMeta

__all__ = ["BlockIndex", "EntryMeta", "KeyMap", "Lease", "PinCensus"]
