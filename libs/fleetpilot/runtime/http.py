"""A minimal HTTP endpoint for ``/metrics`` (Prometheus) and ``/healthz``.

Plain asyncio rather than a web framework: two read-only routes do not justify one.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


class OpsServer:
    """Serves the service's registry and a health document on one port."""

    def __init__(self, registry: CollectorRegistry, health: Callable[[], dict]) -> None:
        self._registry = registry
        self._health = health
        self._server: asyncio.base_events.Server | None = None
        self.port: int | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen; ``port = 0`` picks a free port. Returns the bound port."""
        self._server = await asyncio.start_server(self._handle, host, port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = await asyncio.wait_for(reader.readline(), 5)
            while (await asyncio.wait_for(reader.readline(), 5)) not in (b"\r\n", b"\n", b""):
                pass
            parts = request_line.decode("latin-1").split()
            path = parts[1] if len(parts) > 1 else "/"
            if path.startswith("/metrics"):
                status, ctype, body = 200, CONTENT_TYPE_LATEST, generate_latest(self._registry)
            elif path.startswith("/healthz"):
                doc = self._health()
                status = 200 if doc.get("ok") else 503
                ctype, body = "application/json", json.dumps(doc).encode()
            else:
                status, ctype, body = 404, "text/plain", b"not found\n"
            reason = {200: "OK", 404: "Not Found", 503: "Service Unavailable"}[status]
            writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\n"
                         f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        """Stop listening."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
