"""vLLM v1 KV connector over the kvstrata store (being split into modules)."""

from .connector import *  # noqa: F401,F403
from .connector import CONNECTOR_NAME, StrataConnector, StrataWorkerMetadata, register  # noqa: F401
