"""Tools around the core: demo, trace, simulate, replay, estimate, engine processes, benchmarks."""
