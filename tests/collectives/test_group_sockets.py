"""Shutting down what an abandoned operation keeps open of a destroyed group (Linux /proc).

Real TCP sockets on 127.0.0.1: the sockets opened inside ``owned()`` stand for a group's
pairs, a socket opened outside it for the user's own connection.
"""

from __future__ import annotations

import socket
import sys

import pytest

from fedagg.collectives.backends import group_sockets

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _pair(listener: socket.socket) -> tuple[socket.socket, socket.socket]:
    client = socket.create_connection(listener.getsockname(), timeout=5)
    server, _ = listener.accept()
    server.settimeout(5)
    return client, server


def test_only_the_groups_sockets_are_shut_down_and_the_peer_sees_it_at_once() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        user_client, user_peer = _pair(listener)  # opened outside: never touched
        with group_sockets.owned():  # this process's end of a "pair"; the peer's is not its
            group_client = socket.create_connection(listener.getsockname(), timeout=5)
            own_listener = socket.socket()
            own_listener.bind(("127.0.0.1", 0))
            own_listener.listen()
        group_peer, _ = listener.accept()
        group_peer.settimeout(5)
        try:
            # the "group" here is one connection plus a listener: one socket shut down
            assert group_sockets.shutdown_leftovers() == 1
            assert group_peer.recv(1) == b""  # EOF now, not at a timeout
            user_client.sendall(b"x")
            assert user_peer.recv(1) == b"x"  # the user's connection still works
            assert own_listener.getsockname()[1] > 0  # the listener is left alone
            # the record is cleared: a second call touches nothing (inodes get reused)
            assert group_sockets.shutdown_leftovers() == 0
        finally:
            for s in (user_client, user_peer, group_client, group_peer, own_listener):
                s.close()


def test_nothing_left_open_nothing_shut_down() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        with group_sockets.owned():
            client, peer = _pair(listener)
        client.close()
        peer.close()
        assert group_sockets.shutdown_leftovers() == 0
