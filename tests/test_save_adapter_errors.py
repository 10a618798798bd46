"""save_adapter on a read-only or full disk: one clear error, no '.saving' folder left (issue 31 item 4)."""

from __future__ import annotations

import errno

import pytest

from helpers import save_adapter
from helpers.training.adapters import AdapterSaveError


class _Adapter:
    """A PEFT model stand-in whose save writes part of a file, then fails as the disk does."""

    peft_config = {"default": None}

    def __init__(self, code: int):
        self.code = code

    def save_pretrained(self, folder):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "adapter_model.safetensors").write_bytes(b"partial")
        raise OSError(
            self.code, {errno.EROFS: "Read-only file system", errno.ENOSPC: "No space left on device"}[self.code]
        )


@pytest.mark.parametrize("code", [errno.EROFS, errno.ENOSPC])
def test_a_failed_save_says_why_and_leaves_nothing_half_written(tmp_path, code):
    target = tmp_path / "adapter"
    with pytest.raises(AdapterSaveError, match=r"could not save the adapter to .*adapter.*nothing was written") as e:
        save_adapter(_Adapter(code), target)
    assert isinstance(e.value, OSError) and "writable folder" in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no adapter.saving, no adapter


def test_an_earlier_adapter_survives_a_failed_save(tmp_path):
    target = tmp_path / "adapter"
    target.mkdir()
    (target / "adapter_model.safetensors").write_bytes(b"good")
    with pytest.raises(AdapterSaveError, match="already there is untouched"):
        save_adapter(_Adapter(errno.ENOSPC), target)
    assert (target / "adapter_model.safetensors").read_bytes() == b"good"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]
