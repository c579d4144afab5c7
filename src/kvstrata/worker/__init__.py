"""The worker side's door, beside the store protocol: whole-block copies between an engine's KV
tensors and L1 slots (``copy``) and the shared L1 arena the slots live in (``arena``)."""
