"""Tools around the core: demo, trace, simulate, replay, estimate, torture, engine servers and
SGLang's host pool for in-process runs, benchmarks. The core never imports them; the command line
imports one only for the subcommand that runs."""
