"""kvstrata: a tiered, content-addressed KV block store for LLM serving engines.

The core never imports an engine; engine glue lives in ``kvstrata.adapters``.
"""

from kvstrata.config import ConfigError, StrataConfig, load_config
from kvstrata.index import BlockIndex, EntryMeta
from kvstrata.keys import FORMAT_VERSION, BlockChain, KeyScheme, Namespace, chain_keys, extra_digest, key_scheme, root_key
from kvstrata.store import BlockStore, Hit, StoreProtocol, open_store

__version__ = "0.1.0"

__all__ = [
    "FORMAT_VERSION",
    "BlockChain",
    "BlockIndex",
    "BlockStore",
    "ConfigError",
    "EntryMeta",
    "Hit",
    "KeyScheme",
    "Namespace",
    "StoreProtocol",
    "StrataConfig",
    "chain_keys",
    "extra_digest",
    "key_scheme",
    "load_config",
    "open_store",
    "root_key",
]
