"""Errors the engine raises or catches.

``DonorUnavailable`` and ``CorruptTrajectory`` are *donor problems*: the engine never fails a request for one,
it falls back to computing in full and says why in ``GenerationOutput.fallback``. ``IncompatibleDonor`` is
different: the caller asked for something that can never work (another model, shape, step count or scheduler),
so the engine refuses it — unless the caller asked it to compute in full instead (``refuse_incompatible=False``,
what the worker does), when it is one more fallback.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class of everything the engine raises on purpose."""


class DonorError(EngineError):
    """Something is wrong with a donor trajectory."""


class DonorUnavailable(DonorError):
    """Donor data cannot be had (not uploaded yet, deleted, timed out). Raised by a ``DonorSource``."""


class DonorWaitExpired(DonorUnavailable):
    """A running leader did not upload what a follower waited for within its wait (or another follower already found
    it gone): the source stops waiting for that leader."""


class DonorMissing(DonorUnavailable):
    """A finished donor's object is not in the store: deleted outside Chorus, so it will never be usable again."""


class CorruptTrajectory(DonorError):
    """Serialized trajectory data does not decode or does not match its checksum."""


class IncompatibleDonor(DonorError):
    """The donor was made by another model / shape / step count / scheduler; the engine refuses it."""


class ModelUnavailable(EngineError):
    """A registry model cannot be loaded here (unknown name, missing directory, module not built yet)."""
