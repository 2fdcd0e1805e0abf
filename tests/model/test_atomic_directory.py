"""`atomic_directory`: a save lands whole or not at all and never clobbers what it did not write."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxllm.model import checkpoint
from jaxllm.model.checkpoint import atomic_directory


def snapshot(root: Path) -> dict[str, str | None]:
    """Every path under `root` -> its text (None for a directory)."""
    return {
        str(p.relative_to(root)): None if p.is_dir() else p.read_text()
        for p in sorted(root.rglob("*"))
    }


def write(directory: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text(text)


@pytest.fixture
def user_directory(tmp_path) -> Path:
    """A directory of a user's files: a config, a notes file and a params folder."""
    path = tmp_path / "model"
    write(path, {"config.json": "old config", "notes.txt": "mine", "params/a": "old a"})
    return path


@pytest.mark.parametrize("existing", ["missing", "empty"])
def test_the_directory_appears_whole_on_success(tmp_path, existing):
    path = tmp_path / "parent" / "model"
    if existing == "empty":
        path.mkdir(parents=True)

    with atomic_directory(path) as staging:
        assert staging.parent == path.parent and staging != path
        write(staging, {"config.json": "new", "params/a": "1"})
        assert not (path / "config.json").exists()  # nothing is visible before the end

    assert snapshot(path) == {"config.json": "new", "params": None, "params/a": "1"}
    assert [p.name for p in path.parent.iterdir()] == ["model"]  # no temporary left behind


def test_a_non_empty_directory_is_refused_before_anything_is_written(user_directory):
    before = snapshot(user_directory.parent)
    entered = False

    with (
        pytest.raises(ValueError, match=r"not empty.*overwrite=True"),
        atomic_directory(user_directory),
    ):
        entered = True

    assert not entered
    assert snapshot(user_directory.parent) == before


def test_a_file_is_refused_even_with_overwrite(tmp_path):
    (tmp_path / "model").write_text("a file")

    with (
        pytest.raises(ValueError, match="not a directory"),
        atomic_directory(tmp_path / "model", overwrite=True),
    ):
        pass

    assert snapshot(tmp_path) == {"model": "a file"}


def test_overwrite_replaces_only_the_entries_it_wrote(user_directory):
    with atomic_directory(user_directory, overwrite=True) as staging:
        write(staging, {"config.json": "new config", "params/b": "new b", "tokenizer.json": "t"})

    assert snapshot(user_directory) == {
        "config.json": "new config",
        "notes.txt": "mine",  # not written: kept
        "params": None,  # replaced whole: the old params/a is gone
        "params/b": "new b",
        "tokenizer.json": "t",
    }
    assert [p.name for p in user_directory.parent.iterdir()] == ["model"]


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("overwrite", [False, True])
def test_an_exception_leaves_the_directory_as_it_was(tmp_path, user_directory, error, overwrite):
    path = user_directory if overwrite else tmp_path / "new"
    before = snapshot(tmp_path)

    with pytest.raises(error), atomic_directory(path, overwrite=overwrite) as staging:
        write(staging, {"config.json": "half written"})
        raise error

    assert snapshot(tmp_path) == before


def test_an_interrupted_overwrite_puts_back_what_it_moved(user_directory, monkeypatch):
    before = snapshot(user_directory.parent)
    rename, interrupted = Path.rename, []

    def interrupted_rename(self, target):
        if self.name == "params" and Path(target).parent == user_directory and not interrupted:
            interrupted.append(self)
            raise KeyboardInterrupt  # config.json is already moved in, the old params aside
        return rename(self, target)

    with (
        pytest.raises(KeyboardInterrupt),
        atomic_directory(user_directory, overwrite=True) as staging,
    ):
        write(staging, {"config.json": "new config", "params/b": "new b"})
        monkeypatch.setattr(Path, "rename", interrupted_rename)

    monkeypatch.undo()
    assert interrupted  # the interruption happened mid-way
    assert snapshot(user_directory.parent) == before


def test_a_directory_filled_while_saving_is_not_clobbered(tmp_path):
    path = tmp_path / "model"

    with pytest.raises(ValueError, match="not empty"), atomic_directory(path) as staging:
        write(staging, {"config.json": "new"})
        write(path, {"config.json": "someone else's"})

    assert snapshot(tmp_path) == {"model": None, "model/config.json": "someone else's"}


def test_save_params_and_load_through_an_atomic_directory(tmp_path):
    from support.inputs import small_config

    from jaxllm.model.qwen3 import init_params

    config = small_config()
    params = init_params(config, seed=0)
    path = tmp_path / "saved"

    with atomic_directory(path) as staging:
        checkpoint.save_params(staging, config, params)

    loaded_config, loaded = checkpoint.load_params(path)
    assert loaded_config == config
    assert (loaded["embed"] == params["embed"]).all()
    assert sorted(p.name for p in path.iterdir()) == sorted(
        [checkpoint.CONFIG_FILE, checkpoint.MANIFEST_FILE, checkpoint.PARAMS_DIR]
    )
