"""A CPU worker runs each order on its model's torch thread count (``CHORUS_TORCH_THREADS``)."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from workers import runner
from workers.settings import WorkerSettings


def test_each_order_runs_on_its_models_thread_count(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    monkeypatch.setattr(runner, "_default_threads", None)
    monkeypatch.setenv("CHORUS_TORCH_THREADS", '{"toy": 1, "wan2.1-t2v-1.3b": 2}')
    settings = WorkerSettings()
    assert settings.torch_threads == {"toy": 1, "wan2.1-t2v-1.3b": 2}
    try:
        torch.set_num_threads(2)
        runner.use_torch_threads("toy", settings)
        assert torch.get_num_threads() == 1
        runner.use_torch_threads("tiny-random-wan", settings)  # not named: the process' own default
        assert torch.get_num_threads() == 2
        runner.use_torch_threads("toy", settings.model_copy(update={"device": "cuda"}))  # GPU: untouched
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_the_default_runs_the_toy_model_on_one_thread_and_rejects_zero(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert WorkerSettings().torch_threads == {"toy": 1}
    monkeypatch.setenv("CHORUS_TORCH_THREADS", '{"toy": 0}')
    with pytest.raises(ValidationError):
        WorkerSettings()
    monkeypatch.setenv("CHORUS_TORCH_THREADS", '{"tyo": 1}')  # a typo would silently run on the default
    with pytest.raises(ValidationError, match="unknown model"):
        WorkerSettings()
