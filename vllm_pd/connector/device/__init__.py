"""The KV cache on its device: device streams and events, staging, block copies, the KV geometry and layout."""
