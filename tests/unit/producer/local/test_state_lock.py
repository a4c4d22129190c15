"""One embedded stack per state folder (``producer.local.state_lock``), and ``--fresh`` never wipes a folder a
running stack holds (``producer.local.stack.wipe_state``). Other holders are real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from producer.local.config import StackError
from producer.local.stack import wipe_state
from producer.local.state_lock import LOCK_NAME, StateFolderLock

HOLD = """
import sys, time
from pathlib import Path
from producer.local.state_lock import StateFolderLock
lock = StateFolderLock(Path(sys.argv[1]))  # kept: the lock lives as long as its file
lock.acquire()
print("held", flush=True)
time.sleep(60)
"""


def _holder(folder: Path) -> subprocess.Popen[str]:
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "held"
    return process


def test_a_second_stack_on_a_held_folder_is_refused_naming_the_holder(tmp_path: Path) -> None:
    holder = _holder(tmp_path)
    try:
        with pytest.raises(StackError, match=rf"in use by another Chorus stack \(pid {holder.pid}\)"):
            StateFolderLock(tmp_path).acquire()
        assert StateFolderLock(tmp_path).held_elsewhere()
        assert (tmp_path / LOCK_NAME).read_text().strip() == str(
            holder.pid
        )  # looking leaves the holder named
    finally:
        holder.kill()
        holder.wait()
    # the kernel drops the lock with its process, however it ended: no stale lock to clean by hand
    lock = StateFolderLock(tmp_path)
    assert not lock.held_elsewhere()
    lock.acquire()
    assert (tmp_path / LOCK_NAME).read_text().strip() == str(os.getpid())
    lock.release()


def test_a_released_folder_can_be_taken_again_in_the_same_process(tmp_path: Path) -> None:
    first, second = StateFolderLock(tmp_path), StateFolderLock(tmp_path)
    first.acquire()
    with pytest.raises(StackError):
        second.acquire()  # a second stack object in this process is refused too
    first.release()
    second.acquire()
    second.release()


def test_fresh_never_wipes_the_folder_of_a_running_stack(tmp_path: Path) -> None:
    state = tmp_path / "state"
    (state / "logs").mkdir(parents=True)
    holder = _holder(state)
    try:
        with pytest.raises(StackError, match="state folder of a running Chorus stack"):
            wipe_state(state)
        assert (state / "logs").is_dir()
    finally:
        holder.kill()
        holder.wait()
    deadline = time.monotonic() + 5
    while StateFolderLock(state).held_elsewhere() and time.monotonic() < deadline:
        time.sleep(0.05)
    wipe_state(state)
    assert not state.exists()


def test_a_folder_that_cannot_be_made_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(StackError, match=f"cannot use the state folder {blocker / 'state'}"):
        StateFolderLock(blocker / "state").acquire()
