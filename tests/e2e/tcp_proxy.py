"""A loopback TCP forwarder that a test can cut and restore: an engine that is briefly
unreachable without restarting (a network partition), which killing a process cannot give."""

from __future__ import annotations

import socket
import struct
import threading
from typing import Self


class TCPProxy:
    """Listens on 127.0.0.1 and forwards every connection to `target` ("host:port").

    `cut()` drops every open connection and resets new ones until `restore()`.
    `cut_after_bytes(n)` does the same once `n` more bytes have gone towards the target, so a
    long call (a streamed weight update) is cut off half-way.
    """

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._is_cut = False
        self._bytes_left: int | None = None
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="tcp-proxy").start()

    def cut(self) -> None:
        with self._lock:
            self._is_cut = True
            self._bytes_left = None
            doomed, self._sockets = self._sockets, set()
        for sock in doomed:
            _reset(sock)

    def cut_after_bytes(self, num_bytes: int) -> None:
        with self._lock:
            self._bytes_left = num_bytes

    def restore(self) -> None:
        with self._lock:
            self._is_cut = False

    def close(self) -> None:
        self._closed = True
        self.cut()
        self._listener.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                is_cut = self._is_cut
            if is_cut:
                _reset(client)
                continue
            try:
                upstream = socket.create_connection(self._target, timeout=5)
            except OSError:
                _reset(client)
                continue
            upstream.settimeout(None)
            with self._lock:
                self._sockets |= {client, upstream}
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False),
                             daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, towards_target: bool) -> None:
        try:
            while data := source.recv(65536):
                if towards_target and self._spend(len(data)):
                    self.cut()
                    return
                sink.sendall(data)
        except OSError:
            pass
        _reset(source)
        _reset(sink)

    def _spend(self, num_bytes: int) -> bool:
        """Count bytes towards an armed cut; True once it is due."""
        with self._lock:
            if self._bytes_left is None:
                return False
            self._bytes_left -= num_bytes
            return self._bytes_left <= 0


def _reset(sock: socket.socket) -> None:
    """Close with RST (SO_LINGER 0), as a dropped connection looks to its peer."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    except OSError:
        pass
