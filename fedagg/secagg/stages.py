"""The stages of the secure-aggregation state machines.

:class:`ClientStage` is where a site is (:class:`fedagg.secagg.client.ClientState`); it is
kept as an int in the site's saved state. Importable from :mod:`fedagg.secagg.client` and
:mod:`fedagg.secagg` as well.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ["ClientStage"]


class ClientStage(IntEnum):
    """Where a site is in the protocol."""

    NEW = 0
    ADVERTISED = 1
    READY = 2
    UPLOADED = 3
    UNMASKED = 4
