"""infkv inside vLLM's CPU engine (V1 model runner): bounded KV per request.

Installed with `worker_cls="infkv.vllm.engine.InfkvCPUWorker"` and
`scheduler_cls="infkv.vllm.engine.InfkvScheduler"` (`--worker-cls` / `--scheduler-cls` for
`vllm serve`) and the engine in one process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`: the worker hands
the blocks it frees to the scheduler directly). A request opts in with `extra_args` (`vllm_xargs`
in the OpenAI body; settings.py); the others run as in plain vLLM.

Prefix caching: an evicting request shares no block with any other. The scheduler gives it a
cache salt of its own when it arrives (its block hashes are recomputed with it), so it never
reads a cached prefix (a block another request holds is never written) and no other request can
ever match its blocks; after each eviction the blocks it rewrote or freed also leave the prefix
cache's table. Requests that do not evict share prefixes as in plain vLLM.

What happens to an evicting request r:
- vLLM keeps counting its tokens logically: positions, `num_computed_tokens` and the scheduler's
  block count are plain vLLM's. infkv holds `evicted[r]` tokens fewer: its kept tokens are the
  compact slots 0 .. n - 1 of the blocks it still holds (`req_state.block_ids`, in order).
- Every step, after vLLM prepares its inputs, the request's block-table row lists only those
  blocks, its new tokens' slot mapping points after its kept ones, and its sequence length is
  kept + scheduled: vLLM's own attention kernel then attends over exactly the kept tokens and the
  new ones (keys are cached after RoPE at their true positions: nothing is re-rotated).
- After a prefill chunk that leaves more than its budget, or a step that leaves budget + block
  slots, infkv decides what to keep (so it holds at most budget + one chunk; one decision
  per token over every layer, on keys read out of vLLM's cache and, for the policies that read
  them, the last window queries captured in attention), compacts every layer in place
  (CpuKVLayout), keeps one spare block beyond its kept slots and frees the rest: the scheduler
  puts the null block in their place in the request's list and returns them to vLLM's pool.
"""
from __future__ import annotations

import json
import math
import os
import threading
import uuid
from dataclasses import dataclass, field

import numpy as np
import torch

import infkv
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl
from vllm.logger import init_logger
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.sample.logits_processor import LogitsProcessor
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from . import CpuKVLayout
from .settings import QUERY_POLICIES, Settings, parse

logger = init_logger(__name__)


class _Channel:
    """What the worker tells the scheduler (one process), and the per-request stats it keeps."""

    def __init__(self):
        self.lock = threading.Lock()
        self.freed: list[tuple[str, list[int], list[int]]] = []  # (request, blocks rewritten, blocks freed)
        self.scheduler = False  # an InfkvScheduler exists in this process
        self.capture: dict[str, int] = {}  # layer name -> window rows to capture (0: off)
        self.captured: dict[str, tuple[torch.Tensor, list]] = {}  # layer -> (last rows per request, offsets)
        self.stats: dict[str, dict] = {}  # request id -> {"kept", "evicted", "evictions", "peak", ...}
        self.engine: dict = {}  # the scheduler's last step: running, waiting, blocks used and in all
        self.peak_running = 0  # the most requests running at once
        self.peak_blocks = 0  # the most KV blocks in use at once
        self.preemptions = 0  # requests vLLM preempted (freed, to be recomputed) for want of blocks
        self.stats_file = os.environ.get("INFKV_VLLM_STATS")  # also written there (JSON), for other processes
        self._rows_key, self._rows = None, None  # window_rows' last answer

    def record(self, rid: str, stats: dict) -> None:
        """The latest stats of request `rid` (the last 4096 requests are kept)."""
        self.stats.pop(rid, None)
        self.stats[rid] = stats
        while len(self.stats) > 4096:
            self.stats.pop(next(iter(self.stats)))

    def window_rows(self, query_start_loc: torch.Tensor, w: int):
        """Each request's last w query rows of the step (an index) and where each request's start
        (offsets); the same for every layer of a step, so computed once."""
        key = (tuple(query_start_loc.tolist()), w)
        if self._rows_key != key:
            loc = key[0]
            rows = [range(max(a, b - w), b) for a, b in zip(loc[:-1], loc[1:])]
            offsets = [0]
            for r in rows:
                offsets.append(offsets[-1] + len(r))
            self._rows = (torch.tensor([i for r in rows for i in r], dtype=torch.long), offsets)
            self._rows_key = key
        return self._rows

    def publish(self) -> None:
        """Writes the stats to INFKV_VLLM_STATS, when set (once per step)."""
        if self.stats_file:
            tmp = self.stats_file + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.stats, f)
            os.replace(tmp, self.stats_file)


channel = _Channel()


class InfkvCPUAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention, and a copy of the last window queries of each request when infkv's
    runner asks for them (post-RoPE, as the kernel gets them)."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        name = getattr(layer, "layer_name", None)
        w = channel.capture.get(name, 0)
        if attn_metadata is not None and w > 0:
            index, offsets = channel.window_rows(attn_metadata.query_start_loc, w)
            channel.captured[name] = (query.index_select(0, index).detach().float(), offsets)
        return out


class InfkvCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return InfkvCPUAttentionImpl


@dataclass
class _Request:
    settings: Settings
    policy: object
    n: int = 0  # kept slots (compact, in the blocks held)
    evicted: int = 0  # tokens evicted so far (logical length = n + evicted)
    positions: list = field(default_factory=list)  # logical position of each kept slot
    queries: dict = field(default_factory=dict)  # layer -> (rows [w, hq, d], positions [w])
    evictions: int = 0
    peak: int = 0


class InfkvCPUModelRunner(CPUModelRunner):
    def __init__(self, vllm_config, device):
        super().__init__(vllm_config, device)
        self._infkv: dict[str, _Request] = {}

    # --- vLLM's steps, adjusted for evicting requests ---

    def _update_states(self, so):
        for rid in so.finished_req_ids:
            self._infkv.pop(rid, None)
        for rid in so.scheduled_cached_reqs.resumed_req_ids:  # recomputed from scratch by vLLM
            self._infkv.pop(rid, None)
        for new in so.scheduled_new_reqs:
            self._infkv.pop(new.req_id, None)
            try:
                s = parse(new.sampling_params.extra_args if new.sampling_params else None)
            except ValueError as e:  # InfkvSettings refuses these at admission; without it the request runs plain
                logger.error("%s (request %s runs without eviction: add --logits-processors "
                             "infkv.vllm.engine:InfkvSettings to refuse it)", e, new.req_id)
                continue
            if s.evicts:
                if len(new.block_ids) != 1:
                    raise ValueError(f"infkv: the model has {len(new.block_ids)} KV cache groups; "
                                     "infkv's vLLM plugin handles models with one")
                self._infkv[new.req_id] = _Request(s, s.make_policy())
        out = super()._update_states(so)
        for rid, st in self._infkv.items():
            index = self.input_batch.req_id_to_index.get(rid)
            if st.evicted and index is not None:  # the row lists only the blocks the request holds
                self.input_batch.block_table.add_row(self.requests[rid].block_ids, index)
        self._set_capture()
        return out

    def _prepare_inputs(self, so, num_scheduled_tokens):
        out = super()._prepare_inputs(so, num_scheduled_tokens)
        table = self.input_batch.block_table[0]
        size = table.block_size
        starts = self.query_start_loc.np
        for row, rid in enumerate(self.input_batch.req_ids[: self.input_batch.num_reqs]):
            st = self._infkv.get(rid)
            if st is None or st.evicted == 0:
                continue
            a, b = int(starts[row]), int(starts[row + 1])
            compact = self.positions[a:b].numpy() - st.evicted  # where the new tokens go
            blocks = np.asarray(self.requests[rid].block_ids[0], dtype=np.int64)
            table.slot_mapping.np[a:b] = blocks[compact // size] * size + compact % size
            self.seq_lens[row] -= st.evicted
            self.optimistic_seq_lens_cpu[row] -= st.evicted
        return out

    def execute_model(self, so, intermediate_tensors=None):
        out = super().execute_model(so, intermediate_tensors)
        if self._infkv:
            self._after_step(so)
        return out

    # --- infkv's part ---

    def _layers(self):
        """(name, KV cache tensor, the kernel variant that writes it) of every attention layer."""
        names = self.kv_cache_config.kv_cache_groups[0].layer_names
        ctx = self.compilation_config.static_forward_context
        for name in names:
            if not hasattr(ctx[name], "isa"):
                raise RuntimeError(f"infkv: layer {name} has no `isa`: vLLM's CPU attention backend sets it; "
                                   "infkv's plugin runs with that backend only")
        return [(name, ctx[name].kv_cache, ctx[name].isa) for name in names]

    def _set_capture(self):
        window = max((st.settings.window for st in self._infkv.values() if st.settings.policy in QUERY_POLICIES),
                     default=0)
        for name in self.kv_cache_config.kv_cache_groups[0].layer_names:
            channel.capture[name] = window
        channel.captured.clear()

    def _after_step(self, so):
        due = []
        for row, rid in enumerate(self.input_batch.req_ids[: self.input_batch.num_reqs]):
            st = self._infkv.get(rid)
            scheduled = so.num_scheduled_tokens.get(rid, 0)
            if st is None or scheduled == 0:
                continue
            first = self.requests[rid].num_computed_tokens  # the step's first logical position
            st.positions.extend(range(first, first + scheduled))
            st.n += scheduled
            st.peak = max(st.peak, st.n)
            if st.settings.policy in QUERY_POLICIES:
                self._keep_queries(st, row, first, scheduled)
            if st.n >= st.settings.budget + st.settings.block or (scheduled > 1 and st.n > st.settings.budget):
                due.append(rid)  # at most budget + block slots in decode, budget + one chunk in prefill
            self._stats(rid, st)
        if due:
            if not channel.scheduler:
                raise RuntimeError("infkv: no InfkvScheduler in the worker's process: run vLLM with "
                                   "scheduler_cls='infkv.vllm.engine.InfkvScheduler' and "
                                   "VLLM_ENABLE_V1_MULTIPROCESSING=0, or evicted blocks never return to the pool")
            self._evict(due)
        channel.publish()

    def _keep_queries(self, st, row, first, scheduled):
        w = st.settings.window
        for name, (q, offsets) in channel.captured.items():
            rows = q[offsets[row]:offsets[row + 1]][-w:]
            pos = torch.arange(first + scheduled - rows.shape[0], first + scheduled)
            old = st.queries.get(name)
            if old is not None:
                rows, pos = torch.cat([old[0], rows])[-w:], torch.cat([old[1], pos])[-w:]
            st.queries[name] = (rows, pos)

    def _evict(self, due):
        """One batch plan per policy over the due requests (each its own budget): one decision per
        token over every layer; then every layer compacted in each request's own blocks."""
        layers = self._layers()
        views = [CpuKVLayout(kv, isa) for _, kv, isa in layers]
        groups: dict[tuple, list[str]] = {}
        for rid in due:
            s = self._infkv[rid].settings
            groups.setdefault((s.policy, s.window), []).append(rid)
        for rids in groups.values():
            reqs = [self._infkv[rid] for rid in rids]
            blocks = [list(self.requests[rid].block_ids[0]) for rid in rids]
            reads = reqs[0].settings.policy in QUERY_POLICIES
            tokens = infkv.tokens(np.concatenate([np.asarray(st.positions, dtype=np.int64) for st in reqs]))
            batch = []
            for (name, _, _), view in zip(layers, views):
                keys = [view.read(b, st.n)[0].float().numpy() for b, st in zip(blocks, reqs)]
                args = {"keys": keys}
                if reads:
                    args.update(queries=torch.cat([st.queries[name][0] for st in reqs]).numpy(),
                                query_pos=torch.cat([st.queries[name][1] for st in reqs]).numpy().astype(np.int64))
                batch.append(infkv.BatchLayer(tokens, **args))
            shape = keys[0].shape
            plan = infkv.make_batch_plan(
                reqs[0].policy, [st.settings.budget_value() for st in reqs],
                slot_indptr=np.concatenate([[0], np.cumsum([st.n for st in reqs])]).astype(np.int64),
                query_indptr=np.concatenate([[0], np.cumsum([st.queries[layers[0][0]][0].shape[0] for st in reqs])]
                                            ).astype(np.int64) if reads else None,
                kv_heads=shape[1], q_heads=reqs[0].queries[layers[0][0]][0].shape[1] if reads else 0,
                head_dim=shape[2],
                options=infkv.plan_options(granularity=infkv.granularity.per_token, n_layers=len(batch)))
            for rid, st, b, keep in zip(rids, reqs, blocks, infkv.run_batch(plan, batch)):
                self._apply(rid, st, b, keep.unit(0), views)

    def _apply(self, rid, st, blocks, keep, views):
        """Compacts every layer of request `rid` to its kept slots `keep`; frees the blocks it no
        longer needs but one spare (see the module's note)."""
        for view in views:
            view.compact(blocks, keep)
        m = len(keep)
        held = min(len(blocks), math.ceil(m / views[0].block_size) + 1)
        freed = blocks[held:]  # and blocks[:held] rewritten: every block leaves the prefix cache's table
        st.evicted += st.n - m
        st.n = m
        st.positions = [st.positions[i] for i in keep]
        st.evictions += 1
        self.requests[rid].block_ids[0][:] = blocks[:held]
        index = self.input_batch.req_id_to_index.get(rid)
        if index is not None:
            self.input_batch.block_table.add_row(self.requests[rid].block_ids, index)
        with channel.lock:
            channel.freed.append((rid, blocks[:held], freed))
        self._stats(rid, st)

    def _stats(self, rid, st):
        channel.record(rid, {"kept": st.n, "evicted": st.evicted, "evictions": st.evictions, "peak": st.peak,
                             "held_blocks": len(self.requests[rid].block_ids[0]),
                             "budget": st.settings.budget, "block": st.settings.block})


class InfkvSettings(LogitsProcessor):
    """Checks each request's infkv settings when vLLM admits it (`--logits-processors
    infkv.vllm.engine:InfkvSettings`): a bad one is refused with the field named (an HTTP 400 from
    the OpenAI server) instead of reaching the engine. It changes no logits."""

    @classmethod
    def validate_params(cls, sampling_params):
        parse(sampling_params.extra_args)

    def __init__(self, vllm_config, device, is_pin_memory):
        pass

    def apply(self, logits):
        return logits

    def is_argmax_invariant(self):
        return True

    def update_state(self, batch_update):
        pass


class InfkvCPUWorker(CPUWorker):
    """vLLM's CPU worker with infkv's model runner."""

    def init_device(self):
        import vllm.v1.worker.cpu_worker as cpu_worker

        plain = cpu_worker.CPUModelRunner
        cpu_worker.CPUModelRunner = InfkvCPUModelRunner  # the runner this call constructs
        try:
            super().init_device()
        finally:
            cpu_worker.CPUModelRunner = plain


class InfkvScheduler(Scheduler):
    """vLLM's scheduler, which first takes back the blocks infkv's runner freed: the null block
    goes in their place in the request's list, and they return to the pool."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        channel.scheduler = True

    def add_request(self, request):
        """An evicting request gets a cache salt of its own (see the module's note): its block
        hashes are recomputed with it before anything looks them up."""
        try:
            evicts = parse(request.sampling_params.extra_args if request.sampling_params else None).evicts
        except ValueError:  # refused at admission (InfkvSettings), or run plain by the runner
            evicts = False
        if evicts and self.cache_config.enable_prefix_caching:
            request.cache_salt = f"{request.cache_salt or ''}infkv:{request.request_id}:{uuid.uuid4().hex}"
            request.block_hashes.clear()
            request.update_block_hashes()
        super().add_request(request)

    def schedule(self, *args, **kwargs):
        with channel.lock:
            freed, channel.freed = channel.freed, []
        if freed:
            manager = self.kv_cache_manager.coordinator.single_type_managers[0]
            pool = self.kv_cache_manager.block_pool
            for rid, rewritten, ids in freed:
                pool.evict_blocks(set(rewritten) | set(ids))  # out of the prefix cache's table
                blocks = manager.req_to_blocks.get(rid)
                if blocks is None:  # finished meanwhile: vLLM freed every block already
                    continue
                wanted, out = set(ids), []
                for i, block in enumerate(blocks):
                    if block.block_id in wanted:
                        out.append(block)
                        blocks[i] = pool.null_block
                pool.free_blocks(out)
        output = super().schedule(*args, **kwargs)
        pool = self.kv_cache_manager.block_pool
        channel.engine = {"running": len(self.running), "waiting": len(self.waiting),
                          "blocks_used": pool.num_gpu_blocks - 1 - pool.get_num_free_blocks(),
                          "blocks": pool.num_gpu_blocks - 1}
        channel.preemptions += len(output.preempted_req_ids or ())
        channel.peak_running = max(channel.peak_running, len(self.running))
        channel.peak_blocks = max(channel.peak_blocks, channel.engine["blocks_used"])
        return output
