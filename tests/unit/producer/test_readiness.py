"""The readiness events travel as the ``event`` field of a JSON log line, spelled as ``ReadinessEvent`` declares."""

from __future__ import annotations

import json
import logging

import pytest

from producer.logs import JsonFormatter
from producer.readiness import ReadinessEvent


@pytest.mark.parametrize("event", list(ReadinessEvent))
def test_a_readiness_event_is_the_event_field_of_its_json_line(event: ReadinessEvent) -> None:
    record = logging.LogRecord("chorus", logging.INFO, __file__, 1, event, (), None)
    record.topic = "chorus.requests"
    line = json.loads(JsonFormatter().format(record))
    assert line["event"] == event.value and line["event"] == event
    assert line["topic"] == "chorus.requests"
