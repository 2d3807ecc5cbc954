"""`BlockManager`: the paged KV cache's bookkeeping, with automatic prefix caching.

The cache is a pool of fixed-size blocks (`block_size` token positions each). A sequence
owns a block table: its positions `i` live in block `table[i // block_size]` at offset
`i % block_size`. Block 0 is never handed out: writes of padding go there and short tables
are padded with it, so the engine never needs a special case.

Prefix caching, as in vLLM and nano-vllm: a full block is named by a chained hash of its
parent's hash, its tokens and a namespace (the model), so equal prefixes give equal names.
A block keeps its name after its last owner frees it: it sits in an LRU of free blocks and
a later sequence with the same prefix takes it back instead of recomputing it. Fresh blocks
come from never-used ids first, then from free blocks without a name, and only then from
the LRU's oldest (tails first, since a freed sequence releases its tail first). A hit is
verified against the block's tokens, so a hash collision costs a recompute, never a wrong
answer. Blocks shared by several owners (siblings of one prompt) are copied before one of
them is written: copy-on-write.

Pure bookkeeping: no torch. The engine applies the copies it is told about.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from common.prefix import next_name, prefix_names

NULL_BLOCK = 0


@dataclass(slots=True)
class _Owner:
    table: list[int]
    tokens: list[int]  # tokens whose KV is (or is about to be) written, in order
    named: int = 0  # leading blocks that already carry a name
    parent: bytes = b""  # the name of block `named - 1`, or the namespace


@dataclass(slots=True)
class CacheStats:
    queried_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # of those, found cached
    evictions: int = 0  # named blocks handed out for new content
    copies: int = 0  # copy-on-write block copies


@dataclass(slots=True)
class BlockManager:
    num_blocks: int  # including the null block
    block_size: int
    caching: bool = True
    namespace: bytes = b""
    stats: CacheStats = field(default_factory=CacheStats)
    _refs: list[int] = field(init=False)
    _owners: dict[int, _Owner] = field(init=False, default_factory=dict)
    _unnamed: list[int] = field(init=False, default_factory=list)  # free, nothing cached
    _lru: OrderedDict[int, None] = field(init=False, default_factory=OrderedDict)
    _by_name: dict[bytes, int] = field(init=False, default_factory=dict)
    _name_of: dict[int, bytes] = field(init=False, default_factory=dict)
    _tokens_of: dict[int, tuple[int, ...]] = field(init=False, default_factory=dict)
    _fresh: int = field(init=False, default=1)  # the lowest never-used id
    high_water: int = field(init=False, default=1)  # ids below it have been handed out

    def __post_init__(self) -> None:
        if self.num_blocks < 2 or self.block_size < 1:
            raise ValueError("a block pool needs a block size and at least one usable block")
        self._refs = [0] * self.num_blocks

    # ---- what the scheduler asks -----------------------------------------------------------

    @property
    def usable(self) -> int:
        return self.num_blocks - 1

    @property
    def used(self) -> int:
        """Blocks some running sequence holds."""
        return self.usable - len(self._unnamed) - len(self._lru) - (self.num_blocks - self._fresh)

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    def names(self, tokens: Sequence[int]) -> list[bytes]:
        return prefix_names(tokens, self.block_size, self.namespace)

    def cached_tokens(self, tokens: Sequence[int], names: Sequence[bytes] | None = None) -> int:
        """Leading tokens of a prompt this pool could serve from cache (at least the last
        token is always recomputed, for its logits)."""
        if not self.caching:
            return 0
        names = names if names is not None else self.names(tokens)
        limit = (len(tokens) - 1) // self.block_size
        hits = 0
        for i, name in enumerate(names[:limit]):
            block = self._by_name.get(name)
            start = i * self.block_size
            if block is None or self._tokens_of[block] != tuple(
                tokens[start : start + self.block_size]
            ):
                break
            hits += 1
        return hits * self.block_size

    # ---- what the engine does --------------------------------------------------------------

    def admit(self, key: int, tokens: Sequence[int], reuse: bool = True) -> int:
        """Give `key` a table for `tokens`, reusing cached leading blocks when `reuse`;
        the number of leading tokens whose KV is already in place."""
        if key in self._owners:
            raise KeyError(f"sequence {key} already holds blocks")
        tokens = [int(t) for t in tokens]
        names = self.names(tokens) if self.caching else []
        cached = self.cached_tokens(tokens, names) if reuse else 0
        hits = cached // self.block_size
        if self.caching:
            self.stats.queried_tokens += len(tokens)
            self.stats.hit_tokens += cached
        table = [self._by_name[name] for name in names[:hits]]
        for block in table:
            self._take(block)
        needed = self.blocks_for(len(tokens)) - hits
        if needed > self._free_count():
            for block in table:
                self._release(block)
            raise MemoryError(f"{needed} blocks needed, {self._free_count()} free")
        table += [self._allocate() for _ in range(needed)]
        owner = _Owner(table, tokens, hits, names[hits - 1] if hits else self.namespace)
        self._owners[key] = owner
        return cached

    def fork(self, parent: int, child: int) -> None:
        """`child` shares every block of `parent` (siblings of one prompt)."""
        source = self._owners[parent]
        for block in source.table:
            self._refs[block] += 1
        self._owners[child] = _Owner(
            list(source.table), list(source.tokens), source.named, source.parent
        )

    def append(self, key: int, token: int) -> tuple[int, int] | None:
        """Make room for `token` at the sequence's next position; the `(source, target)`
        block copy to apply first when its last block was shared (copy-on-write)."""
        owner = self._owners[key]
        position = len(owner.tokens)
        owner.tokens.append(int(token))
        if position % self.block_size == 0:
            owner.table.append(self._allocate())
            return None
        last = owner.table[-1]
        if self._refs[last] == 1:
            return None
        target = self._allocate()
        self._refs[last] -= 1
        owner.table[-1] = target
        self.stats.copies += 1
        return last, target

    def commit(self, keys: Sequence[int], written: Sequence[int] | None = None) -> None:
        """Name the blocks of `keys` that are now full: their KV has been written, for every
        token held (or, with `written`, for each key's first `written` positions: a prompt
        prefilled in chunks)."""
        if not self.caching:
            return
        for n, key in enumerate(keys):
            owner = self._owners[key]
            done = len(owner.tokens) if written is None else written[n]
            full = done // self.block_size
            while owner.named < full:
                i = owner.named
                chunk = owner.tokens[i * self.block_size : (i + 1) * self.block_size]
                name = next_name(owner.parent, chunk)
                block = owner.table[i]
                if name not in self._by_name and block not in self._name_of:
                    self._by_name[name] = block
                    self._name_of[block] = name
                    self._tokens_of[block] = tuple(chunk)
                owner.parent, owner.named = name, i + 1

    def free(self, key: int) -> None:
        """Release a finished, cancelled or preempted sequence's blocks, tail first."""
        owner = self._owners.pop(key, None)
        if owner is not None:
            for block in reversed(owner.table):
                self._release(block)

    def table(self, key: int) -> list[int]:
        return self._owners[key].table

    def length(self, key: int) -> int:
        return len(self._owners[key].tokens)

    def slot(self, key: int, position: int) -> int:
        """Where position `position` of `key` lives, as `block * block_size + offset`."""
        block = self._owners[key].table[position // self.block_size]
        return block * self.block_size + position % self.block_size

    # ---- the free lists --------------------------------------------------------------------

    def _free_count(self) -> int:
        return len(self._unnamed) + len(self._lru) + self.num_blocks - self._fresh

    def _allocate(self) -> int:
        if self._unnamed:
            block = self._unnamed.pop()
        elif self._fresh < self.num_blocks:
            block = self._fresh
            self._fresh += 1
            self.high_water = self._fresh
        elif self._lru:
            block, _ = self._lru.popitem(last=False)
            self._forget(block)
            self.stats.evictions += 1
        else:
            raise MemoryError("no free KV cache block: the scheduler admitted too much")
        self._refs[block] = 1
        return block

    def _take(self, block: int) -> None:
        if self._refs[block] == 0:
            del self._lru[block]
        self._refs[block] += 1

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] > 0:
            return
        if block in self._name_of:
            self._lru[block] = None
        else:
            self._unnamed.append(block)

    def _forget(self, block: int) -> None:
        name = self._name_of.pop(block)
        del self._by_name[name]
        del self._tokens_of[block]
