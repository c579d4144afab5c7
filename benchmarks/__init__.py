"""Comparative benchmarks: kvstrata beside the engines' native caches, LMCache and SGLang's HiCache
(``python -m benchmarks --help``). They run from a checkout, with the test harness (``tests/harness``),
and are not shipped in the wheel."""
