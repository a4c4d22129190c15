"""Errors the engine raises or catches.

``DonorUnavailable`` and ``CorruptTrajectory`` are *donor problems*: the engine never fails a request for one,
it falls back to computing in full and says why in ``GenerationOutput.fallback``. ``IncompatibleDonor`` is
different: the caller asked for something that can never work (another model, shape, step count or scheduler),
so the engine refuses and the caller (the worker) decides what to do.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class of everything the engine raises on purpose."""


class DonorError(EngineError):
    """Something is wrong with a donor trajectory."""


class DonorUnavailable(DonorError):
    """Donor data cannot be had (not uploaded yet, deleted, timed out). Raised by a ``DonorSource``."""


class DonorMissing(DonorUnavailable):
    """A finished donor's object is not in the store: deleted outside Chorus, so it will never be usable again."""


class CorruptTrajectory(DonorError):
    """Serialized trajectory data does not decode or does not match its checksum."""


class IncompatibleDonor(DonorError):
    """The donor was made by another model / shape / step count / scheduler; the engine refuses it."""


class ModelUnavailable(EngineError):
    """A registry model cannot be loaded here (unknown name, missing directory, module not built yet)."""
