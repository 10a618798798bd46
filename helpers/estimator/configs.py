"""Resolve what the user named (hub id, shipped config, folder, config.json, config, model) to a config."""

from __future__ import annotations

import copy
import functools
import os
import re
import textwrap
from pathlib import Path
from typing import Any

import torch

from ..core.compat import library_notes_silenced
from ..core.sources import (
    NetError,
    SourceError,
    closest_shipped,
    data_path,
    drive_hint,
    hub_offline_reason,
    looks_like_path,
    nearest_existing,
    read_json,
    shipped_config,
    shipped_configs,
)
from .hub_headers import read_hub_json
from .rows import EstimateError

__all__ = ["resolve_config", "hub_repo", "config_from_dict", "check_config_values", "MAX_LAYERS", "MAX_DIMENSION",
           "base_shipped", "suggest_shipped", "model_size", "CONFIG_NOTES"]  # fmt: skip

# What transformers logs while it builds a config oomkit reads for the user: transformers 5.x says "`rope_parameters`'s
# high_freq_factor field must be greater than low_freq_factor" of the shipped Llama-4-Scout config (Meta's own file
# states 1.0 and 1.0), under fits_table and fit() whenever they try the shipped configs as smaller models. A note on
# the library's parsing of a published file that the user can neither act on nor avoid; silenced where a config is
# built (the parse is cached per file, so a repeated estimate pays nothing for it).
CONFIG_NOTES = (r"`rope_parameters`'s \w+ field must",)

# The sizes a config.json states, by their names across architectures (text_config's too). Each must be a
# whole number >= 1; a hostile or broken file (a negative width, 10**12 layers, "32" as text) is refused
# here, before transformers or the meta-device build see it (10**12 layers would never finish building).
SIZE_FIELDS = (
    "num_hidden_layers", "n_layer", "num_layers", "hidden_size", "n_embd", "d_model", "num_attention_heads",
    "n_head", "num_key_value_heads", "intermediate_size", "ffn_dim", "n_inner", "vocab_size", "head_dim",
    "max_position_embeddings", "n_positions", "num_local_experts", "num_experts",
)  # fmt: skip
LAYER_FIELDS = ("num_hidden_layers", "n_layer", "num_layers")
MAX_LAYERS = 2048  # the deepest published LMs have under 200 layers
MAX_DIMENSION = 2**27  # widths, vocabularies and context lengths: the largest real ones are under 2**24


def _torch_dtype_ok(value: Any) -> bool:
    if value is None or value == "auto" or isinstance(value, torch.dtype):
        return True
    return isinstance(value, str) and isinstance(getattr(torch, value.removeprefix("torch."), None), torch.dtype)


def check_config_values(d: dict, where: str) -> None:
    """Refuse a config whose sizes are not whole numbers in range or whose dtype torch does not know,
    naming the field, its value and what to do: the one sanity check of every config oomkit reads."""
    fix = f"fix {where} (a model's config.json states positive whole numbers) or pass another model"
    for key in SIZE_FIELDS:
        if key not in d or (d[key] is None and key != "num_hidden_layers"):  # null: the default applies
            continue
        value, top = d[key], MAX_LAYERS if key in LAYER_FIELDS else MAX_DIMENSION
        if isinstance(value, bool) or not isinstance(value, int):
            raise EstimateError(f"{key} in {where} is {value!r} ({type(value).__name__}), not a whole number; {fix}")
        if not 1 <= value <= top:
            raise EstimateError(f"{key} in {where} is {value!r}, outside 1..{top:,}; {fix}")
    for key in ("torch_dtype", "dtype"):
        if not _torch_dtype_ok(d.get(key)):
            raise EstimateError(
                f"{key} in {where} is {d[key]!r}, not a torch dtype; use a name such as 'float16', 'bfloat16' or "
                f"'float32' (or remove it), or pass another model"
            )
    if "model_type" in d and not isinstance(d["model_type"], str):
        raise EstimateError(f"model_type in {where} is {d['model_type']!r}, not a name such as 'llama'; {fix}")
    _check_shape(d, where)
    if isinstance(d.get("text_config"), dict):
        check_config_values(d["text_config"], f"{where} (text_config)")


def _first(d: dict, *keys: str) -> tuple[str | None, Any]:
    key = next((k for k in keys if isinstance(d.get(k), int) and not isinstance(d.get(k), bool)), None)
    return key, d.get(key) if key else None


def _check_shape(d: dict, where: str) -> None:
    """Sizes that must agree with each other, which some config classes accept and the model then cannot
    run (Qwen2 takes 13 heads for a width of 896; any class takes 5 KV heads for 32 query heads)."""
    fix = f"fix {where} (copy the model's config.json from its hub page) or pass another model"
    heads_key, heads = _first(d, "num_attention_heads", "n_head")
    width_key, width = _first(d, "hidden_size", "n_embd", "d_model")
    if heads and width and d.get("head_dim") is None and width % heads:
        raise EstimateError(f"{width_key} {width} in {where} is not a multiple of {heads_key} {heads} (and no head_dim "
                            f"is given): each head would be {width / heads:.2f} wide; {fix}")  # fmt: skip
    kv_key, kv = _first(d, "num_key_value_heads", "num_kv_heads")
    if heads and kv and heads % kv:
        raise EstimateError(f"{kv_key} {kv} in {where} does not divide {heads_key} {heads}: each key/value head "
                            f"serves a whole group of query heads ({heads} heads take {_divisors(heads)}); {fix}")  # fmt: skip
    k_key, k = _first(d, "num_experts_per_tok", "experts_per_token", "moe_topk", "num_experts_per_token")
    n_key, n = _first(d, "num_local_experts", "num_experts", "n_routed_experts")
    if k and n and k > n:
        raise EstimateError(f"{k_key} {k} in {where} is more than {n_key} {n}: a token cannot be routed to more "
                            f"experts than the layer has; {fix}")  # fmt: skip


def _divisors(n: int) -> str:
    found = [i for i in range(1, min(n, 4096) + 1) if n % i == 0]
    return ", ".join(map(str, found[:-1])) + f" or {found[-1]}" if len(found) > 1 else str(found[0])


def _rejected(e: Exception, d: dict, where: str, model_type: str) -> EstimateError:
    """One EstimateError for a config transformers' validation refuses (huggingface_hub's strict dataclass
    errors, a ValueError or KeyError from the config's __init__): the field, its value and the fix."""
    cause = e.__cause__ or e  # a strict dataclass error wraps the validator's own
    reason = " ".join(str(cause).strip("'\" ").split()) or type(cause).__name__
    named = re.search(r"field '(\w+)'", str(e))
    spaced = reason.replace(" ", "_").lower()  # "The hidden size (4096) is not ..." names hidden_size
    keys = sorted((k for k in d if k in reason or k.lower() in spaced), key=len, reverse=True)
    field = named.group(1) if named else (keys[0] if keys else None)
    if field is None and "rope_parameters" in reason:
        field = "rope_parameters"
    if field == "rope_parameters" and "rope_parameters" not in d and "rope_scaling" in d:
        field = "rope_scaling"  # transformers 5 reads rope_scaling into rope_parameters
    value = f"{field}={d[field]!r} " if field in d else (f"{field} " if field else "")
    return EstimateError(
        f"{value}in {where} is rejected by transformers' {model_type} config ({type(cause).__name__}: "
        f"{reason[:200]}); fix {field or 'that field'} (copy the model's config.json from its hub page) or pass "
        "another model"
    )


def _missing_width(config, d: dict, where: str) -> None:
    """A text config without its width would be counted at its class's default width (4096 for Qwen2)."""
    if config.get_text_config() is not config or not hasattr(config, "hidden_size"):
        return
    alias = getattr(type(config), "attribute_map", {}).get("hidden_size", "hidden_size")
    # the spellings config classes take in __init__ without an attribute_map entry (BLOOM's n_embed, ...)
    spellings = {"hidden_size", alias, "n_embed", "n_embd", "d_model", "dim", "hidden_dim", "model_dim", "embed_dim"}
    if not spellings & set(d):
        raise EstimateError(
            f"{where} has no {alias}: transformers would take its default ({config.hidden_size}) and the count would "
            f"be another model's; pass the model's full config.json (with {alias})"
        )


def config_from_dict(d: dict, where: str):
    """A transformers config for a config.json dict; an unknown or missing ``model_type`` gives a
    generic config (counted from its dimensions, marked approximate) instead of an error."""
    import transformers
    from transformers import AutoConfig, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    check_config_values(d, where)
    written = d.get("transformers_version")
    d = {k: v for k, v in d.items() if k not in ("transformers_version", "_name_or_path")}
    model_type = d.pop("model_type", None)
    why = None
    if model_type is None:
        why = f"{where} has no 'model_type' field, so the architecture is unknown"
    elif model_type not in CONFIG_MAPPING:
        why = f"model_type {model_type!r} in {where} is not known to transformers {transformers.__version__}"
        why += f" (pip install -U 'transformers>={written}', the version that wrote it)" if written else ""
    else:
        try:
            # a deep copy: transformers rewrites nested dicts (rope_scaling) in place, and they are the caller's
            with library_notes_silenced(*CONFIG_NOTES):
                config = AutoConfig.for_model(model_type, **copy.deepcopy(d))
        except Exception as e:  # noqa: BLE001 - every refusal of the config's own validation, named below
            raise _rejected(e, d, where, model_type) from None
        _missing_width(config, d, where)
        return config
    with library_notes_silenced(*CONFIG_NOTES):
        config = PretrainedConfig(**d)
    config.oomkit_unknown = why
    return config


def _from_file(path: Path, name: str):
    stat = path.stat()
    config, named = _parsed(str(path), stat.st_mtime_ns, stat.st_size)
    label = name if path.name != "config.json" else str(path.parent)
    # a copy: callers may set attributes on it, and the next estimate must start from the file
    return copy.deepcopy(config), named or label, None


@functools.lru_cache(maxsize=64)
def _parsed(path: str, mtime_ns: int, size: int):
    """A config file's config and ``_name_or_path``, parsed once per version of the file: the panels and
    ``fit()`` re-estimate the same model for every slider move and suggestion (0.6 ms a parse, 26 a move)."""
    try:
        d = read_json(Path(path), "config.json")
    except SourceError as e:
        raise EstimateError(str(e)) from None
    if not isinstance(d, dict):
        raise EstimateError(f"{path} holds a JSON {type(d).__name__}, not a config object; pass a model's config.json")
    return config_from_dict(d, path), d.get("_name_or_path")


def _missing(name: str) -> EstimateError:
    # a hub lookup would only add "Repo id must be in the form 'namespace/repo_name'"
    return EstimateError(
        f"{name} does not exist.{nearest_existing(name)}{drive_hint(name)} Pass an existing model folder (with "
        "config.json) or its config.json, a hub id such as 'org/name', or a shipped config name"
    )


# an instruction-tuned or chat id's suffix: the model it was tuned from has its architecture and size
_TUNED = re.compile(r"[-_](instruct|chat|it)(?=$|[-_])", re.IGNORECASE)
_SIZE = re.compile(r"(?<![\d.])(\d+(?:\.\d+)?)\s*b(?![a-z])", re.IGNORECASE)


def model_size(name: str) -> str | None:
    """The parameter count a hub id states (``"7"`` for ``Qwen2.5-7B-Instruct``, ``"1.5"``), or None."""
    found = _SIZE.search(str(name))
    return found.group(1) if found else None


def base_shipped(name: str) -> str | None:
    """The shipped config of the base model an instruction-tuned id was tuned from (``Qwen/Qwen2.5-7B-Instruct``
    -> ``Qwen/Qwen2.5-7B``, ``Llama-2-7b-chat-hf`` -> ``Llama-2-7b-hf``): the same architecture and size."""
    base = _TUNED.sub("", str(name), count=1)
    found = shipped_config(base) if base != name else None
    return found.stem.replace("--", "/", 1) if found is not None else None


def suggest_shipped(name: str) -> str | None:
    """The shipped config most like ``name``: its base model's, else one of the same size whose name is
    closest (never a 5x smaller model for a 7B), else a near spelling; None when none is alike."""
    import difflib

    base = base_shipped(name)
    if base is not None:
        return base
    size = model_size(name)
    if size is None:
        return closest_shipped(name)
    bare = _TUNED.sub("", str(name).split("/")[-1].lower(), count=1)
    same = [(difflib.SequenceMatcher(None, bare, i.split("/")[-1].lower()).ratio(), i)
            for i in shipped_configs() if model_size(i.split("/")[-1]) == size]  # fmt: skip
    best = max(same, default=None)
    return best[1] if best is not None and best[0] >= 0.5 else None


def _unreadable(name: str, why: str) -> EstimateError:
    known = ", ".join(shipped_configs()) or "none"
    like = suggest_shipped(name)
    parts = [f"could not read the config of {name!r}:", f"  {why}",
             f"Did you mean {like!r} (shipped: works offline)?" if like else "",
             f"Offline or private? Pass a local folder or config.json, or a config shipped in {data_path('configs')}:",
             "  " + known]  # fmt: skip
    # lines a terminal shows whole (the CLI prints this as it is): ids and paths never cut
    fill = functools.partial(textwrap.fill, width=76, break_long_words=False, break_on_hyphens=False)
    # the reason stays one line (a program matching on it finds it whole)
    return EstimateError("\n".join(p if i == 1 else fill(p, subsequent_indent="  ") for i, p in enumerate(parts) if p))


def _from_base(name: str, why: str):
    """An instruction-tuned id that cannot be read, answered from its base's shipped config (same architecture
    and size; the name says so); the error naming what to pass where there is none."""
    base = base_shipped(name)
    if base is None:
        raise _unreadable(name, why) from None
    config = resolve_config(base)[0]
    return config, f"{name} (config unreadable here: its base {base}'s shipped config, same size)", None


def _from_hub(name: str):
    """Online: config.json in one bounded request (a stalled or hostile mirror is this error within the
    network deadline, never a hang); offline: the Hugging Face cache, as transformers reads it."""
    from transformers import AutoConfig

    if hub_offline_reason() is None:
        try:
            d = read_hub_json(name, "config.json")
        except NetError as e:
            return _from_base(name, str(e))
        return config_from_dict(d, f"the config of {name!r}"), name, None
    try:
        with library_notes_silenced(*CONFIG_NOTES):
            config = AutoConfig.from_pretrained(name, local_files_only=True)
    except Exception as e:
        rejected = _rejected_on_hub(e, name)
        if rejected is not None:
            raise rejected from None
        return _from_base(name, f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}")
    check_config_values(config.to_dict(), f"the config of {name!r}")
    return config, name, None


def _rejected_on_hub(e: Exception, name: str) -> EstimateError | None:
    """A hub config that was read but that its class's validation refuses (not a network or access error):
    the EstimateError naming the field and its value, read back from the file just downloaded."""
    from transformers import PretrainedConfig

    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # a huggingface_hub without strict dataclasses validates nothing of its own
        StrictDataclassError = ValueError  # noqa: N806
    if not isinstance(e, StrictDataclassError | KeyError | TypeError):
        return None
    try:
        d, _ = PretrainedConfig.get_config_dict(name, local_files_only=True)
    except Exception:  # noqa: BLE001 - without the file, the error still names the field
        d = {}
    return _rejected(e, d, f"the config of {name!r}", str(d.get("model_type", "its")))


def hub_repo(model: Any) -> str | None:
    """The hub id ``model`` names when :func:`resolve_config` reads its config from the hub (a string that
    is no local path and no shipped config), else ``None``."""
    if not isinstance(model, str) or not model.strip():
        return None
    path = Path(model).expanduser()
    if path.exists() or looks_like_path(model) or shipped_config(model) is not None:
        return None
    return model


def resolve_config(model: Any):
    """``(config, name, loaded_module_or_None)`` for a hub id, short name, directory, json path,
    config object or loaded model."""
    from transformers import PretrainedConfig

    if isinstance(model, torch.nn.Module):
        cfg = getattr(model, "config", None)
        if cfg is None:
            raise EstimateError("this module has no .config; pass the model's config.json instead")
        return cfg, getattr(cfg, "_name_or_path", None) or type(model).__name__, model
    if isinstance(model, PretrainedConfig):
        check_config_values(model.to_dict(), "this config")
        return model, getattr(model, "_name_or_path", None) or model.model_type, None
    if isinstance(model, dict):
        return config_from_dict(model, "the config dict"), model.get("_name_or_path") or "config", None
    if not isinstance(model, str | os.PathLike):
        raise EstimateError(f"model must be a hub id, a path, a config or a loaded model, not {type(model).__name__}")
    name = str(model)
    if not name.strip():
        raise EstimateError(
            f"model is {name!r}, empty; pass a hub id such as 'org/name', a model folder, its config.json or a "
            f"shipped config name ({', '.join(list(shipped_configs())[:3])}, ...)"
        )
    path = Path(name).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        path = path / "config.json"
    if path.is_file():
        return _from_file(path, name)
    if path.exists():
        raise EstimateError(f"{path} has no config.json; pass the model folder or its config.json")
    if looks_like_path(name):
        raise _missing(name)
    shipped = shipped_config(name)
    if shipped is not None:
        return _from_file(shipped, shipped.stem.replace("--", "/", 1))[0], shipped.stem.replace("--", "/", 1), None
    return _from_hub(name)
