"""Where a model comes from: a hub id or a local path, its config, its weight files, the data that ships.

Everything a notebook needs at run time ships inside the package (``helpers/data``: model configs
that work offline, the instruction set, evaluation prompts) and is found with
:mod:`importlib.resources`, so a wheel installed in Colab has it too.
"""

from __future__ import annotations

import json
import os
import re
import socket
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from .errors import OomkitError
from .session import in_colab, in_kaggle

__all__ = [
    "SourceError", "data_path", "shipped_configs", "shipped_config", "looks_like_path", "drive_hint",
    "nearest_existing", "persistent_path", "hub_offline_reason", "checkpoint_size", "memory_mapped", "read_json", "DRIVE_MOUNT",
    "weight_files", "hub_weight_files", "mount_drive", "DriveMount", "closest_shipped",
]  # fmt: skip

DRIVE_MOUNT = "from google.colab import drive; drive.mount('/content/drive')"
_HUB_PROBE_TIMEOUT_S = 3  # huggingface_hub itself retries for ~30 s before giving up


class SourceError(OomkitError, ValueError):
    """A file oomkit was pointed at cannot be read as what it should be."""


def data_path(name: str = "") -> Path:
    """Path of ``helpers/data/<name>`` (shipped with the package: configs, instructions, prompts); a name
    that is not there (or leads out of it) is a :class:`SourceError` listing what is."""
    root = Path(str(resources.files("helpers") / "data"))
    if not isinstance(name, str):
        raise SourceError(f"data_path() takes a file name in {root} such as 'eval_prompts.jsonl', got {name!r:.60}")
    if not name:
        return root
    path = root / name
    if Path(name).is_absolute() or ".." in Path(name).parts or not path.exists():
        shipped = ", ".join(sorted(p.name for p in root.iterdir() if not p.name.startswith(("_", "."))))
        raise SourceError(f"{name!r} is not in oomkit's data folder {root}; it holds: {shipped}")
    return path


def shipped_configs() -> dict[str, Path]:
    """Hub id -> path of every ``config.json`` shipped in ``helpers/data/configs`` (usable offline)."""
    return {p.stem.replace("--", "/", 1): p for p in sorted(data_path("configs").glob("*.json"))}


def no_config_help(model: str) -> str:
    """What to do when ``model``'s config.json cannot be read here (offline, and it does not ship)."""
    if not isinstance(model, str | os.PathLike):
        raise SourceError(f"no_config_help() takes the model's hub id or path, got {model!r:.60}")
    return (
        f"No estimate for {model!r}: its config.json cannot be read here (the 'model' line above says why).\n"
        "Set MODEL to a local folder holding config.json (or the config.json file itself), run this notebook "
        "online once, or pick a model whose config ships with oomkit and works offline:\n  "
        + "\n  ".join(shipped_configs())
    )


def shipped_config(name: str) -> Path | None:
    """The shipped config for a hub id or its short name (case-insensitive), or ``None``."""
    configs = shipped_configs()
    if name in configs:
        return configs[name]
    low = name.lower()
    return next((p for hub_id, p in configs.items() if low in (hub_id.lower(), hub_id.split("/")[-1].lower())), None)


def closest_shipped(name: str) -> str | None:
    """The shipped config's hub id that ``name`` most likely misspells ('meta-llama/Llama-2-7b-hff'), or
    ``None`` when none is close (an exact name is found by :func:`shipped_config`, not here)."""
    import difflib

    ids = list(shipped_configs())
    by_key = {i.lower(): i for i in ids} | {i.split("/")[-1].lower(): i for i in ids}
    found = difflib.get_close_matches(str(name).lower(), list(by_key), n=1, cutoff=0.85)
    return by_key[found[0]] if found else None


def read_json(path: Path, what: str = "JSON") -> Any:
    """Parse a JSON file; a file that is not UTF-8 or not JSON gets an error naming it."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise SourceError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); pass a {what} file") from None
    except json.JSONDecodeError as e:
        raise SourceError(f"{path} is not valid JSON ({e}); pass a {what} file") from None


DRIVE = Path("/content/drive/MyDrive")
KAGGLE_WORKING = Path("/kaggle/working")  # kept as the notebook's output when a session ends (20 GB at most)


def persistent_path(name: str | Path, *, default_dir: str | Path = ".") -> Path:
    """Where a file that must survive a Colab runtime reset goes: ``MyDrive/oomkit/<name>`` when Drive is
    mounted in Colab (files under /content vanish with the runtime), ``/kaggle/working/<name>`` on Kaggle
    (the one folder kept as the notebook's output), else ``default_dir/<name>``. An absolute ``name`` is
    kept as given."""
    for arg, value in (("name", name), ("default_dir", default_dir)):
        if not isinstance(value, str | os.PathLike) or not str(value).strip():
            raise SourceError(f"persistent_path(): {arg} must be a file or folder name, got {value!r:.60}")
    name = Path(name)
    if name.is_absolute():
        return name
    if in_colab() and DRIVE.exists():
        return DRIVE / "oomkit" / name
    if in_kaggle() and Path(default_dir) == Path("."):
        return KAGGLE_WORKING / name
    return Path(default_dir) / name


_DRIVE_ANSWERS: dict[str, str] = {}  # mount point -> why it was not mounted, once asked in this session


@dataclass
class DriveMount:
    """Whether Google Drive is mounted, and where files that must outlive the runtime go."""

    mounted: bool
    message: str

    def __str__(self) -> str:
        return self.message


def mount_drive(mount_point: str = "/content/drive", *, ask_again: bool = False) -> DriveMount:
    """Mount Google Drive in Colab, asking once per session; a refused or closed pop-up is not an error.

    Outside Colab, or once mounted, nothing is asked. When the pop-up is refused or closed (Colab
    raises ``MessageError``) the notebook goes on without Drive and the message says where files go
    instead; rerunning the cell does not ask again unless ``ask_again``.
    """
    here = f"files go to {Path.cwd()}"
    if not in_colab():
        return DriveMount(False, f"not in Colab: {here}")
    if Path(mount_point, "MyDrive").exists():
        return DriveMount(True, f"Google Drive is mounted: results and checkpoints go to {mount_point}/MyDrive/oomkit")
    if mount_point in _DRIVE_ANSWERS and not ask_again:
        return DriveMount(False, _DRIVE_ANSWERS[mount_point])
    try:
        from google.colab import drive

        drive.mount(mount_point)
    except Exception as e:  # noqa: BLE001 - MessageError (refused, closed, timed out) and whatever else Colab raises
        why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        _DRIVE_ANSWERS[mount_point] = (
            f"Google Drive is not mounted ({why}); going on without it: {here}, deleted with the runtime. "
            "To keep them, rerun with mount_drive(ask_again=True) and allow access"
        )
        return DriveMount(False, _DRIVE_ANSWERS[mount_point])
    return DriveMount(True, f"Google Drive is mounted: results and checkpoints go to {mount_point}/MyDrive/oomkit")


def looks_like_path(model: str) -> bool:
    """True for strings that can only be paths: absolute, ./, ../, ~, Windows drives, 3+ parts, file suffixes."""
    return (
        model.startswith(("/", "./", "../", "~", "\\"))
        or (len(model) > 1 and model[1] == ":")
        or model.count("/") >= 2
        or model.endswith((".safetensors", ".bin", ".json"))
    )


def drive_hint(path: str) -> str:
    """What to check on Colab when a path is missing (Drive not mounted, or a typo under MyDrive)."""
    if not in_colab() and not path.startswith("/content"):
        return ""
    if path.startswith("/content/drive") and not Path("/content/drive/MyDrive").exists():
        return f" Google Drive is not mounted: run `{DRIVE_MOUNT}` first."
    if path.startswith("/content/drive"):
        return " Google Drive is mounted: check the folder name under /content/drive/MyDrive (it is case-sensitive)."
    return (
        " Files under /content are deleted when the Colab runtime restarts; keep models and adapters on "
        f"Google Drive (`{DRIVE_MOUNT}`)."
    )


def nearest_existing(path: str | Path) -> str:
    """`` <folder> exists and holds: a, b, c.`` for the nearest existing parent of a missing path ('' at /)."""
    p = Path(path).expanduser()
    parent = next((q for q in p.parents if q.exists()), None)
    if parent is None or parent == Path("/") or not parent.is_dir():
        return ""
    names = sorted(c.name for c in parent.iterdir())[:8]
    return f" {parent.resolve()} exists and holds: {', '.join(names) or '(nothing)'}."


def hub_offline_reason() -> str | None:
    """Why the Hugging Face Hub cannot be asked (``HF_HUB_OFFLINE``, no network), or ``None`` if it answers.

    A socket probe of a few seconds: without a network huggingface_hub retries for ~30 s first."""
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return "HF_HUB_OFFLINE is set"
    url = urlparse(constants.ENDPOINT)
    host = url.hostname or "huggingface.co"
    # a mirror set with HF_ENDPOINT may listen on its own port, or speak plain http
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=_HUB_PROBE_TIMEOUT_S).close()
    except OSError as e:
        return f"{host} cannot be reached ({type(e).__name__})"
    return None


# The names transformers' from_pretrained looks for at a checkpoint's root, in the order it tries them
# (modeling_utils._get_resolved_checkpoint_files, no variant, no subfolder). Any other weight file in the
# folder (Mistral's consolidated.safetensors, an original/ folder of Meta weights) is never read, so it
# must not count towards the RAM and disk a load needs.
SAFE_WEIGHTS, SAFE_INDEX = "model.safetensors", "model.safetensors.index.json"
BIN_WEIGHTS, BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
WEIGHT_NAMES = (SAFE_WEIGHTS, SAFE_INDEX, BIN_WEIGHTS, BIN_INDEX)
# What save_pretrained names the shards an index lists (model-00001-of-00004.safetensors)
_SHARD = {
    SAFE_INDEX: re.compile(r"model-\d+-of-\d+\.safetensors"),
    BIN_INDEX: re.compile(r"pytorch_model-\d+-of-\d+\.bin"),
}


def _explicit_weights(folder: Path) -> str | None:
    """The file a config's ``transformers_weights`` names: transformers loads that one instead of the usual names."""
    try:
        name = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("transformers_weights")
    except (OSError, ValueError, AttributeError):  # no or unreadable config: the model check says so
        return None
    return name if isinstance(name, str) else None


def _index_shards(index: Path) -> list[str]:
    """The shard files a ``*.index.json`` maps weights to (each once, sorted)."""
    data = read_json(index, "weight index")
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
        raise SourceError(f"{index} has no weight_map of tensor names to shard files; download the checkpoint again")
    return sorted(set(weight_map.values()))


def _ignored(folder: Path) -> str:
    """`` (it holds a.safetensors, b.bin, which transformers does not load)`` for the weight files it skips."""
    names = sorted(f.name for pat in ("*.safetensors", "*.bin") for f in folder.glob(pat))
    return f" (it holds {', '.join(names[:4])}, which transformers does not load)" if names else ""


def weight_files(folder: str | Path) -> list[Path]:
    """The weight files ``from_pretrained`` reads from a local checkpoint folder, chosen by transformers' rules:
    the file ``config.json``'s ``transformers_weights`` names, else the first of ``model.safetensors``,
    ``model.safetensors.index.json``, ``pytorch_model.bin``, ``pytorch_model.bin.index.json`` that exists;
    an index stands for the shards its ``weight_map`` lists. Other weight files are ignored, as transformers
    ignores them. Raises :class:`SourceError` when transformers would find no weights or a listed shard is missing.
    """
    folder = Path(folder).expanduser()
    names = [explicit] if (explicit := _explicit_weights(folder)) else WEIGHT_NAMES
    chosen = next((folder / n for n in names if (folder / n).is_file()), None)
    if chosen is None:
        raise SourceError(f"none of {', '.join(names)} is in {folder}{_ignored(folder)}: transformers would not "
                          "find the weights; pass the folder save_pretrained wrote")  # fmt: skip
    if not chosen.name.endswith(".index.json"):
        return [chosen]
    shards = [folder / s for s in _index_shards(chosen)]
    missing = [s.name for s in shards if not s.is_file()]
    if missing:
        raise SourceError(f"{chosen.name} lists {', '.join(missing[:3])}, missing from {folder}: the download is "
                          "incomplete; download the checkpoint again")  # fmt: skip
    return shards


def _local_sizes(path: Path) -> tuple[int | None, int | None, str]:
    try:
        files = weight_files(path) if path.is_dir() else [path]
    except SourceError as e:
        return None, None, str(e)
    sizes = [f.stat().st_size for f in files]
    kind = "safetensors" if all(f.suffix == ".safetensors" for f in files) else ".bin"
    return sum(sizes), max(sizes), f"local {kind} files"


def hub_weight_files(names: list[str]) -> list[str]:
    """Of a hub repo's file names, the weight files ``from_pretrained`` downloads, by the same rules as
    :func:`weight_files`: without downloading the index, the shards are the root-level files named as
    save_pretrained names them (``model-00001-of-00003.safetensors``). Files in subfolders and other
    names (``consolidated.safetensors``) are ignored. Raises :class:`SourceError` when none would be loaded."""
    root = {n for n in names if "/" not in n}
    chosen = next((n for n in WEIGHT_NAMES if n in root), None)
    if chosen is None:
        raise SourceError(f"the hub lists none of {', '.join(WEIGHT_NAMES)} at the repo's root: transformers "
                          "would not find the weights")  # fmt: skip
    if chosen not in _SHARD:
        return [chosen]
    shards = sorted(n for n in root if _SHARD[chosen].fullmatch(n))
    if not shards:
        raise SourceError(f"the hub lists {chosen} but no shards named like {_SHARD[chosen].pattern}; "
                          "download the checkpoint and pass its local folder to measure it")  # fmt: skip
    return shards


def memory_mapped(source: str) -> bool:
    """Whether a checkpoint (by :func:`checkpoint_size`'s source) is safetensors, which transformers reads
    through a memory map: file pages the kernel can drop, not memory the process holds."""
    return "safetensors" in source


def checkpoint_size(model: str) -> tuple[int | None, int | None, str]:
    """``(total_bytes, largest_file_bytes, source)`` of a checkpoint's weight files.

    Local directories are measured on disk; hub ids ask the hub for file sizes (no download).
    Returns ``(None, None, reason)`` when it cannot be known (offline, private model).
    """
    path = Path(model).expanduser()
    if path.exists():
        return _local_sizes(path)
    if looks_like_path(model):  # asking the hub would only say it is not a valid repo id
        return None, None, f"{model} does not exist; check the path (on Colab: is Drive mounted?)"
    try:
        from huggingface_hub import HfApi

        info = HfApi().model_info(model, files_metadata=True, timeout=10)
    except Exception as e:
        return None, None, f"could not ask the hub ({type(e).__name__}); pass a local path to measure it"
    return _hub_sizes({s.rfilename: s.size for s in info.siblings or []})


def _hub_sizes(listing: dict[str, int | None]) -> tuple[int | None, int | None, str]:
    """Sizes of the files :func:`hub_weight_files` picks from a hub listing (file name -> bytes)."""
    try:
        files = hub_weight_files(list(listing))
    except SourceError as e:
        return None, None, str(e)
    sizes = [listing[f] for f in files]
    if None in sizes:
        return None, None, f"the hub gives no size for {', '.join(f for f in files if listing[f] is None)}"
    kind = "safetensors" if files[0].endswith(".safetensors") else ".bin"
    return sum(sizes), max(sizes), f"hub {kind} files"
