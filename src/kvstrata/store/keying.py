"""The key half of ``BlockStore``'s facade: the store's key scheme and the keys of a prompt, a
partial tail, engine pages and a hybrid group's chain, each under a namespace's epoch root. A mixin:
the facade holds ``_parts`` (``parts.py``), ``_scopes`` (``scopes.py``) and ``_lookups``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from kvstrata.keys import NO_EXTRA, BlockChain, Extra, KeyScheme, Namespace, as_tokens, extra_at

if TYPE_CHECKING:
    from kvstrata.store.lookup import Lookup
    from kvstrata.store.parts import Parts
    from kvstrata.store.scopes import Scopes


class KeyMethods:
    _parts: "Parts"
    _scopes: "Scopes"
    _lookups: "Lookup"

    @property
    def keys(self) -> KeyScheme:
        """The key scheme every key of this store is computed with (``keys.hash``, keyed by the
        deployment secret where one is set), for tools and tests that key blocks the store holds."""
        return self._parts.keys

    def chain(self, ns: Namespace, tokens: Sequence[int] | np.ndarray, extra: Extra = NO_EXTRA,
              *, partial: bool = True) -> tuple[int, BlockChain]:
        """Current epoch and the chained keys of ``tokens`` (full blocks, then the partial tail)."""
        return self._lookups.chain(self._scopes.own(ns), tokens, extra, partial=partial)

    def tail_block(self, ns: Namespace, epoch: int, parent: bytes | None, tokens: Sequence[int] | np.ndarray,
                   extra: Extra = NO_EXTRA, *, start: int = 0) -> BlockChain:
        """The chain of one partial block: ``tokens`` (fewer than a block, from token ``start`` of
        the prompt) after the block ``parent`` (None: at the start of the prompt, under the root of
        ``epoch``)."""
        keys = self._parts.keys
        parent = keys.root_key(self._scopes.own(ns).seed, epoch) if parent is None else parent
        key, fp = keys.block_key(parent, as_tokens(tokens), extra_at(extra, start, start + len(tokens)))
        return BlockChain([key], [parent], [fp], [len(tokens)])

    def page_chain(self, ns: Namespace, epoch: int, digests: Sequence[bytes]) -> BlockChain:
        """Keys for engine pages whose own digests already chain the whole prefix (SGLang's page
        hash): page i is keyed by ``digests[i]`` alone, rooted at the namespace and ``epoch``, so
        a page is found whatever the engine still caches before it (``KeyScheme.rooted_digests``)."""
        keys = self._parts.keys
        return keys.rooted_digests(keys.root_key(self._scopes.own(ns).seed, epoch), digests, ns.block_size)

    def current_epoch(self, ns: Namespace) -> int:
        """The epoch saves of ``ns`` go under (a lookup checks that it is confirmed)."""
        return self._parts.epochs.get(self._scopes.own(ns).seed)

    def group_chain(self, ns: Namespace, epoch: int, tag: bytes, tokens: Sequence[int] | np.ndarray,
                    extra: Extra = NO_EXTRA) -> BlockChain:
        """The full-block keys of ``tokens`` on one KV-cache group's chain of a hybrid model
        (``KeyScheme.group_root``: under ``epoch``'s root and the group's ``tag``), as ``lookup_groups``
        finds them."""
        keys = self._parts.keys
        root = keys.group_root(keys.root_key(self._scopes.own(ns).seed, epoch), tag)
        return keys.chain_keys(root, as_tokens(tokens), ns.block_size, extra, partial=False)
