"""A small HTTP proxy in front of moto_server that fails requests on demand.

One request per client connection (every response says `Connection: close`), so a fault
hits exactly the request it was aimed at. Faults, consumed in order by matching requests:

* ``"503"``: answer 503 SlowDown without asking the server;
* ``"reset"``: reset the client connection without asking the server;
* ``"drop"``: forward the request (the server acts on it), then reset the client
  connection instead of relaying the answer: a response lost on the way back.
"""

from __future__ import annotations

import http.client
import socket
import struct
import threading
from dataclasses import dataclass


@dataclass
class _Fault:
    kind: str
    times: int
    method: str | None
    path_part: str | None

    def matches(self, method: str, path: str) -> bool:
        return (self.method is None or method == self.method) and (
            self.path_part is None or self.path_part in path)


class FaultProxy:
    def __init__(self, upstream: str):
        host, port = upstream.removeprefix("http://").rstrip("/").split(":")
        self.upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._faults: list[_Fault] = []
        self._lock = threading.Lock()
        self.served: list[tuple[str, str, str]] = []  # (method, path, outcome)
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def inject(self, kind: str, times: int = 1, method: str | None = None,
               path_part: str | None = None) -> None:
        assert kind in ("503", "reset", "drop"), kind
        with self._lock:
            self._faults.append(_Fault(kind, times, method, path_part))

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()

    def faults_served(self) -> int:
        with self._lock:
            return sum(1 for *_, outcome in self.served if outcome != "ok")

    def close(self) -> None:
        self._listener.close()

    # -- serving ------------------------------------------------------------------------
    def _take(self, method: str, path: str) -> str | None:
        with self._lock:
            for f in self._faults:
                if f.times > 0 and f.matches(method, path):
                    f.times -= 1
                    return f.kind
        return None

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        client.settimeout(60)
        try:
            method, path, headers, body = self._read_request(client)
            fault = self._take(method, path)
            with self._lock:
                self.served.append((method, path, fault or "ok"))
            if fault == "503":
                msg = (b"<?xml version=\"1.0\"?><Error><Code>SlowDown</Code>"
                       b"<Message>injected</Message></Error>")
                client.sendall(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                               b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
                               % (len(msg), msg))
                return
            if fault == "reset":
                _reset(client)
                return
            response = self._forward(method, path, headers, body)
            if fault == "drop":
                _reset(client)
                return
            client.sendall(response)
        except OSError:
            pass
        finally:
            try:
                client.close()
            except OSError:
                pass

    def _read_request(self, client: socket.socket):
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = client.recv(65536)
            if not chunk:
                raise ConnectionError("client closed before a full request head")
            buf += chunk
        head, rest = buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        headers = []
        for line in lines[1:]:
            name, value = line.split(":", 1)
            headers.append((name.strip(), value.strip()))
        lower = {k.lower(): v for k, v in headers}
        if "chunked" in lower.get("transfer-encoding", ""):
            raise ConnectionError("chunked request bodies are not supported by this proxy")
        if lower.get("expect", "").lower() == "100-continue":
            client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        length = int(lower.get("content-length", "0"))
        body = rest
        while len(body) < length:
            chunk = client.recv(min(1 << 20, length - len(body)))
            if not chunk:
                raise ConnectionError("client closed mid-body")
            body += chunk
        headers = [(k, v) for k, v in headers if k.lower() not in ("expect", "connection")]
        return method, path, headers, body

    def _forward(self, method, path, headers, body) -> bytes:
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
            for k, v in headers:
                conn.putheader(k, v)
            conn.endheaders(body if body else None)
            resp = conn.getresponse()
            data = resp.read()
            out = [f"HTTP/1.1 {resp.status} {resp.reason}".encode()]
            for k, v in resp.getheaders():
                if k.lower() in ("transfer-encoding", "connection"):
                    continue
                if k.lower() == "content-length" and method != "HEAD":
                    continue
                out.append(f"{k}: {v}".encode("latin-1"))
            if method != "HEAD":
                out.append(f"Content-Length: {len(data)}".encode())
            out.append(b"Connection: close")
            return b"\r\n".join(out) + b"\r\n\r\n" + (b"" if method == "HEAD" else data)
        finally:
            conn.close()


def _reset(sock: socket.socket) -> None:
    # SO_LINGER with a zero timeout: close() sends RST instead of FIN.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
