"""The stages of the secure-aggregation state machines.

:class:`ClientStage` is where a site is (:class:`fedagg.secagg.client.ClientState`; kept as an
int in the site's saved state), :class:`ServerStage` where the server is
(:class:`fedagg.secagg.server.ServerState`). Importable from :mod:`fedagg.secagg.client`,
:mod:`fedagg.secagg.server` and :mod:`fedagg.secagg` as well.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ["ClientStage", "ServerStage"]


class ClientStage(IntEnum):
    """Where a site is in the protocol."""

    NEW = 0
    ADVERTISED = 1
    READY = 2
    UPLOADED = 3
    UNMASKED = 4


class ServerStage(IntEnum):
    """Where the server is in the protocol."""

    IDLE = 0
    ADVERTISING = 1
    SHARING = 2
    READY = 3
    COLLECTING = 4
    UNMASKING = 5
