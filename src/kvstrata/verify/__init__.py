"""Verified hits: a stored block compared with the block the engine computed for the same key
(``compare``), layer by layer, under a tolerance per KV dtype."""
