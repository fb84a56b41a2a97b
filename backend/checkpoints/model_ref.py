"""What model.yaml's `model` (and `tokenizer`) names: a folder, or a Hugging Face model id, as TensorRT-LLM's LLM()
takes it. The one place that turns such a value into a local folder; every reader of model.yaml uses it.

A value naming an existing folder is that folder. Any other value that reads as `name` or `org/name` is looked up
through huggingface_hub: its cache first (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub), then
the Hub unless HF_HUB_OFFLINE is set; HF_TOKEN authenticates. The environment is read at each call, not when
huggingface_hub was imported, so a server started with HF_HOME gets that cache."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Optional

from ..engine.config import ConfigError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_TRUE = ("1", "true", "yes", "on")


def resolve_model_ref(value: Any, key: str, source: str, base_dir: Optional[Path] = None) -> Optional[str]:
    """The local folder `value` names, or None when it is unset. `key` ("model", "tokenizer") and `source` (the
    file it came from) word the error. A relative folder is looked for under `base_dir` (as given when None)."""
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{source}: {key} must be a folder path or a Hugging Face model id, got {value!r}")
    path = Path(value).expanduser()
    folder = path if path.is_absolute() or base_dir is None else (base_dir / path).resolve()
    if folder.exists() or not is_hub_id(value):
        return str(folder)
    return hub_snapshot(value, key, source, folder)


def is_hub_id(value: str) -> bool:
    """`name` or `org/name`, and not written as a path (absolute, ./, ~)."""
    return not value.startswith(("/", ".", "~")) and _HUB_ID.match(value) is not None


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def hub_cache_dir() -> Optional[str]:
    """HF_HUB_CACHE, else HF_HOME/hub; None: huggingface_hub's default."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]).expanduser() / "hub")
    return None


def hub_snapshot(repo_id: str, key: str, source: str, folder: Path) -> str:
    """The snapshot folder of `repo_id` (the `main` revision): from the cache, else downloaded into it."""
    from huggingface_hub import snapshot_download

    offline = hub_offline()
    try:
        return snapshot_download(
            repo_id, cache_dir=hub_cache_dir(), local_files_only=offline, token=os.environ.get("HF_TOKEN") or None
        )
    except Exception as exc:  # offline and not cached, unknown id, no network, no access
        where = hub_cache_dir() or "huggingface_hub's default cache"
        raise ConfigError(
            f"{source}: {key} {repo_id!r} is neither a folder (none at {folder}) nor a Hugging Face model that "
            f"could be resolved (cache: {where}"
            f"{'; HF_HUB_OFFLINE is set, so only the cache was searched' if offline else ''}): "
            f"{type(exc).__name__}: {exc}"
        ) from exc
