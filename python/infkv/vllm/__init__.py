"""infkv inside vLLM (work in progress): what the plugin needs of vLLM's paged KV cache on the CPU.

vLLM's CPU attention keeps one tensor per layer, [num_blocks, kv_heads, block_size, 2 * head_dim].
Inside each (block, head) the first block_size * head_dim elements are the keys stored transposed
([head_dim, block_size]) and the next block_size * head_dim the values ([block_size, head_dim]),
for the "vec" kernels (f32, f16, bf16 without AMX). `CpuKVLayout` views them without copying,
reads one request's rows (for scoring) and compacts a request's kept rows to the front of its own
blocks in place; `CpuKVLayout.check` writes a pattern with vLLM's own cache-write op and reads it
back, so a layout that differs (AMX, fp8) is refused instead of corrupted.
"""
from __future__ import annotations

import torch


class CpuKVLayout:
    """Views of one layer's vLLM CPU KV cache tensor [num_blocks, kv_heads, block_size, 2 * head_dim]."""

    def __init__(self, kv_cache: torch.Tensor):
        if kv_cache.dim() != 4 or kv_cache.shape[3] % 2:
            raise ValueError(f"infkv: kv_cache.shape = {tuple(kv_cache.shape)}: must be "
                             "[num_blocks, kv_heads, block_size, 2 * head_dim]")
        if not kv_cache.is_contiguous():
            raise ValueError("infkv: kv_cache must be contiguous (vLLM allocates it so)")
        self.cache = kv_cache
        self.blocks, self.heads, self.block_size, two_d = kv_cache.shape
        self.head_dim = two_d // 2
        b, d = self.block_size, self.head_dim
        flat = kv_cache.view(self.blocks, self.heads, 2 * b * d)
        # [blocks, heads, head_dim, block_size] -> [blocks, block_size, heads, head_dim]: slot-major views
        self.keys = flat[:, :, : b * d].view(self.blocks, self.heads, d, b).permute(0, 3, 1, 2)
        self.values = flat[:, :, b * d:].view(self.blocks, self.heads, b, d).permute(0, 2, 1, 3)

    def _slots(self, block_ids, index):
        block_ids = torch.as_tensor(block_ids, dtype=torch.long)
        index = torch.as_tensor(index, dtype=torch.long)
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= block_ids.numel() * self.block_size):
            raise ValueError(f"infkv: slot {int(index.max())} lies past the request's {block_ids.numel()} blocks "
                             f"of {self.block_size}")
        return block_ids[index // self.block_size], index % self.block_size

    def read(self, block_ids, n: int):
        """Keys and values [n, kv_heads, head_dim] of the request's first n slots (copies)."""
        blk, off = self._slots(block_ids, torch.arange(n))
        return self.keys[blk, off], self.values[blk, off]

    def compact(self, block_ids, keep) -> int:
        """Moves the request's slots `keep` (increasing) to slots 0, 1, ... of its blocks, keys and
        values alike, in place; returns how many blocks of `block_ids` the request still needs."""
        keep = torch.as_tensor(keep, dtype=torch.long)
        if keep.numel() > 1 and not bool((keep[1:] > keep[:-1]).all()):
            raise ValueError("infkv: keep must be strictly increasing slots")
        src_blk, src_off = self._slots(block_ids, keep)
        dst_blk, dst_off = self._slots(block_ids, torch.arange(keep.numel()))
        k, v = self.keys[src_blk, src_off], self.values[src_blk, src_off]  # gathered first: moves may overlap
        self.keys[dst_blk, dst_off] = k
        self.values[dst_blk, dst_off] = v
        return (keep.numel() + self.block_size - 1) // self.block_size

    @staticmethod
    def check(dtype: torch.dtype, block_size: int, head_dim: int, isa: str) -> None:
        """Writes a pattern with vLLM's cache-write op and reads it back through these views;
        raises when the layout of (dtype, block_size, head_dim, isa) is another."""
        from vllm import _custom_ops as ops

        heads, n = 2, block_size + 3
        cache = torch.zeros(3, heads, block_size, 2 * head_dim, dtype=dtype)
        kc, vc = cache.view(3, heads, 2 * block_size, head_dim).chunk(2, dim=2)
        k = torch.arange(n * heads * head_dim, dtype=torch.float32).view(n, heads, head_dim).to(dtype)
        v = -k
        blocks = [2, 0]
        slots = torch.tensor([blocks[i // block_size] * block_size + i % block_size for i in range(n)])
        ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa)
        got_k, got_v = CpuKVLayout(cache).read(blocks, n)
        if not (torch.equal(got_k, k) and torch.equal(got_v, v)):
            raise ValueError(f"infkv: vLLM's CPU KV layout for dtype {dtype}, block_size {block_size}, "
                             f"head_dim {head_dim}, isa '{isa}' is not the one infkv reads (keys transposed per "
                             "block and head, then values): this kernel variant is not supported")
