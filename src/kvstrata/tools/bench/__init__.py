"""``kvstrata bench``: one module per benchmark (``store``, ``remote``, ``ttft``, ``decode``,
``identity``; ``serve`` with its workload and engines), each beside the baselines it is read against."""
