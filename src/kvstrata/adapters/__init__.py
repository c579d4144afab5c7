"""Engine glue (vLLM, SGLang). Only these modules import an engine; the core never does."""
