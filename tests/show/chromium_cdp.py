"""Drive a headless Chromium over the DevTools protocol, with the standard library only.

The browser test needs real input events (a mouse press and release at a span's place on
the screen, not a script calling ``click()``), the page's live DOM and a screenshot of
the state after the click. Chromium's DevTools protocol gives all three over one
WebSocket. No WebSocket package is in the project's environment, and the protocol needs
very little of one: the opening handshake, masked text frames out, unmasked frames in
(possibly fragmented: a screenshot is megabytes), ping and close. That is this module.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import socket
import struct
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)


class WebSocket:
    """A client WebSocket (RFC 6455) over a plain TCP socket: text messages only."""

    def __init__(self, url: str, timeout: float):
        m = re.match(r"ws://([^/:]+):(\d+)(/.*)", url)
        if m is None:
            raise ValueError(f"not a ws:// URL: {url}")
        host, port, path = m.group(1), int(m.group(2)), m.group(3)
        self.sock = socket.create_connection((host, port), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode("ascii")
        self.sock.sendall(
            (
                f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
                f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                "Sec-WebSocket-Version: 13\r\n\r\n"
            ).encode("ascii")
        )
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise ConnectionError("the browser closed the WebSocket handshake")
            head += chunk
        status, _, rest = head.partition(b"\r\n\r\n")
        if not status.startswith(b"HTTP/1.1 101"):
            raise ConnectionError(f"WebSocket upgrade refused: {status.splitlines()[0]!r}")
        self.buffer = rest

    def send(self, text: str) -> None:
        self._send_frame(0x1, text.encode("utf-8"))

    def _send_frame(self, opcode: int, payload: bytes) -> None:
        n = len(payload)
        if n < 126:
            head = struct.pack("!BB", 0x80 | opcode, 0x80 | n)
        elif n < 1 << 16:
            head = struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, n)
        else:
            head = struct.pack("!BBQ", 0x80 | opcode, 0x80 | 127, n)
        mask = os.urandom(4)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        self.sock.sendall(head + mask + masked)

    def _read(self, n: int) -> bytes:
        while len(self.buffer) < n:
            chunk = self.sock.recv(max(65536, n - len(self.buffer)))
            if not chunk:
                raise ConnectionError("the browser closed the WebSocket")
            self.buffer += chunk
        out, self.buffer = self.buffer[:n], self.buffer[n:]
        return out

    def recv(self) -> str:
        """The next text message, reassembled from its fragments."""
        parts: list[bytes] = []
        while True:
            b0, b1 = self._read(2)
            opcode, n = b0 & 0x0F, b1 & 0x7F
            if n == 126:
                (n,) = struct.unpack("!H", self._read(2))
            elif n == 127:
                (n,) = struct.unpack("!Q", self._read(8))
            mask = self._read(4) if b1 & 0x80 else None
            payload = self._read(n)
            if mask is not None:
                payload = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
            if opcode == 0x9:  # ping
                self._send_frame(0xA, payload)
                continue
            if opcode == 0x8:
                raise ConnectionError("the browser closed the WebSocket")
            if opcode in (0x0, 0x1, 0x2):
                parts.append(payload)
                if b0 & 0x80:
                    return b"".join(parts).decode("utf-8")

    def close(self) -> None:
        try:
            self._send_frame(0x8, b"")
        except OSError:
            pass
        self.sock.close()


class Browser:
    """One headless Chromium with a fresh profile, and a DevTools session on its page.

    Use as a context manager: the browser's process group is ended on exit.
    """

    def __init__(
        self,
        binary: str,
        profile: Path,
        url: str,
        *,
        size: tuple[int, int] = (1400, 1000),
        timeout: float = 90.0,
    ):
        self.timeout = timeout
        self.profile = Path(profile)
        self.log = (self.profile.parent / f"{self.profile.name}.log").open("wb")
        self.proc = subprocess.Popen(
            [
                binary,
                *FLAGS,
                f"--user-data-dir={self.profile}",
                "--remote-debugging-port=0",
                f"--window-size={size[0]},{size[1]}",
                url,
            ],
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=self.log,
            start_new_session=True,  # its own process group, so every child ends with it
        )
        self.ws: WebSocket | None = None
        self.next_id = 0
        try:
            self.ws = WebSocket(self._page_target(self._port()), timeout)
            # the window size includes the browser's frame: pin the viewport itself
            self.call(
                "Emulation.setDeviceMetricsOverride",
                width=size[0], height=size[1], deviceScaleFactor=1, mobile=False,
            )
        except BaseException:
            self.close()
            raise

    def _port(self) -> int:
        """The DevTools port: Chromium writes it to ``DevToolsActivePort`` once it is up."""
        marker = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            lines = marker.read_text().split() if marker.is_file() else []
            if lines and lines[0].isdigit():
                return int(lines[0])
            time.sleep(0.1)
        self.log.flush()
        said = Path(self.log.name).read_text(errors="replace")[-2000:]
        raise RuntimeError(f"chromium did not open its DevTools port; it said:\n{said}")

    def _page_target(self, port: int) -> str:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
                targets = json.loads(r.read())
            pages = [t for t in targets if t.get("type") == "page"]
            if pages:
                return pages[0]["webSocketDebuggerUrl"]
            time.sleep(0.2)
        raise RuntimeError("chromium opened no page")

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """One DevTools command; its result (events that arrive meanwhile are dropped)."""
        assert self.ws is not None
        self.next_id += 1
        ident = self.next_id
        self.ws.send(json.dumps({"id": ident, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") != ident:
                continue
            if "error" in msg:
                raise RuntimeError(f"{method}: {msg['error']}")
            return msg["result"]

    def js(self, expression: str) -> Any:
        """Evaluate ``expression`` in the page; its value (JSON-serialisable)."""
        out = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in out:
            raise RuntimeError(f"{expression}: {out['exceptionDetails']}")
        return out["result"].get("value")

    def wait_loaded(self) -> None:
        deadline = time.monotonic() + self.timeout
        while self.js("document.readyState") != "complete":
            if time.monotonic() > deadline:
                raise TimeoutError("the page did not finish loading")
            time.sleep(0.1)

    def click(self, x: float, y: float) -> None:
        """A real left click: pointer moved there, pressed and released."""
        self.call("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)
        for kind in ("mousePressed", "mouseReleased"):
            self.call(
                "Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1
            )

    def screenshot(self) -> bytes:
        """The viewport as PNG bytes."""
        return base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])

    def close(self) -> None:
        if self.ws is not None:
            self.ws.close()
            self.ws = None
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
