"""Typed errors for payloads that must not be trusted.

Every rejection names its cause so that a log line tells an operator whether a payload
was cut short (an interrupted upload), altered, forged, from another run, or from a newer
version of diloco.
"""


class PayloadError(ValueError):
    """A payload was rejected; nothing from it reached a model."""


class TruncatedPayload(PayloadError):
    """The payload is shorter than its own frame says: an upload cut short."""


class CorruptPayload(PayloadError):
    """The bytes do not match their tag or their declared structure: altered or forged."""


class UnsupportedFormat(PayloadError):
    """Not a diloco payload, or one written by an incompatible format version."""


class WrongRun(PayloadError):
    """The payload was written under another run's secret."""


class PayloadTooLarge(PayloadError):
    """The frame declares sizes beyond the configured limits."""


class NonFiniteValues(ValueError):
    """A tensor to encode holds NaN or infinity (a diverged learner); nothing was sent."""
