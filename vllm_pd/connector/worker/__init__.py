"""The connector's worker side, in each vLLM worker process: a dispatcher (``worker``), the prefill
sender (``kv_sender``), the decode loader (``kv_loader``, ``load_job``), the release of prefill's KV."""
