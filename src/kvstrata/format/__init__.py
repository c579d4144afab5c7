"""The stored block: its header and payload checksums (``block``) and the keyed MACs of what is read
back from a shared tier (``auth``)."""
