"""fedagg: federated-learning aggregation on Flower.

The core package (this one) is Flower-free: aggregation math, intra-site collectives,
compression, secure aggregation, data, models and configuration. The Flower layers live in the
sibling packages ``strategies``, ``server`` and ``clients``.

Plugin authors: the strategy registry and base classes are importable from ``strategies``
(see docs/plugins.md); configuration models from :mod:`fedagg.config`.
"""

from fedagg.errors import FedaggError

__all__ = ["FedaggError", "__version__"]

__version__ = "0.1.0"
