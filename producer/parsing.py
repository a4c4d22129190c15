"""Raw messages into requests: the one way bytes read from the wire become a ``GenerationRequest``
(``parse_request``, and ``parse_keyed_request`` for the requests topic, where the sender must be able to find its
result), and what can still be read from a message that failed (``salvage_json``, ``salvage_identity``). Every
failure is a ``ContractError`` naming the field and the rule (the models and rules: ``producer.contract``)."""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from producer.contract import (
    IDENTIFIER_RE,
    MAX_MESSAGE_BYTES,
    SCHEMA_VERSION,
    ContractError,
    FieldIssue,
    GenerationRequest,
    issues_from_validation,
)


def _issue(field: str, rule: str, message: str) -> ContractError:
    return ContractError([FieldIssue(field=field, rule=rule, message=message)])


def _decode_json(raw: bytes | str | None) -> Any:
    if raw is None:
        raise _issue("<message>", "tombstone", "a message with no value (a tombstone) is not a request")
    size = len(raw) if isinstance(raw, bytes) else len(raw.encode("utf-8", "surrogatepass"))
    if size > MAX_MESSAGE_BYTES:
        raise _issue(
            "<message>", "size", f"{size} bytes, more than the {MAX_MESSAGE_BYTES} a request may have"
        )
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _issue("<message>", "utf8", f"not UTF-8 at byte {exc.start}") from None
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise _issue(
            "<message>", "json", f"not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except RecursionError:
        raise _issue("<message>", "json", "not JSON: nested too deeply") from None
    except ValueError as exc:  # e.g. an integer of more digits than Python converts
        raise _issue("<message>", "json", f"not JSON this service reads: {str(exc)[:200]}") from None


def parse_request(raw: bytes | str | None) -> GenerationRequest:
    """Parse one wire message. Raises ContractError (only) when it is not a valid request."""
    return _validate(_decode_json(raw))


def _validate(data: Any) -> GenerationRequest:
    if not isinstance(data, dict):
        raise _issue("<message>", "object", f"must be a JSON object, got {type(data).__name__}")
    version = data.get("schema_version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise _issue(
            "schema_version",
            "schema_version",
            f"unsupported schema_version {version!r}; this service speaks {SCHEMA_VERSION}",
        )
    try:
        return GenerationRequest.model_validate(data)
    except ValidationError as exc:
        raise ContractError(issues_from_validation(exc)) from None


def parse_keyed_request(raw: bytes | str | None, key: bytes | None) -> GenerationRequest:
    """Parse a message read from the requests topic, where the sender must be able to find its result.

    The contract: a request names itself by ``request_id`` and is keyed by it. A keyed message without a
    ``request_id`` takes its key as the id (the sender knows it); a message with neither is rejected, since a
    generated id could never be matched by whoever sent it; a key that disagrees with the id is rejected.
    """
    data = _decode_json(raw)
    key_text = _key_text(key)
    if isinstance(data, dict) and "request_id" not in data:
        if key_text is None:
            raise _issue(
                "request_id", "missing", "name the request: set request_id and key the message by it"
            )
        data = {**data, "request_id": key_text}
    request = _validate(data)
    if key_text is not None and key_text != request.request_id:
        raise _issue(
            "<key>",
            "key_mismatch",
            f"the message key must be its request_id {request.request_id!r}, got {key_text!r}",
        )
    return request


def _key_text(key: bytes | None) -> str | None:
    if key is None:
        return None
    try:
        return key.decode("utf-8")
    except UnicodeDecodeError:
        return key.decode("latin-1")


def salvage_identity(data: Any) -> tuple[str | None, str]:
    """(request id, tenant) named by a message or order that failed validation, if it still names valid ones.

    One rule for every salvager: a value is used only if it is a valid Identifier; the tenant defaults.
    """
    if not isinstance(data, dict):
        return None, "default"
    rid, tenant = data.get("request_id"), data.get("tenant")
    rid = rid if isinstance(rid, str) and IDENTIFIER_RE.match(rid) else None
    tenant = tenant if isinstance(tenant, str) and IDENTIFIER_RE.match(tenant) else "default"
    return rid, tenant


def salvage_json(raw: bytes | str | None) -> Any:
    """The JSON value of a message, or None if it is not (bounded like parse_request)."""
    try:
        return _decode_json(raw)
    except ContractError:
        return None
