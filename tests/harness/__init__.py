"""What the tests and the comparative benchmarks run beside kvstrata: engine launchers (SGLang with
the tests' CPU shims, SGLang's host pool in process), private ``redis-server``s (``redis_server``;
the unit tests' standalone servers and Cluster: ``redisutil``), and the count of engine starts."""
