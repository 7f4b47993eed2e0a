"""Subscribes to each instance's vLLM KV-event publisher and feeds a KvLocations index.

One daemon thread owns every ZMQ SUB socket (zmq sockets are not thread-safe)
and polls them together; instances are added or dropped from any thread and
picked up on the next poll. Nothing here blocks the proxy's event loop.
"""

from __future__ import annotations

import logging
import threading

import zmq

from vllm_pd.router.routing.kv_locations import KvLocations

logger = logging.getLogger(__name__)

POLL_MS = 200


class KvEventsFeed:
    def __init__(self, locations: KvLocations, topic: str = "") -> None:
        self.locations = locations
        self._topic = topic.encode()
        self._ctx: zmq.Context = zmq.Context.instance()
        self._wanted: dict[str, str] = {}  # instance url -> publisher endpoint
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, instance: str, endpoint: str) -> None:
        with self._lock:
            self._wanted[instance] = endpoint

    def remove(self, instance: str) -> None:
        with self._lock:
            self._wanted.pop(instance, None)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        sockets: dict[str, tuple[str, zmq.Socket]] = {}
        poller = zmq.Poller()
        try:
            while not self._stop.is_set():
                self._sync(sockets, poller)
                for sock, _ in poller.poll(POLL_MS):
                    url = next(u for u, (_, s) in sockets.items() if s is sock)
                    self._drain(url, sock)
        finally:
            for _, sock in sockets.values():
                sock.close(linger=0)

    def _sync(self, sockets: dict[str, tuple[str, zmq.Socket]], poller: zmq.Poller) -> None:
        with self._lock:
            wanted = dict(self._wanted)
        for url in [u for u, (ep, _) in sockets.items() if wanted.get(u) != ep]:
            _, sock = sockets.pop(url)
            poller.unregister(sock)
            sock.close(linger=0)
            self.locations.forget(url)
        for url, endpoint in wanted.items():
            if url not in sockets:
                sock = self._ctx.socket(zmq.SUB)
                sock.setsockopt(zmq.SUBSCRIBE, self._topic)
                sock.connect(endpoint)
                poller.register(sock, zmq.POLLIN)
                sockets[url] = (endpoint, sock)
                logger.info("KV events of %s: subscribed to %s", url, endpoint)

    def _drain(self, url: str, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3:
                logger.warning("KV events from %s: %d frames, expected 3; dropped", url, len(frames))
                continue
            _topic, seq, payload = frames
            self.locations.apply_message(url, int.from_bytes(seq, "big"), payload)
