"""``kvstrata bench``: one module per benchmark (``store`` with ``store_lookup`` and ``store_scale``,
``copy``, ``decode``, ``identity``), each beside the baselines it is read against. The comparative
benchmarks (ttft, serve, remote, SGLang's file backend) are the repository's, not the package's:
``python -m benchmarks``."""
