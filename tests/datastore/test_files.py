"""datastore/files.py: the one atomic writer of files and directories."""

import pytest

from echospec.datastore.files import atomic_dir, atomic_file


def test_atomic_file_replaces_whole_or_not_at_all(tmp_path):
    target = tmp_path / "report.json"
    with atomic_file(target) as f:
        f.write("first")
    assert target.read_text() == "first" and oct(target.stat().st_mode & 0o777) == "0o644"
    with pytest.raises(RuntimeError):
        with atomic_file(target) as f:
            f.write("half")
            raise RuntimeError("interrupted")
    assert target.read_text() == "first"
    with atomic_file(target, "wb") as f:
        f.write(b"second")
    assert target.read_bytes() == b"second"
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_atomic_dir_swaps_in_a_whole_directory_or_leaves_the_old_one(tmp_path):
    target = tmp_path / "parent" / "model"
    with atomic_dir(target) as tmp:
        assert tmp.parent == target.parent and not any(tmp.iterdir())
        (tmp / "weights").write_text("v1")
    assert (target / "weights").read_text() == "v1" and oct(target.stat().st_mode & 0o777) == "0o755"
    with pytest.raises(KeyboardInterrupt):
        with atomic_dir(target) as tmp:
            (tmp / "weights").write_text("half")
            raise KeyboardInterrupt
    assert [p.name for p in target.iterdir()] == ["weights"] and (target / "weights").read_text() == "v1"
    with atomic_dir(target) as tmp:
        (tmp / "config").write_text("v2")
    assert [p.name for p in target.iterdir()] == ["config"]  # replaced whole, not merged
    assert [p.name for p in target.parent.iterdir()] == ["model"]  # no temporary or old copy left behind
