"""KV block store: keys, radix index, adaptive CPU cache, disk tier, master.

Enable it in PDConnector with ``kv_connector_extra_config: {"store": {"cpu_bytes": "4g",
"disk_path": "/var/cache/vllm-pd", "disk_bytes": "100g"}}`` (any kv_role, also
a single colocated ``kv_both`` instance = pure offload). The wiring lives in
vllm_pd/connector/store_bridge.py; it uses these two facades, split along
vLLM's connector processes:

Scheduler side (EngineCore process) - ``StoreScheduler(config, salt, slot_nbytes, world_size=1, endpoint="")``
    ``match(token_ids) -> int``
        leading tokens whose KV is committed here (block multiple; side-effect
        free; pass the prompt minus its last token, vLLM must compute >= 1).
        -> ``get_num_new_matched_tokens``: ``(max(0, match - num_computed), False)``
    ``plan_load(req_id, token_ids, start_token, num_tokens, block_ids) -> (LoadOp | None, missing_block_ids)``
        pins the blocks (for ``config.pin_ttl_s`` at most) and queues the load.
        -> ``update_state_after_alloc`` (start_token = num_computed_tokens,
        block_ids = the request's blocks for that range). ``missing`` are blocks
        that vanished since ``match``: report them as load errors.
    ``plan_save(req_id, token_ids, block_ids) -> SaveOp | None``
        reserves pool slots for the full blocks not stored yet (two-phase put).
        -> ``request_finished`` with ``token_ids = all_token_ids[:num_computed_tokens]``
        and the request's block ids; return ``True`` (delay freeing) when an op was
        queued, until the worker lists the request in ``take_finished()[0]``.
    ``build_plan() -> StorePlan``   -> put into the connector metadata each step.
    ``on_worker_report(StoreReport)`` -> from ``update_connector_output`` (the
        worker's report travels in KVConnectorWorkerMetadata; ``StoreReport.aggregate``
        merges TP ranks; a block commits once all ``world_size`` ranks reported it).
    ``match_with_remote(token_ids, request_id, fetch=None) -> (tokens, RemoteHit | None)``: the local
        prefix, or a longer one another node holds per the proxy's ``store_fetch`` hint
        (``fetch``, transfer_params.StoreFetch: the master is then not asked) or else per
        the master (then pass the hit
        to ``plan_load(..., remote=hit)``: the part beyond the local prefix is fetched
        from that node). ``remote_match`` returns only the hit.
    Every query, ``plan_load`` and ``plan_save`` also take the request's ``extra_keys``
    (block_keys.RequestExtraKeys: LoRA adapter, cache salt, multimodal inputs, as vLLM's prefix cache
    keys them; store_bridge.request_extra_keys makes them from vLLM's Request); a block is served
    only to a request of the scope it was written for.

Worker side (each worker) - ``StoreWorker(config, salt, kv_caches, rank=0, block_dims=None, device=None)``
    ``kv_caches``: one tensor per layer, blocks along ``block_dims[layer]`` (default 0; 1 in
    FlashAttention's ``[2, num_blocks, ...]``), moved as bytes; on CPU or a GPU (``device``,
    a ``KVDevice``; pool_copies.py: copy streams and a pinned bounce, stream waits).
    ``execute(plan)``            -> ``start_load_kv`` (starts loads and saves, returns at once)
    ``wait_layer(layer)``        -> ``wait_for_layer_load`` (on the forward's thread: a stream wait on GPUs)
    ``wait_saves()``             -> ``wait_for_save`` only if blocks are freed right away
    ``take_finished() -> (saved_req_ids, loaded_req_ids)`` -> ``get_finished`` (finished_sending, -)
    ``take_load_errors() -> set[int]`` -> ``get_block_ids_with_load_errors``
    ``report() -> StoreReport``  -> ``build_connector_worker_meta``
    ``serve_peers(bind_host, advertised_host) -> endpoint``: put the pool on the
        transport so other nodes can fetch from it (publish the endpoints of all
        ranks, comma-separated, as the scheduler side's ``endpoint``).
    ``slot_nbytes`` must equal the scheduler side's ``slot_nbytes`` (bytes of one
    block for all layers of one rank: num_layers * block_nbytes).

Config (``kv_connector_extra_config["store"]``): ``StoreConfig.from_dict`` -
cpu_bytes, disk_path, disk_bytes, pin_ttl_s (formerly lease_s, still accepted), disk_io_threads, master,
master_timeout_s, node_id, instance_url (the vLLM instance's URL as the proxy knows it, published to
the master for kv_aware routing), fetch_timeout_s, disk_serve_bytes, host_bounce_bytes (GPU KV only:
pinned rows between the device and the pool); an unknown key or bad value raises ConfigError,
also a setting that cannot work with the KV's device.
Salt: ``KeySalt(model, dtype, kv_layout, block_size, num_layers, tp_size, pp_size, extra)``;
a request's own extra keys: ``RequestExtraKeys(lora, cache_salt, per_block)``.

Modules: keys (blake3 chained keys), radix (index, pins), reuse_cache
(leaf-first LRU, reuse-weighted LRU), adaptive_cache (the CPU tier's policy: the
weighting picked online by keys-only shadows, LRU among them, hash-sampled 1/8), cpu_pool (pool +
slot allocator), pool_copies (KV cache <-> pool on the KV's device), disk_tier, plans
(wire structs), config, scheduler_side (plans loads/saves) with block_placement (what is where)
and request_keys, groups (a model with several KV cache groups: each group's identity, the hit all
groups hold; wired in connector/store_group_bridge.py), worker_side, pool_exchange (node-to-node
fetch) with disk_staging (the holder's disk served to peers), master / master_client / master_command
(``vllm-pd store-master``),
trace (multi-turn trace generator).

Design notes (why, measured in docs/benchmarks/store.md):
- One radix tree, not separate hot and cold trees: the tiers are a field of
  each node (CPU slot / on disk), so a lookup is one binary search whatever
  tier holds a block. Hot/cold separation is the replacement policy's job
  (re-used vs new blocks, measured against LRU); two trees would hold the
  same keys the policy keeps (same hit rate) and only add index work: a
  second lookup for 26-50 % of requests and 1.4-6.3 moves between trees per
  request (benchmarks/store_trees.py).
- Write-through to disk: every block committed to the CPU pool is also written
  to disk asynchronously, so a CPU eviction never has to wait for a write.

Node to node (with ``master`` set): each rank serves its CPU pool (and its
disk tier) on its own TCP transport instance (pool_exchange.py; the endpoint rides in the connector's
handshake and is published to the master). A node whose local prefix is
shorter than what the master says another node holds reserves slots for the
rest, its worker asks that node for a grant of them (``notify``), fetches the slots
layer by layer (one transport ``fetch`` per layer, all queued at once, length
+ checksum per block and layer; the loader copies layer i into vLLM as soon as
layer i landed), releases the grant (the
answer says which slots the holder started to overwrite meanwhile: those and
the ones after them do not count), and reports them as saved: they commit like any put, and vLLM got them
as a store hit in the same step. A stale entry (node gone, block evicted), a
slow peer (``fetch_timeout_s``) or a dead master fall back to the local prefix;
what did not arrive is reported as load errors and recomputed (also when
earlier layers of it were already copied: vLLM discards that step's output
for the request). Blocks the holder keeps only on disk stay advertised: a
grant reads and verifies them into spare pool rows (``disk_serve_bytes``,
owned by the grant until it ends; disk_staging.py) and serves them from
there; with ``disk_serve_bytes`` 0 only CPU-pool blocks are advertised. A
master that stays down is retried with a doubling back-off (up to 60 s): each
failed call stalls the scheduler for ``master_timeout_s``.

Routing (the proxy's kv_aware policy with ``--store-master``, router/routing/store_locations.py):
a node's snapshot also carries its salt and ``instance_url``; the proxy lists the
nodes, computes each salt's keys of a prompt and asks the master how many leading
blocks each node holds, sends prefill where its own store (or prefix cache) holds
the most, skips prefill when decode's store holds every full block, and names in
the prefill leg's ``store_fetch`` the node to fetch a longer prefix from.

Composing with LMCache - not run here: lmcache 0.5.6 on vLLM CPU 0.32 (installed aside
with --no-deps, 2026-11-28) imports and starts, but has no CPU connector for vLLM
("No supported cpu connector found", degraded mode: it stores and loads nothing; see
docs/benchmarks/compat.md), and it requires cupy-cuda13x, nvtx and cufile-python. On a
GPU machine with the regular vllm wheel: vLLM's
MultiConnector takes a list of connectors; loads come from the first one that
reports a hit, saves go to all. ``{"kv_connector": "MultiConnector",
"kv_connector_extra_config": {"connectors": [{"kv_connector": "PDConnector",
...}, {"kv_connector": "LMCacheConnectorV1", ...}]}}`` puts our PD transfer
and store first and LMCache behind it. Keys are not shared: LMCache hashes
256-token chunks with vLLM's hash, we hash vLLM-sized blocks with blake3, so
each store only hits on what it saved itself, and both save a copy.
"""
