"""Headless Chromium driven over the DevTools protocol, for tests that must see a page as a browser does.

``with Browser() as b: b.open(url); b.eval("document.title"); b.errors()``. The protocol runs over a
WebSocket; this module speaks the few frames it needs with the standard library (no client package), and
collects every console message and uncaught exception the page raises (``Runtime.consoleAPICalled``,
``Runtime.exceptionThrown``, ``Log.entryAdded``), so a test can assert that a page loaded without errors.
Tests skip when ``chromium`` is not installed (``.ci/run`` installs it).
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import struct
import subprocess
import tempfile
import time
import urllib.request

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Socket:
    """A WebSocket client for one DevTools target: text frames out (masked), text frames in."""

    def __init__(self, url: str, timeout: float):
        host, path = url[len("ws://"):].split("/", 1)
        name, port = host.rsplit(":", 1)
        self.sock = socket.create_connection((name, int(port)), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET /{path} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                           f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += self.sock.recv(4096)
        if b" 101 " not in head.split(b"\r\n")[0]:
            raise ConnectionError(f"DevTools refused the WebSocket: {head[:200]!r}")
        self.buf = head.split(b"\r\n\r\n", 1)[1]

    def _exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise EOFError("DevTools closed the connection")
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def recv(self) -> dict:
        msg = b""
        while True:
            b0, b1 = self._exact(2)
            n = b1 & 0x7F
            if n == 126:
                n = struct.unpack(">H", self._exact(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self._exact(8))[0]
            msg += self._exact(n)
            if b0 & 0x80:                       # FIN: the message is complete
                return json.loads(msg)

    def send(self, obj: dict):
        data = json.dumps(obj).encode()
        n = len(data)
        head = bytes([0x81]) + (bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + struct.pack(">H", n)
                                if n < 65536 else bytes([0x80 | 127]) + struct.pack(">Q", n))
        mask = os.urandom(4)
        self.sock.sendall(head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data)))


class Browser:
    """One headless Chromium with one page (see the module docstring)."""

    def __init__(self, timeout: float = 60):
        self.timeout = timeout
        self.events: list = []
        self._id = 0

    def __enter__(self):
        self.profile = tempfile.mkdtemp(prefix="autofuse-chromium-")
        port = free_port()
        self.proc = subprocess.Popen([CHROMIUM, *FLAGS, f"--user-data-dir={self.profile}",
                                      f"--remote-debugging-port={port}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json", timeout=2))
                page = next(t for t in targets if t["type"] == "page")
                break
            except (OSError, StopIteration, ValueError):
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.__exit__(None, None, None)
                    raise RuntimeError("chromium did not open its DevTools port")
                time.sleep(0.1)
        self.ws = _Socket(page["webSocketDebuggerUrl"], self.timeout)
        for domain in ("Runtime", "Page", "Log"):
            self.call(f"{domain}.enable")
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.profile, ignore_errors=True)

    def call(self, method: str, **params) -> dict:
        self._id += 1
        self.ws.send({"id": self._id, "method": method, "params": params})
        while True:
            msg = self.ws.recv()
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"DevTools {method}: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg)

    def eval(self, expression: str):
        r = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression!r} raised in the page: {r['exceptionDetails']}")
        return r["result"].get("value")

    def open(self, url: str, ready: str = "document.readyState === 'complete'"):
        """Navigate and wait until the JavaScript expression ``ready`` is true."""
        self.call("Page.navigate", url=url)
        self.wait(ready)

    def wait(self, condition: str, timeout: float | None = None):
        deadline = time.monotonic() + (timeout or self.timeout)
        while not self.eval(f"Boolean({condition})"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the page never reached {condition!r}")
            time.sleep(0.2)

    def errors(self) -> list[str]:
        """Console errors and warnings, uncaught exceptions and error log entries seen so far."""
        self.eval("0")                         # flush events queued behind the last call
        out = []
        for e in self.events:
            p = e.get("params", {})
            if e.get("method") == "Runtime.exceptionThrown":
                out.append(f"exception: {p['exceptionDetails'].get('exception', {}).get('description') or p}")
            elif e.get("method") == "Runtime.consoleAPICalled" and p.get("type") in ("error", "warning", "assert"):
                out.append(f"console.{p['type']}: {' '.join(str(a.get('value', a)) for a in p.get('args', []))}")
            elif e.get("method") == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                out.append(f"log: {p['entry'].get('text')} ({p['entry'].get('url', '')})")
        return out
