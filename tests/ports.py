"""A free TCP port on loopback, for the servers the tests start (moto_server, `dagster dev`,
torchrun's rendezvous). Free when asked: the server that binds it next is the test's."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
