"""A newer generation shuts the old generation's connections (`runtime.training.comm`): in-process, real sockets."""

from __future__ import annotations

import os
import socket

from runtime.training.comm import shut_sockets, tcp_socket_inodes


def test_the_connections_opened_since_a_baseline_are_found_and_shut_but_never_the_listener_or_the_descriptor() -> None:
    baseline = tcp_socket_inodes()
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname(), timeout=5)
    server, _ = listener.accept()
    server.settimeout(5)
    try:
        opened = tcp_socket_inodes() - baseline
        ends = {_inode(client), _inode(server)}
        assert ends <= opened and _inode(listener) not in opened, "the listening socket is never counted"

        assert shut_sockets(ends) == 2
        assert server.recv(1) == b"", "a read on a shut connection ends at once"
        assert client.fileno() >= 0 and server.fileno() >= 0, "the descriptors stay their owners'"
        # The listener still accepts: Gloo's accept thread would abort the process if it failed.
        other = socket.create_connection(listener.getsockname(), timeout=5)
        accepted, _ = listener.accept()
        accepted.close()
        other.close()
    finally:
        for s in (client, server, listener):
            s.close()


def _inode(s: socket.socket) -> int:
    return int(os.readlink(f"/proc/self/fd/{s.fileno()}")[8:-1])


def test_sockets_closed_since_are_skipped() -> None:
    baseline = tcp_socket_inodes()
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname(), timeout=5)
    server, _ = listener.accept()
    opened = (tcp_socket_inodes() - baseline) & {_inode(client), _inode(server)}
    assert len(opened) == 2
    client.close()
    server.close()
    listener.close()
    assert shut_sockets(opened) == 0
