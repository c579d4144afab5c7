"""SGLang HiCache storage backend over the kvstrata store (being split into modules)."""

from .storage import *  # noqa: F401,F403
from .storage import StrataStorage, load_strata_config  # noqa: F401
