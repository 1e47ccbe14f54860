"""fedagg's site side on Flower: the ClientApp, the client mod, the site runtime.

Public API:

* :func:`make_client_app` — a Flower ``ClientApp`` for a :class:`fedagg.task.Task` (the
  user's model, data, loss, optimizer, step) with K local workers, compression and secure
  aggregation; ``clients.app:app`` is the built-in task's app;
* :func:`fedagg_mod` — the one client mod that gives any Flower ClientApp fedagg's
  compression and secure aggregation (``ClientApp(mods=[fedagg_mod])``);
* :class:`SiteSettings` — what a site knows for one message (for task factories).
"""

from clients.app import make_client_app
from clients.protocol import fedagg_mod
from clients.settings import SiteSettings

__all__ = ["SiteSettings", "fedagg_mod", "make_client_app"]
