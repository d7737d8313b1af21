"""The browser's only way out: a filtering HTTP proxy on 127.0.0.1 that forwards requests to allowed origins only.

Playwright's route filter sees the first URL of a navigation but not the hops of a redirect, so a page on an
allowed site that answers ``302 Location: http://127.0.0.1:<another port>/`` would take the browser anywhere.
Every browser context of the WebArena backend is therefore opened with this proxy (loopback included, Chromium's
``<-loopback>`` bypass rule), and the browser makes each hop of a redirect through it: each request is checked
against ``allowed(url)`` before a byte reaches its host.

One request per client connection: the request line and headers are read (at most 64 KiB), the URL checked,
the request sent on with ``Connection: close`` and exactly its ``Content-Length`` body, and the answer streamed
back until the host closes. ``CONNECT host:port`` (https) is tunnelled only to an allowed https origin. Anything
else gets ``403`` with the reason, so the page shows what the sandbox refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

MAX_HEAD = 64 * 1024
REFUSED = "blocked by the WebArena sandbox: {what} is not one of this environment's sites"


class EgressProxy:
    """``with EgressProxy(allowed) as proxy: ... proxy.url``: the proxy runs on its own thread's event loop."""

    def __init__(self, allowed: Callable[[str], bool]) -> None:
        self.allowed = allowed
        self.refused: list[str] = []  # what it refused, newest last (bounded)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self._run, name="webarena-egress", daemon=True)
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> EgressProxy:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the WebArena egress proxy did not start")

    def stop(self) -> None:
        if self._server is not None:
            self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    def _refuse(self, what: str) -> bytes:
        self.refused = [*self.refused[-99:], what]
        log.warning("WebArena sandbox refused %s", what)
        body = REFUSED.format(what=what).encode()
        return (b"HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain; charset=utf-8\r\nConnection: close\r\n"
                b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._one(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as err:
            log.debug("egress proxy connection ended: %s", err)
        finally:
            with contextlib.suppress(Exception):
                writer.close()
                await writer.wait_closed()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if len(head) > MAX_HEAD:
            raise ValueError("request head too large")
        lines = head.decode("latin-1").split("\r\n")
        method, target, version = lines[0].split(" ", 2)
        if method.upper() == "CONNECT":
            host, _, port = target.rpartition(":")
            origin = f"https://{host}" + ("" if port == "443" else f":{port}")
            if not self.allowed(origin + "/"):
                writer.write(self._refuse(origin))
                return
            up_reader, up_writer = await asyncio.open_connection(host.strip("[]"), int(port))
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await writer.drain()
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
            return
        url = urlsplit(target)
        if url.scheme != "http" or not url.hostname or not self.allowed(target):
            writer.write(self._refuse(target[:300]))
            return
        headers, length = [], 0
        for line in lines[1:]:
            if not line:
                continue
            name = line.split(":", 1)[0].strip().lower()
            if name in ("proxy-connection", "connection", "keep-alive", "proxy-authorization"):
                continue
            if name == "transfer-encoding":
                writer.write(b"HTTP/1.1 411 Length Required\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
                return
            if name == "content-length":
                length = int(line.split(":", 1)[1])
            headers.append(line)
        path = url.path or "/"
        path += f"?{url.query}" if url.query else ""
        up_reader, up_writer = await asyncio.open_connection(url.hostname, url.port or 80)
        up_writer.write(f"{method} {path} {version}\r\n".encode("latin-1") +
                        "".join(f"{h}\r\n" for h in headers).encode("latin-1") + b"Connection: close\r\n\r\n")
        if length:  # exactly this request's body: nothing after it is forwarded unchecked
            up_writer.write(await reader.readexactly(length))
        await up_writer.drain()
        await _pipe(up_reader, writer)
        up_writer.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()
