"""The request/result contract: what producers publish, what the system answers, what it dead-letters.

JSON on the wire, versioned by ``schema_version``. ``producer.parsing.parse_request`` is the one way raw bytes
become a ``GenerationRequest``; it never raises anything but ``ContractError``, whose issues name the field and
the rule that was broken.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import uuid
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, Literal, Self

from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StringConstraints,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticCustomError

from producer.catalog import CATALOG, compatibility_key

SCHEMA_VERSION: Literal[1] = 1

# Ids travel as Kafka keys, S3 object names and Qdrant payloads: keep them to a safe alphabet.
Identifier = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")]
Prompt = Annotated[str, StringConstraints(min_length=1, max_length=2000)]
IDENTIFIER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
# Numbers on the wire are numbers: a string "4" is a producer bug to report, not a value to guess at.
WireInt = Annotated[int, Strict()]
WireFloat = Annotated[float, Strict()]

# The largest request message read at all. The longest valid request (two 2,000-character prompts, every
# character escaped) stays well under it; anything bigger is rejected before it is parsed.
MAX_MESSAGE_BYTES = 64 * 1024
# A dead letter keeps at most this much of the message it reports (the whole message stays in its topic at the
# offset the letter names), so a huge message can always be dead-lettered within the producer's request size.
DEAD_LETTER_RAW_BYTES = 16 * 1024


DEFAULT_TENANT = "default"
JOB_SEPARATOR = "~"


def job_id(tenant: str, request_id: str) -> str:
    """The system-wide identity of one tenant's request: ledger claims, task ids, object keys, index points.

    Request ids are chosen by tenants, so two tenants may use the same one. The default tenant's job id is its
    request id (so single-tenant deployments see their own ids everywhere); any other tenant's is
    ``tenant~request_id``. '~' is outside the Identifier alphabet, so no two (tenant, id) pairs share a job id;
    and unlike '/', it is safe in every place a job id goes (a file name in Celery's filesystem result backend).
    """
    return request_id if tenant == DEFAULT_TENANT else f"{tenant}{JOB_SEPARATOR}{request_id}"


def split_job_id(job: str) -> tuple[str, str]:
    """(tenant, request id) of a job id (the inverse of ``job_id``)."""
    tenant, sep, request_id = job.partition(JOB_SEPARATOR)
    return (tenant, request_id) if sep else (DEFAULT_TENANT, job)


def _new_request_id() -> str:
    return uuid.uuid4().hex


def _utcnow() -> datetime:
    return datetime.now(UTC)


class ReusePolicy(StrEnum):
    AUTO = "auto"
    OFF = "off"


class FieldIssue(BaseModel):
    model_config = ConfigDict(frozen=True)

    field: str
    rule: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message} [{self.rule}]"


class ContractError(ValueError):
    """Raw input does not satisfy the contract. ``issues`` says which field broke which rule."""

    def __init__(self, issues: list[FieldIssue]) -> None:
        self.issues = issues
        super().__init__("; ".join(str(i) for i in issues))

    @property
    def code(self) -> str:
        return "invalid_request"


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, str_strip_whitespace=False)

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()


class GenerationRequest(_Wire):
    """One text-to-video request. Omitted shape/steps/guidance fields take the model's defaults."""

    schema_version: Literal[1] = SCHEMA_VERSION
    request_id: Identifier = Field(default_factory=_new_request_id)
    tenant: Identifier = "default"
    prompt: Prompt
    negative_prompt: Annotated[str, StringConstraints(max_length=2000)] | None = None
    model: str = "toy"
    num_frames: WireInt = Field(default=-1, ge=1, le=1024, validate_default=False)
    height: WireInt = Field(default=-1, ge=8, le=4096, validate_default=False)
    width: WireInt = Field(default=-1, ge=8, le=4096, validate_default=False)
    num_steps: WireInt = Field(default=-1, ge=1, le=1000, validate_default=False)
    seed: WireInt = Field(default=0, ge=0, le=2**63 - 1)
    guidance_scale: WireFloat = Field(
        default=-1.0, ge=0.0, le=50.0, allow_inf_nan=False, validate_default=False
    )
    reuse: ReusePolicy = ReusePolicy.AUTO
    # Reuse only donors made with this request's own seed, so the video is the requested seed's sample (a donor
    # of another seed gives a valid sample for the prompt, but another one: see GenerationResult.seed_honoured).
    keep_seed: Annotated[bool, Strict()] = False
    priority: WireInt = Field(default=0, ge=0, le=9)
    submitted_at: AwareDatetime = Field(default_factory=_utcnow)

    @model_validator(mode="before")
    @classmethod
    def _model_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        spec = CATALOG.get(data.get("model", "toy")) if isinstance(data.get("model", "toy"), str) else None
        if spec is None:
            return data
        defaults = {
            "num_frames": spec.default_num_frames,
            "height": spec.default_height,
            "width": spec.default_width,
            "num_steps": spec.default_num_steps,
            "guidance_scale": spec.default_guidance_scale,
        }
        return {**defaults, **{k: v for k, v in data.items() if v is not None or k not in defaults}}

    @model_validator(mode="after")
    def _fits_model(self) -> Self:
        if not self.prompt.strip():
            raise PydanticCustomError("blank", "must contain a non-whitespace character", {"field": "prompt"})
        spec = CATALOG.get(self.model)
        if spec is None:
            known = ", ".join(sorted(CATALOG))
            raise PydanticCustomError(
                "unknown_model",
                "model '{model}' is not in the registry (known: {known})",
                {"field": "model", "model": self.model, "known": known},
            )
        for name in ("num_frames", "height", "width", "num_steps"):
            value = getattr(self, name)
            why = getattr(spec, name).check(value)
            if why is not None:
                raise PydanticCustomError(
                    "model_shape",
                    "{why} for model '{model}' (got {value})",
                    {"field": name, "why": why, "model": self.model, "value": value},
                )
        return self

    @property
    def compatibility_key(self) -> str:
        return compatibility_key(self.model, self.num_frames, self.height, self.width, self.num_steps)

    @property
    def job_id(self) -> str:
        return job_id(self.tenant, self.request_id)

    @property
    def fingerprint(self) -> str:
        """Equal for two requests that must produce the same video: model, shape, steps and scheduler (the
        compatibility key), prompt, negative prompt, seed and guidance. Not the tenant, id, priority or reuse."""
        return self._settings_digest(self.seed)

    @property
    def any_seed_fingerprint(self) -> str:
        """The fingerprint without the seed: equal for two requests that differ at most in their seed. Any video
        of one is a video of the other's prompt and settings (from another noise); a Stage-1 donor with the same
        prompt reproduces its donor's video exactly, which is why the scheduler serves such requests whole
        (``chorus_sched.exact``) unless they keep their seed."""
        return self._settings_digest(None)

    def _settings_digest(self, seed: int | None) -> str:
        canonical = json.dumps(
            [
                FINGERPRINT_VERSION,
                self.compatibility_key,
                self.prompt,
                self.negative_prompt,
                seed,
                repr(float(self.guidance_scale)),
            ]
        )
        return hashlib.sha256(canonical.encode()).hexdigest()

    @property
    def answer_key(self) -> str:
        """The fingerprint and the terms an answer honours (``reuse``, ``keep_seed``): results name it."""
        return hashlib.sha256(f"{self.fingerprint}:{self.reuse}:{self.keep_seed}".encode()).hexdigest()


# Bumped whenever what makes two requests' videos identical changes (e.g. new weights under a model's name), so
# stored exact hits of the old meaning are never served.
FINGERPRINT_VERSION = 1


class ReuseKind(StrEnum):
    """What a result's video is: served whole from an earlier request's result (``exact``: the same prompt and
    settings; another seed's video where ``seed_honoured`` is false), started from a donor's latent
    (``stage1``), recomputed only where the prompt differs (``stage2``), or computed in full."""

    EXACT = "exact"
    STAGE1 = "stage1"
    STAGE2 = "stage2"
    NONE = "none"


class DonorVerification(_Wire):
    """Thresholds of a model-verified donor (``workers.engine.verify``): the target's first computed prediction, on
    the donor's latent after Stage 1, against the donor's recorded one as ``mean((m_t − m_d)²) / mean(m_d²)``. At
    most ``accept_max``: the plan runs; at most ``shorten_max``: Stage 1 keeps ``shorten_fraction`` of its steps;
    above: the donor is dropped and the request computed in full."""

    accept_max: float = Field(ge=0.0, allow_inf_nan=False)
    shorten_max: float | None = Field(default=None, ge=0.0, allow_inf_nan=False)
    shorten_fraction: float = Field(default=0.5, ge=0.0, lt=1.0)


class VerificationReport(_Wire):
    """What donor verification measured and decided; ``signal`` None: not measurable (the donor's output at
    ``step`` could not be read), the plan ran unverified. ``wasted_seconds``: the verification pass thrown away."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    decision: Literal["accepted", "shortened", "rejected", "unverified"]
    signal: float | None = Field(default=None, ge=0.0)
    step: int = Field(ge=0, description="the step compared: the plan's first computed one")
    stage1_steps: int = Field(ge=0, description="Stage-1 steps run after the decision")
    wasted_seconds: float = Field(default=0.0, ge=0.0)
    # The thrown-away pass's computed token fraction of one step (1.0 for a full step): what a rejection costs.
    wasted_tokens_fraction: float = Field(default=0.0, ge=0.0, le=1.0)


class ReusePlan(_Wire):
    """How the N denoising steps split into the three stages, and how Stage 2 behaves.

    Stage 1 skips ``stage1_steps`` by starting from the donor's latent; Stage 2 recomputes only the
    divergent tokens for ``stage2_steps``; Stage 3 runs ``stage3_steps`` in full.
    """

    stage1_steps: int = Field(ge=0)
    stage2_steps: int = Field(ge=0)
    stage3_steps: int = Field(ge=0)
    alpha: float = Field(default=1.0, ge=1.0, le=20.0, allow_inf_nan=False)
    mask_threshold: float = Field(default=0.5, ge=0.0, le=1.0)
    min_active_fraction: float = Field(default=0.05, ge=0.0, le=1.0)
    max_active_fraction: float = Field(default=1.0, ge=0.0, le=1.0)
    tgaa_in_stage3: bool = False
    # Stage-2 mask shaping: dilation radius in latent tokens, and coarse-to-fine levels (the first Stage-2 step
    # pools the attention score over 2**(levels-1) × 2**(levels-1) token blocks, each later step halves that).
    mask_dilation: int = Field(default=1, ge=0, le=16)
    mask_levels: int = Field(default=3, ge=1, le=6)
    # Check the donor with the model before trusting its Stage 1 (None: trust the planner's similarity alone).
    verification: DonorVerification | None = None

    @model_validator(mode="after")
    def _ordered_fractions(self) -> Self:
        if self.min_active_fraction > self.max_active_fraction:
            raise PydanticCustomError(
                "fraction_order",
                "min_active_fraction must not exceed max_active_fraction",
                {"field": "min_active_fraction"},
            )
        return self

    @property
    def num_steps(self) -> int:
        return self.stage1_steps + self.stage2_steps + self.stage3_steps

    @property
    def reuses(self) -> bool:
        return self.stage1_steps + self.stage2_steps > 0

    @classmethod
    def full(cls, num_steps: int) -> ReusePlan:
        return cls(stage1_steps=0, stage2_steps=0, stage3_steps=num_steps)


class ResultStatus(StrEnum):
    DONE = "done"
    FAILED = "failed"
    REJECTED = "rejected"


REQUEST_ID_REUSED = "request_id_reused"  # a request id sent again for another request (chorus_sched.resend)


class ErrorInfo(_Wire):
    code: str
    message: str


class DonorInfo(_Wire):
    """The request whose work was reused: its tenant's own request id (another tenant's only where cross-tenant
    reuse is allowed)."""

    request_id: str
    tenant: str = DEFAULT_TENANT
    similarity: float = Field(ge=-1.0, le=1.0)

    @classmethod
    def of_job(cls, job: str, similarity: float) -> DonorInfo:
        tenant, request_id = split_job_id(job)
        return cls(request_id=request_id, tenant=tenant, similarity=similarity)

    @property
    def job_id(self) -> str:
        return job_id(self.tenant, self.request_id)


class PhaseTimings(_Wire):
    """Seconds spent in each phase of one request.

    ``prepare_s``: from the worker's task starting to the order's own work (the redelivery checks, the order
    parsed, the model looked up); ``worker_s``: from the task starting to the result assembled, so what no phase
    names is ``worker_s`` minus the others (publishing the result comes after and is not in it).
    """

    # Like GenerationResult: a reader ignores a timing it does not know yet (a newer worker may send one).
    model_config = ConfigDict(extra="ignore", frozen=True)

    queue_s: float = Field(default=0.0, ge=0.0)
    fetch_s: float = Field(default=0.0, ge=0.0)
    denoise_s: float = Field(default=0.0, ge=0.0)
    decode_s: float = Field(default=0.0, ge=0.0)
    upload_s: float = Field(default=0.0, ge=0.0)
    prepare_s: float = Field(default=0.0, ge=0.0)
    worker_s: float = Field(default=0.0, ge=0.0)


class GenerationResult(_Wire):
    # Readers (the SDK, the scheduler) ignore fields they do not know: during a rolling upgrade workers may
    # already send a field that an older reader lacks, and dropping the whole result would lose it. Requests stay
    # strict, so a misspelled field is reported to whoever sent it.
    model_config = ConfigDict(extra="ignore", frozen=True)

    schema_version: Literal[1] = SCHEMA_VERSION
    request_id: str
    tenant: str = "default"
    status: ResultStatus
    error: ErrorInfo | None = None
    video_uri: str | None = None
    # Where this request's own trajectory was stored, so it can serve as a donor; None if it was not stored.
    trajectory_uri: str | None = None
    trajectory_bytes: int = Field(default=0, ge=0)
    donor: DonorInfo | None = None
    plan: ReusePlan | None = None
    steps_computed: int = Field(default=0, ge=0)
    steps_requested: int = Field(default=0, ge=0)
    tokens_computed_fraction: float = Field(default=0.0, ge=0.0, le=1.0)
    fallback: str | None = Field(default=None, description="why a planned donor was not used, if it was not")
    donor_gone: bool = Field(
        default=False,
        description="the planned finished donor was missing, corrupt or incompatible: it must not be offered again",
    )
    timings: PhaseTimings = Field(default_factory=PhaseTimings)
    worker: str | None = None
    completed_at: AwareDatetime = Field(default_factory=_utcnow)
    reuse: ReuseKind = Field(default=ReuseKind.NONE, description="what the video is (see ReuseKind)")
    served_from: str | None = Field(
        default=None, description="for an exact hit: the job id of the request whose video this is"
    )
    seed_honoured: bool = Field(
        default=True,
        description="False when the video started from a donor's noise of another (or an unknown) seed, Stage 1 "
        "or Stage 2 alike: a sample for the prompt, but not the one the requested seed alone would give",
    )
    prompt_tokens_used: int | None = Field(
        default=None,
        ge=0,
        description="prompt tokens the model's text encoder used (None: not reported)",
    )
    prompt_truncated: bool = Field(
        default=False,
        description="True when the prompt was longer than the model's text token budget and its end was cut",
    )
    verification: VerificationReport | None = Field(default=None, description="the donor check, if one ran")
    # The answer_key of the request answered (None: not known): two requests sent under one id get told apart.
    request_key: str | None = None
    answers_resend: bool = Field(
        default=False,
        description="answers one message (its id sent again), not the request's run: nothing new",
    )

    @property
    def saved_compute(self) -> bool:
        """The one definition of a *hit*: a finished request that computed fewer token-steps than in full."""
        return (
            self.status is ResultStatus.DONE
            and self.steps_requested > 0
            and self.tokens_computed_fraction < 1.0 - 1e-6
        )

    @property
    def job_id(self) -> str:
        return job_id(self.tenant, self.request_id)


class DeadLetter(_Wire):
    """A message the scheduler could not accept: why, where it is, and (up to DEAD_LETTER_RAW_BYTES) what it said.

    ``topic``/``partition``/``offset`` locate the whole message; ``raw_size`` and ``raw_sha256`` describe it, and
    ``raw_truncated`` says whether ``raw_b64`` holds all of it.
    """

    schema_version: Literal[1] = SCHEMA_VERSION
    raw_b64: str
    raw_size: int = Field(default=0, ge=0)
    raw_sha256: str = ""
    raw_truncated: bool = False
    tombstone: bool = False
    key_b64: str | None = None
    error: ErrorInfo
    issues: list[FieldIssue] = Field(default_factory=list)
    topic: str
    partition: int = Field(ge=0)
    offset: int = Field(ge=0)
    dead_lettered_at: AwareDatetime = Field(default_factory=_utcnow)

    @classmethod
    def of_message(
        cls,
        raw: bytes | None,
        key: bytes | None,
        error: ErrorInfo,
        issues: list[FieldIssue],
        *,
        topic: str,
        partition: int,
        offset: int,
    ) -> DeadLetter:
        body = raw or b""
        return cls(
            raw_b64=base64.b64encode(body[:DEAD_LETTER_RAW_BYTES]).decode(),
            raw_size=len(body),
            raw_sha256=hashlib.sha256(body).hexdigest(),
            raw_truncated=len(body) > DEAD_LETTER_RAW_BYTES,
            tombstone=raw is None,
            key_b64=base64.b64encode(key[:DEAD_LETTER_RAW_BYTES]).decode() if key is not None else None,
            error=error,
            issues=issues,
            topic=topic,
            partition=partition,
            offset=offset,
        )

    @classmethod
    def from_error(
        cls, raw: bytes, key: bytes | None, error: ContractError, topic: str, partition: int, offset: int
    ) -> DeadLetter:
        return cls.of_message(
            raw,
            key,
            ErrorInfo(code=error.code, message=str(error)),
            error.issues,
            topic=topic,
            partition=partition,
            offset=offset,
        )

    def raw(self) -> bytes:
        return base64.b64decode(self.raw_b64)


def issues_from_validation(exc: ValidationError) -> list[FieldIssue]:
    issues = []
    for err in exc.errors(include_url=False):
        ctx = err.get("ctx") or {}
        field = ctx.get("field") or ".".join(str(p) for p in err["loc"]) or "<root>"
        issues.append(FieldIssue(field=str(field), rule=err["type"], message=err["msg"]))
    return issues


def build_request(**fields: Any) -> GenerationRequest:
    """Construct a request in code with the same errors a wire message would get."""
    try:
        return GenerationRequest.model_validate(fields)
    except ValidationError as exc:
        raise ContractError(issues_from_validation(exc)) from None
