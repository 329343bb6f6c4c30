"""Run a loopback ``ThreadingHTTPServer`` on a daemon thread (shared by the API and metrics)."""

from __future__ import annotations

import threading
from http.server import ThreadingHTTPServer


class ServingThread:
    """Own one HTTP server and the daemon thread that serves it."""

    def __init__(self) -> None:
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def start(self, server: ThreadingHTTPServer, *, name: str,
              poll_interval: float = 0.5) -> int:
        """Serve ``server`` in a daemon thread called ``name``; return its bound port."""
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever,
                                        kwargs={"poll_interval": poll_interval},
                                        name=name, daemon=True)
        self._thread.start()
        return int(server.server_address[1])

    def stop(self) -> None:
        """Stop serving, close the socket and join the thread; idempotent."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
