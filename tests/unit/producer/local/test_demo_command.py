"""``chorus demo``'s checks before it starts anything (``producer.local.demo_command``)."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from producer.cli import app


def test_the_demo_refuses_an_output_path_that_is_a_file_before_it_starts_anything(tmp_path: Path) -> None:
    taken = tmp_path / "summary"
    taken.write_text("")
    result = CliRunner().invoke(app, ["demo", "--out", str(taken), "--state-dir", str(tmp_path / "state")])
    assert result.exit_code == 1 and "is a file: name a folder" in result.output
    assert not (tmp_path / "state").exists()  # refused before the stack (or its folder) existed
