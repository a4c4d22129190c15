"""``chorus demo``'s checks before it starts anything (``producer.local.demo_command``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from producer.cli import app


def test_the_demo_refuses_an_output_path_that_is_a_file_before_it_starts_anything(tmp_path: Path) -> None:
    taken = tmp_path / "summary"
    taken.write_text("")
    result = CliRunner().invoke(app, ["demo", "--out", str(taken), "--state-dir", str(tmp_path / "state")])
    assert result.exit_code == 1 and "is a file: name a folder" in result.output
    assert not (tmp_path / "state").exists()  # refused before the stack (or its folder) existed


def test_the_demo_refuses_a_model_its_worker_could_not_load_before_it_starts_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path / "state"
    monkeypatch.setenv("CHORUS_TOY_WEIGHTS_DIR", str(tmp_path / "no-weights"))
    result = CliRunner().invoke(app, ["demo", "--state-dir", str(state)])
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and str(tmp_path / "no-weights") in said and "CHORUS_TOY_WEIGHTS_DIR" in said
    assert "chorus demo --model tiny-random-wan" in said and "Traceback" not in said

    monkeypatch.delenv("CHORUS_WAN21_DIR", raising=False)
    result = CliRunner().invoke(app, ["demo", "--model", "wan2.1-t2v-1.3b", "--state-dir", str(state)])
    assert result.exit_code == 2 and "CHORUS_WAN21_DIR" in " ".join(result.output.split())
    assert not state.exists()  # refused before the stack (or its folder) existed


def test_a_demo_on_a_state_folder_another_stack_holds_says_so_before_its_header(tmp_path: Path) -> None:
    from producer.local.state_lock import StateFolderLock

    state = tmp_path / "state"
    held = StateFolderLock(state)
    held.acquire()  # as a running `chorus demo --keep-running` holds it
    try:
        result = CliRunner().invoke(app, ["demo", "--model", "tiny-random-wan", "--state-dir", str(state)])
    finally:
        held.release()
    said = " ".join(result.output.split())
    assert result.exit_code != 0 and "in use by another Chorus stack" in said
    assert "(fresh)" not in said and "state in" not in said  # no header describing a state it cannot use


def test_a_state_folder_whose_lock_cannot_be_opened_is_one_line(tmp_path: Path) -> None:
    from producer.local.state_lock import LOCK_NAME

    state = tmp_path / "state"
    (state / LOCK_NAME).mkdir(parents=True)  # not a file: it cannot be opened
    result = CliRunner().invoke(app, ["demo", "--model", "tiny-random-wan", "--state-dir", str(state)])
    said = " ".join(result.output.split())
    assert result.exit_code == 1 and "cannot use the state folder" in said
    assert result.exception is None or isinstance(result.exception, SystemExit)  # no traceback
