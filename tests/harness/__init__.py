"""What the tests and the comparative benchmarks run beside kvstrata: engine launchers (SGLang with
the tests' CPU shims, SGLang's host pool in process), a private ``redis-server``, and the count of
engine starts."""
