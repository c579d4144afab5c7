"""index: the block index, which blocks exist, where, and whether a requested chain may use
them: ``BlockIndex`` (``blockindex``: lookups, pins, commits, eviction) over the rows of
``table`` (``EntryMeta``, one block's entry, and the numpy columns that hold them), found by key
through ``keymap`` (``KeyMap``: key -> row in numpy slots, probed for a whole prompt at once)."""

from .blockindex import BlockIndex, Lease
from .keymap import KeyMap
from .table import EntryMeta

__all__ = ["BlockIndex", "EntryMeta", "KeyMap", "Lease"]
