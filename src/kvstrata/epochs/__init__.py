"""Namespace epochs: the rules and the in-memory store (``base``), epochs other processes change
(``polled``), their back ends (``folder``, ``redis``), what a namespace id stands for (``descriptors``)
and which weights generation this instance has joined (``joins``)."""
