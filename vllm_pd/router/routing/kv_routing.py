"""Everything kv_aware routing needs, built once per proxy: tokenizer, block hasher, index, feed.

Tokenizing and hashing a prompt costs ~0.5 ms per 1K tokens here, 18 ms at
33K (docs/benchmarks/routing.md), so it runs on one worker
thread (HF tokenizers release the GIL) rather than on the event loop, with the
hashes for every block size the index knows computed there too, and, with a
store master (``store_master``), the master asked there which store holds how
much of the prompt (store_locations.py; bounded by its timeout). Hashes and
store keys carry the request's extra keys (LoRA adapter, cache salt:
kv_extra_keys.py), named on the event loop from the body and the instances'
model cards; a request whose extra keys the proxy cannot name gets no blocks
and is routed by load.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from vllm_pd.protocol.block_keys import RequestExtraKeys
from vllm_pd.router.config import ProxyConfig
from vllm_pd.router.pool.instance_pool import InstancePool
from vllm_pd.router.request.block_hashes import PromptBlocks, VllmBlockHasher
from vllm_pd.router.request.prompt_tokens import PromptTokenizer
from vllm_pd.router.request.request_body import ParsedRequest
from vllm_pd.router.routing.kv_events_feed import KvEventsFeed
from vllm_pd.router.routing.kv_extra_keys import ServedModels, request_extra_keys
from vllm_pd.router.routing.kv_locations import KvLocations
from vllm_pd.router.routing.store_locations import StoreLocations


class KvRouting:
    def __init__(self, config: ProxyConfig, pool: InstancePool) -> None:
        assert config.tokenizer, "validated by ProxyConfig"
        self.pool = pool  # read on the event loop only (the instances' model cards)
        hasher = VllmBlockHasher(config.kv_hash_algo)
        self.tokenizer = PromptTokenizer(config.tokenizer, hasher)
        self.locations = KvLocations(hasher)
        self.feed = KvEventsFeed(self.locations)
        for ic in config.instances:
            if ic.kv_events:
                self.feed.add(ic.url, ic.kv_events)
        # one thread: the master's socket is used from it alone
        self.store = StoreLocations(config.store_master, secret=config.secret) if config.store_master else None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="tokenize")

    def start(self) -> None:
        self.feed.start()

    def stop(self) -> None:
        self.feed.stop()
        # with a store master, wait for the running call (<= its timeout): its socket is closed next
        self._executor.shutdown(wait=self.store is not None, cancel_futures=True)
        if self.store is not None:
            self.store.close()

    async def annotate(self, req: ParsedRequest) -> None:
        """Fill ``req.blocks`` (None where the prompt cannot be reproduced exactly) and, with a store
        master, ``req.store`` (None also when the master does not answer)."""
        extra_keys = request_extra_keys(req, ServedModels.of(self.pool.all()))
        if extra_keys is None:
            return  # the proxy cannot name what vLLM keys this request's KV on: no hit is claimed
        req.blocks = await asyncio.get_running_loop().run_in_executor(self._executor, self._blocks, req, extra_keys)
        if req.blocks is not None:
            req.prompt_tokens = len(req.blocks.token_ids)  # exact, template included: loads count it

    def _blocks(self, req: ParsedRequest, extra_keys: RequestExtraKeys) -> PromptBlocks | None:
        blocks = self.tokenizer.blocks(req, extra_keys)
        if blocks is not None:
            sizes = {self.locations.block_size(url) for url in self.locations.instances()}
            for size in sizes:  # hashed off the event loop, for each block size an instance announced
                if size is not None:
                    blocks.hashes(size)
            if self.store is not None:
                req.store = self.store.locate(blocks.token_ids, extra_keys)
        return blocks
