"""infkv inside vLLM: what the plugin needs of vLLM's paged KV cache on the CPU.

vLLM's CPU attention keeps one tensor per layer, [num_blocks, kv_heads, block_size, 2 * head_dim];
inside each block, where each key and value element lies depends on the kernel variant (`isa`):
the "vec" kernels store each head's keys transposed ([head_dim, block_size]) and then its values
([block_size, head_dim]); AMX (bf16 on CPUs that have it) packs them otherwise. `CpuKVLayout` does
not assume either: it writes a pattern with vLLM's own cache-write op for the layer's dtype,
shape and isa, reads back where every element of one block went, and from then on reads one
request's rows (for scoring) and compacts a request's kept rows to the front of its own blocks in
place through that map, without copying the cache. A variant that does not store the elements as
they are (fp8) is refused instead of corrupted.
"""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def _block_map(dtype: torch.dtype, heads: int, block_size: int, head_dim: int, isa: str):
    """Where vLLM's cache-write op puts key and value element [slot][head][e] of a block, as
    offsets [block_size, heads, head_dim] into the block's heads * 2 * block_size * head_dim
    elements. One pass per base-128 digit of each element's number (digit + 1 is exact in an
    8-bit mantissa); raises when the elements do not land one to one."""
    from vllm import _custom_ops as ops

    n = block_size * heads * head_dim
    number = torch.arange(n).view(block_size, heads, head_dim)
    base, scale, found = 128, 1, []
    while scale < n:
        cache = torch.zeros(1, heads, block_size, 2 * head_dim, dtype=dtype)
        kc, vc = cache.view(1, heads, 2 * block_size, head_dim).chunk(2, dim=2)
        k = (number // scale % base + 1).to(dtype)
        ops.cpu_attn_reshape_and_cache(k, -k, kc, vc, torch.arange(block_size), isa)
        found.append(cache.view(-1).float())
        scale *= base
    maps = []
    for sign in (1, -1):  # keys were written positive, values negative
        at = torch.nonzero(found[0] * sign > 0).view(-1)
        got = sum((f[at] * sign - 1).long() * base**i for i, f in enumerate(found))
        where = torch.full((n,), -1, dtype=torch.long)
        if at.numel() == n and bool((got >= 0).all()) and bool((got < n).all()):
            where[got] = at
        if at.numel() != n or bool((where < 0).any()):
            raise ValueError(f"infkv: vLLM's CPU KV layout for dtype {dtype}, block_size {block_size}, head_dim "
                             f"{head_dim}, isa '{isa}' does not store each {'key' if sign > 0 else 'value'} element "
                             "as it is, once: this kernel variant is not supported")
        maps.append(where.view(block_size, heads, head_dim))
    return tuple(maps)


class CpuKVLayout:
    """One layer's vLLM CPU KV cache tensor [num_blocks, kv_heads, block_size, 2 * head_dim],
    written by the kernel variant `isa` (the layer's `isa`; "vec" by default)."""

    def __init__(self, kv_cache: torch.Tensor, isa: str = "vec"):
        if kv_cache.dim() != 4 or kv_cache.shape[3] % 2:
            raise ValueError(f"infkv: kv_cache.shape = {tuple(kv_cache.shape)}: must be "
                             "[num_blocks, kv_heads, block_size, 2 * head_dim]")
        if not kv_cache.is_contiguous():
            raise ValueError("infkv: kv_cache must be contiguous (vLLM allocates it so)")
        if kv_cache.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"infkv: kv_cache.dtype = {kv_cache.dtype}: infkv reads f32, f16 and bf16 caches")
        self.cache = kv_cache
        self.blocks, self.heads, self.block_size, two_d = kv_cache.shape
        self.head_dim = two_d // 2
        self.isa = isa
        self.flat = kv_cache.view(self.blocks, -1)  # one row per block
        self.key_at, self.value_at = _block_map(kv_cache.dtype, self.heads, self.block_size, self.head_dim, isa)

    def _slots(self, block_ids, index):
        block_ids = torch.as_tensor(block_ids, dtype=torch.long)
        index = torch.as_tensor(index, dtype=torch.long)
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= block_ids.numel() * self.block_size):
            raise ValueError(f"infkv: slot {int(index.max())} lies past the request's {block_ids.numel()} blocks "
                             f"of {self.block_size}")
        return block_ids[index // self.block_size].view(-1, 1, 1), index % self.block_size

    def read(self, block_ids, n: int):
        """Keys and values [n, kv_heads, head_dim] of the request's first n slots (copies)."""
        blk, off = self._slots(block_ids, torch.arange(n))
        return self.flat[blk, self.key_at[off]], self.flat[blk, self.value_at[off]]

    def compact(self, block_ids, keep) -> int:
        """Moves the request's slots `keep` (increasing) to slots 0, 1, ... of its blocks, keys and
        values alike, in place; returns how many blocks of `block_ids` the request still needs."""
        keep = torch.as_tensor(keep, dtype=torch.long)
        if keep.numel() > 1 and not bool((keep[1:] > keep[:-1]).all()):
            raise ValueError("infkv: keep must be strictly increasing slots")
        src_blk, src_off = self._slots(block_ids, keep)
        dst_blk, dst_off = self._slots(block_ids, torch.arange(keep.numel()))
        for at in (self.key_at, self.value_at):
            rows = self.flat[src_blk, at[src_off]]  # gathered first: moves may overlap
            self.flat[dst_blk, at[dst_off]] = rows
        return (keep.numel() + self.block_size - 1) // self.block_size

    @staticmethod
    def check(dtype: torch.dtype, block_size: int, head_dim: int, isa: str) -> None:
        """Writes rows with vLLM's cache-write op into two blocks out of order and reads them back
        through a CpuKVLayout; raises when the layout of (dtype, block_size, head_dim, isa) is not
        one it can read."""
        from vllm import _custom_ops as ops

        heads, n = 2, block_size + 3
        cache = torch.zeros(3, heads, block_size, 2 * head_dim, dtype=dtype)
        kc, vc = cache.view(3, heads, 2 * block_size, head_dim).chunk(2, dim=2)
        k = (torch.arange(n * heads * head_dim, dtype=torch.float32).view(n, heads, head_dim) % 251 + 1).to(dtype)
        v = -k
        blocks = [2, 0]
        slots = torch.tensor([blocks[i // block_size] * block_size + i % block_size for i in range(n)])
        ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa)
        got_k, got_v = CpuKVLayout(cache, isa).read(blocks, n)
        if not (torch.equal(got_k, k) and torch.equal(got_v, v)):
            raise ValueError(f"infkv: vLLM's CPU KV layout for dtype {dtype}, block_size {block_size}, "
                             f"head_dim {head_dim}, isa '{isa}' does not read back as written: this kernel variant "
                             "is not supported")
