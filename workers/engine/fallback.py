"""Why a planned reuse did not happen, as the engine decides it (``Engine.generate``, ``prefetch_donor``).

The engine is the only place that decides a donor fallback: it returns the reason in ``GenerationOutput.fallback``
(text), ``fallback_cause`` (one of ``FallbackCause``) and ``donor_gone`` (the donor can never serve again), and the
worker reports them as they are (the result's ``fallback`` and ``donor_gone``,
``chorus_worker_fallbacks_total{cause}``). Torch-free, so that the worker's metrics can label by the causes.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class FallbackCause(StrEnum):
    NO_DONOR_REF = "no_donor_ref"  # the plan reuses a donor but none was given
    DONOR_UNAVAILABLE = "donor_unavailable"  # a finished donor's objects are missing or unreadable
    DONOR_CORRUPT = "donor_corrupt"  # a finished donor's objects fail their checksum
    DONOR_INCOMPATIBLE = "donor_incompatible"  # the engine refused the donor (shape, scheduler, weights)
    LEADER_WAIT_TIMEOUT = "leader_wait_timeout"  # a follower waited for its leader's step in vain
    DONOR_STEP_UNAVAILABLE = "donor_step_unavailable"  # a donor step could not be read while the engine ran
    VERIFICATION_SHORTENED = "verification_shortened"  # the model's check of the donor cut Stage 1 short
    VERIFICATION_REJECTED = "verification_rejected"  # the model's check of the donor rejected it


@dataclass(frozen=True)
class Fallback:
    """One decision to compute in full what the plan meant to reuse."""

    cause: FallbackCause
    message: str
    donor_gone: bool = False  # the donor can never serve any request again (missing, corrupt, incompatible)
