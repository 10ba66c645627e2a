"""Atomic writes and output checks: what a reader or a failing writer leaves behind."""

import os
import stat

import pytest

from megatron_dynapipe.files import atomic_path, check_output_file, write_atomically


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "summary.json"
    write_atomically(target, "old\n")
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half of the new")
            raise RuntimeError("the writer fails")
    assert target.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_the_temporary_keeps_the_suffix_for_tools_that_pick_a_format_by_it(tmp_path):
    with atomic_path(tmp_path / "plot.svg") as tmp:
        assert tmp.suffix == ".svg" and tmp.parent == tmp_path and tmp.name.startswith(".")
        tmp.write_bytes(b"<svg/>")
    assert (tmp_path / "plot.svg").read_bytes() == b"<svg/>"


def test_bytes_and_text_and_new_folders(tmp_path):
    old = os.umask(0o027)
    try:
        path = write_atomically(tmp_path / "a" / "b.bin", b"\x00\x01")
    finally:
        os.umask(old)
    assert path.read_bytes() == b"\x00\x01" and stat.S_IMODE(path.stat().st_mode) == 0o640
    assert write_atomically(tmp_path / "t.txt", "é").read_text(encoding="utf-8") == "é"


def test_output_checks(tmp_path):
    assert check_output_file(tmp_path / "new" / "deeper" / "x.png", "--gantt", (".png",)).name == "x.png"
    with pytest.raises(ValueError, match="is a folder"):
        check_output_file(tmp_path, "--gantt", (".png",))
    with pytest.raises(ValueError, match="end the name with one of .png"):
        check_output_file(tmp_path / "x.jpg", "--gantt", (".png",))
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is not a writable folder"):
        check_output_file(tmp_path / "file" / "x.png", "--gantt", (".png",))


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc, a folder no one can create files in")
def test_a_place_that_refuses_files_is_refused_before_the_work_whatever_permissions_say(tmp_path):
    """Root passes every permission check, and /proc's permissions do not say it takes no files:
    a file is tried there, so the command refuses at once instead of failing after its work."""
    with pytest.raises(ValueError, match=r"--output /proc/out\.json cannot be written \(/proc: .*\): choose another"):
        check_output_file("/proc/out.json", "--output", (".json",))
    assert check_output_file(tmp_path / "new" / "out.json", "--output", (".json",))  # a writable place passes
    assert not list(tmp_path.iterdir())  # and keeps nothing of the try
