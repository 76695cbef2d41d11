"""``write_atomic``: the old file or the new one, never a part, and no temporary file left,
whatever fails half-way (a full disk, Ctrl-C, a folder that is not there)."""

from __future__ import annotations

import errno
import os
import signal
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from autopar_plans import Estimate, MemoryBreakdown, MeshSpec, Parallelism, Plan
from autopar_plans import writes as writes_module
from autopar_plans.errors import UsageError
from autopar_plans.io import load_plan, save_plan
from autopar_plans.writes import TEMP_SUFFIX, write_atomic


@pytest.fixture
def old(tmp_path: Path) -> Path:
    path = tmp_path / "plan.json"
    path.write_text("the old file\n")
    return path


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(TEMP_SUFFIX))


def failing(error: BaseException) -> Callable[[int], None]:
    """An ``os.fsync`` that fails: the data is written but not yet renamed."""

    def fsync(fd: int) -> None:
        raise error

    return fsync


def test_writes_text_and_bytes(tmp_path: Path):
    assert write_atomic(tmp_path / "a.txt", "héllo\n") == tmp_path / "a.txt"
    write_atomic(tmp_path / "b.png", b"\x89PNG\0")
    assert (tmp_path / "a.txt").read_text(encoding="utf-8") == "héllo\n"
    assert (tmp_path / "b.png").read_bytes() == b"\x89PNG\0"
    assert leftovers(tmp_path) == []


def test_replaces_the_old_file_and_keeps_its_permissions(old: Path):
    old.chmod(0o640)
    write_atomic(old, "new")
    assert old.read_text() == "new"
    assert stat.S_IMODE(old.stat().st_mode) == 0o640


def test_a_new_file_gets_the_usual_permissions(tmp_path: Path):
    mask = os.umask(0o022)
    try:
        write_atomic(tmp_path / "new.json", "{}")
    finally:
        os.umask(mask)
    assert stat.S_IMODE((tmp_path / "new.json").stat().st_mode) == 0o644


def test_a_full_disk_half_way_leaves_the_old_file_and_no_temporary(
    old: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(writes_module.os, "fsync", failing(OSError(errno.ENOSPC, "full")))
    with pytest.raises(UsageError) as caught:
        write_atomic(old, "x" * 100_000)
    assert str(caught.value) == (
        f"cannot write {old}: no space left on the device; the old file is unchanged"
    )
    assert old.read_text() == "the old file\n"
    assert leftovers(old.parent) == []


def test_an_interrupt_half_way_leaves_the_old_file_and_no_temporary(
    old: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(writes_module.os, "fsync", failing(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        write_atomic(old, "new")
    assert old.read_text() == "the old file\n"
    assert leftovers(old.parent) == []


@pytest.fixture
def sigint_raises() -> Iterator[None]:
    """Python's own Ctrl-C handler, whatever the test runner set."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_ctrl_c_during_the_write_lands_after_the_rename(
    old: Path, monkeypatch: pytest.MonkeyPatch, sigint_raises: None
):
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        os.kill(os.getpid(), signal.SIGINT)  # held back until the file is in place
        real_fsync(fd)

    monkeypatch.setattr(writes_module.os, "fsync", fsync)
    with pytest.raises(KeyboardInterrupt):
        write_atomic(old, "new")
    assert old.read_text() == "new"
    assert leftovers(old.parent) == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back


def test_a_folder_that_does_not_exist(tmp_path: Path):
    target = tmp_path / "nonexistent" / "dir" / "plan.json"
    with pytest.raises(UsageError) as caught:
        write_atomic(target, "{}")
    assert str(caught.value) == (
        f"cannot write {target}: the folder {target.parent} does not exist"
    )


def test_a_folder_in_place_of_the_file(tmp_path: Path):
    with pytest.raises(UsageError, match="it is a folder; give a file name"):
        write_atomic(tmp_path, "{}")


def test_a_file_in_place_of_a_folder(old: Path):
    with pytest.raises(UsageError, match="is a file, not a folder"):
        write_atomic(old / "plan.json", "{}")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes anywhere")
def test_a_read_only_folder(old: Path):
    old.parent.chmod(0o500)
    try:
        with pytest.raises(UsageError, match="permission denied"):
            write_atomic(old, "new")
    finally:
        old.parent.chmod(0o700)
    assert old.read_text() == "the old file\n"
    assert leftovers(old.parent) == []


def test_a_symbolic_link_is_followed(old: Path):
    link = old.parent / "link.json"
    link.symlink_to(old)
    write_atomic(link, "new")
    assert link.is_symlink()
    assert old.read_text() == "new"


def test_save_plan_that_fails_leaves_the_old_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    def plan_on(shape: tuple[int, ...]) -> Plan:
        return Plan(
            model="m",
            mesh=MeshSpec(shape),
            global_batch=1,
            microbatch_size=1,
            parallelism=Parallelism(),
            estimate=Estimate(
                step_time_s=1.0,
                flops_per_step=1.0,
                mfu=0.5,
                comm_bytes_per_step=0.0,
                memory_per_device_bytes=MemoryBreakdown(),
            ),
            params={},
            ops={},
        )

    for name in ("plan.json", "plan.yaml"):
        path = tmp_path / name
        save_plan(plan_on((2,)), path)
        monkeypatch.setattr(writes_module.os, "fsync", failing(OSError(errno.EIO, "I/O error")))
        with pytest.raises(UsageError, match=f"cannot write {path}: I/O error"):
            save_plan(plan_on((4,)), path)
        monkeypatch.undo()
        assert load_plan(path).mesh.shape == (2,)
    assert leftovers(tmp_path) == []
