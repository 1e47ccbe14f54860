"""Exception hierarchy for fedagg.

Every error fedagg raises on purpose derives from :class:`FedaggError`, so callers can catch
one base class. Errors about bad input say four things: the field, the bad value, the rule it
broke and how to fix it (see :func:`explain`). Errors from cryptographic verification are
deliberately opaque: they say *that* verification failed, never *why*.

::

    FedaggError
     ├── ConfigError            (also ValueError)   bad configuration value / combination
     ├── DataError              (also ValueError)   missing or malformed data set files
     ├── RegistryError          (also KeyError)     unknown strategy / compressor name
     ├── CodecError             (also ValueError)   malformed compressed payload on the wire
     ├── UpdateRejected         (also ValueError)   a site update failed a server-side check
     ├── CollectiveError                            intra-site all-reduce failures
     │    └── CollectiveTimeout (also TimeoutError) a peer did not answer in time
     ├── ProtocolError                              secure-aggregation protocol failures
     │    ├── AbortRound                            the round cannot complete (too few survivors)
     │    └── VerificationError                     tampered / forged data (opaque message)
     ├── WorkerError                                a local worker of a site crashed or hung
     ├── CheckpointError                            unreadable or mismatched checkpoint
     └── RunFailed                                  a run in which no round changed the model
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = [
    "AbortRound",
    "CheckpointError",
    "CodecError",
    "CollectiveError",
    "CollectiveTimeout",
    "ConfigError",
    "DataError",
    "FedaggError",
    "PrivacyBudgetSpent",
    "ProtocolError",
    "RegistryError",
    "RunFailed",
    "UpdateRejected",
    "VerificationError",
    "WorkerError",
    "did_you_mean",
    "explain",
]


def explain(field: str, value: object, rule: str, fix: str) -> str:
    """Format the standard four-part message: field, value, rule, fix.

    Parameters
    ----------
    field : str
        Dotted name of the offending field (``"secagg.threshold"``).
    value : object
        The value that was given. Never pass secret material here.
    rule : str
        The rule that the value broke (``"must be >= 2"``).
    fix : str
        What the user should do instead.

    Returns
    -------
    str
        ``"<field> = <value!r>: <rule>. Fix: <fix>"``.
    """
    shown = repr(value)
    if len(shown) > 200:
        shown = shown[:197] + "..."
    return f"{field} = {shown}: {rule}. Fix: {fix}"


def did_you_mean(name: str, known: Iterable[str], *, within: str = "") -> str:
    """``" (did you mean 'x'?)"`` for the known names closest to ``name``; ``""`` if none is
    close (:func:`difflib.get_close_matches`; case and ``-`` / ``_`` ignored). ``within`` is
    put in front of each name shown (``"train."``)."""
    norm = {k.lower().replace("-", "_"): k for k in known}
    close = difflib.get_close_matches(name.lower().replace("-", "_"), list(norm), n=3,
                                      cutoff=0.6)
    if not close:
        return ""
    return " (did you mean " + " or ".join(repr(within + norm[c]) for c in close) + "?)"


class FedaggError(Exception):
    """Base class of every error fedagg raises on purpose."""


class ConfigError(FedaggError, ValueError):
    """A configuration value or combination is invalid."""


class DataError(FedaggError, ValueError):
    """A data set is missing, unreadable or malformed."""


class RegistryError(FedaggError, KeyError):
    """A name was not found in a registry; the message lists the known names."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class CodecError(FedaggError, ValueError):
    """A compressed payload is malformed (bad header, length, index or value)."""


class UpdateRejected(FedaggError, ValueError):
    """A site update failed a server-side check and was not aggregated."""


class NonFiniteUpdate(UpdateRejected):
    """An update holds a NaN or an infinity (in tensor :attr:`tensor`); nothing of it was
    folded. Raised by the exact accumulator, which reads every value anyway: a streamed
    round needs no separate finiteness pass over each reply."""

    def __init__(self, message: str, tensor: int) -> None:
        super().__init__(message)
        self.tensor = tensor


class CollectiveError(FedaggError):
    """An intra-site collective operation failed (mismatched inputs, broken peer)."""


class CollectiveTimeout(CollectiveError, TimeoutError):
    """A peer did not send or receive within the communicator's timeout."""


class ProtocolError(FedaggError):
    """The secure-aggregation protocol cannot proceed as asked."""


class AbortRound(ProtocolError):
    """The round must abort (for example fewer than ``threshold`` survivors).

    The global model is left unchanged; the run continues with the next round.
    """


class VerificationError(ProtocolError):
    """Authenticated data failed verification. The message is deliberately opaque."""

    def __init__(self, message: str = "verification failed") -> None:
        super().__init__(message)


class WorkerError(FedaggError):
    """A local worker of a site crashed, hung or reported an error."""


class CheckpointError(FedaggError):
    """A checkpoint is unreadable, incomplete, or belongs to a different configuration."""


class PrivacyBudgetSpent(FedaggError):
    """The next round would spend more than the run's privacy budget
    (``privacy.target_epsilon``): the run stops before it, with the model of its last round."""


class RunFailed(FedaggError):
    """A run ended in which no round aggregated anything (every reply failed or was refused).

    ``fedagg simulate`` exits non-zero, and the ServerApp raises it so ``flwr run`` reports a
    failed run; the message summarises each round's reasons. :attr:`records` holds the run's
    per-round records (as written to metrics.json).
    """

    def __init__(self, message: str, records: list[dict[str, object]] | None = None) -> None:
        super().__init__(message)
        self.records = list(records or [])
