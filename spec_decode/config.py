"""`speculative_config` (a `model.yaml` key, TensorRT-LLM's `LLM(speculative_config=...)` shape) parsed once into
typed, validated dataclasses, and the contract's `medusa_choices` / `eagle_choices` strings parsed into paths.

`decoding_type` picks the method: Medusa, Eagle (Eagle3 too), Lookahead, NGram or DraftTarget (Draft_Target).
Keys keep TensorRT-LLM's names; a key the method does not know, a wrong type or an out-of-range value raises
`SpecConfigError` naming `speculative_config.<key>` (the engine's config reports it as its ConfigError)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

Choices = list[tuple[int, ...]]

PREFIX = "speculative_config"


class SpecConfigError(ValueError):
    """A bad `speculative_config` (or choices string); the message names the key."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """What every method has; each subclass holds its own keys. `max_draft_len`: draft tokens along one path."""

    max_draft_len: int = 4

    @property
    def decoding_type(self) -> str:
        return METHOD_NAMES[type(self)]

    @property
    def max_total_draft_tokens(self) -> int:
        """Draft tokens verified per step (tree nodes); what the scheduler must reserve budget and KV for."""
        return self.max_draft_len

    def validate(self) -> None:
        _require(self.max_draft_len >= 1, "max_draft_len", f"must be >= 1, got {self.max_draft_len}")


@dataclass(frozen=True)
class NGramConfig(SpeculativeConfig):
    """Prompt lookup: match the last k tokens (k = max_matching_ngram_size down to 1), propose what followed."""

    max_matching_ngram_size: int = 2
    is_keep_all: bool = True
    is_use_oldest: bool = True
    is_public_pool: bool = True

    def validate(self) -> None:
        super().validate()
        _require(
            self.max_matching_ngram_size >= 1,
            "max_matching_ngram_size",
            f"must be >= 1, got {self.max_matching_ngram_size}",
        )


@dataclass(frozen=True)
class LookaheadConfig(SpeculativeConfig):
    """Jacobi lookahead: window W, n-gram size N, verification set G (TensorRT-LLM's defaults 4, 3, 4)."""

    max_window_size: int = 4
    max_ngram_size: int = 3
    max_verification_set_size: int = 4

    def validate(self) -> None:
        for key in ("max_window_size", "max_ngram_size", "max_verification_set_size"):
            _require(getattr(self, key) >= 1, key, f"must be >= 1, got {getattr(self, key)}")
        _require(
            self.max_ngram_size >= 2,
            "max_ngram_size",
            f"must be >= 2 (an n-gram needs a key and a continuation), got {self.max_ngram_size}",
        )

    def __post_init__(self) -> None:
        # Not a key here: a verification candidate holds an n-gram minus its first token.
        object.__setattr__(self, "max_draft_len", self.max_ngram_size - 1)

    @property
    def max_total_draft_tokens(self) -> int:
        """Verification candidates plus the lookahead window, all in one forward."""
        return (self.max_ngram_size - 1) * (self.max_verification_set_size + self.max_window_size)


@dataclass(frozen=True)
class MedusaConfig(SpeculativeConfig):
    """Medusa heads (checkpoint folder in `speculative_model_dir`) and the tree their top-k candidates fill.
    As in TensorRT-LLM, Medusa's `max_draft_len` counts tree nodes; 0 means "as many as the tree has"."""

    max_draft_len: int = 0
    speculative_model_dir: str = ""
    medusa_choices: Optional[Choices] = None
    num_medusa_heads: Optional[int] = None
    # Our extension: tree nodes whose path probability under the heads (the product of their softmax probabilities
    # along the path) is below this are not verified that step; 0 verifies the whole tree, as TensorRT-LLM does.
    min_path_probability: float = 0.0

    def validate(self) -> None:
        _require(bool(self.speculative_model_dir), "speculative_model_dir", "is required for Medusa (the heads)")
        _require(
            0.0 <= self.min_path_probability < 1.0,
            "min_path_probability",
            f"must be in [0, 1), got {self.min_path_probability}",
        )
        if self.num_medusa_heads is not None:
            _require(self.num_medusa_heads >= 1, "num_medusa_heads", f"must be >= 1, got {self.num_medusa_heads}")
        if self.medusa_choices is not None:
            validate_choices(self.medusa_choices, "medusa_choices", max_depth=self.num_medusa_heads)
        _require(self.max_draft_len >= 0, "max_draft_len", f"must be >= 0, got {self.max_draft_len}")
        if self.medusa_choices and self.max_draft_len:
            _require(
                self.max_draft_len >= len(self.medusa_choices),
                "max_draft_len",
                f"({self.max_draft_len}) is smaller than the {len(self.medusa_choices)} medusa_choices nodes",
            )

    @property
    def max_total_draft_tokens(self) -> int:
        return len(self.medusa_choices) if self.medusa_choices else self.max_draft_len


@dataclass(frozen=True)
class EagleConfig(SpeculativeConfig):
    """EAGLE-1/2 (or EAGLE-3) draft layer in `speculative_model_dir`: a static `eagle_choices` tree, a chain, or
    EAGLE-2's dynamic tree (`use_dynamic_tree` with `dynamic_tree_max_topK`)."""

    speculative_model_dir: str = ""
    eagle_choices: Optional[Choices] = None
    use_dynamic_tree: bool = False
    dynamic_tree_max_topK: Optional[int] = None
    max_non_leaves_per_layer: Optional[int] = None
    greedy_sampling: bool = True
    eagle3: bool = False
    total_draft_tokens: Optional[int] = None  # TensorRT-LLM's max_total_draft_tokens for the dynamic tree
    # EAGLE-3: the target layers whose outputs feed the draft (None: the draft's config, else its default)
    eagle3_layers_to_capture: Optional[tuple[int, ...]] = None

    def validate(self) -> None:
        super().validate()
        _require(bool(self.speculative_model_dir), "speculative_model_dir", "is required for Eagle (the draft layer)")
        if self.eagle_choices is not None:
            _require(not self.use_dynamic_tree, "eagle_choices", "and use_dynamic_tree exclude each other")
            validate_choices(self.eagle_choices, "eagle_choices", max_depth=self.max_draft_len)
        if self.use_dynamic_tree:
            top_k = self.dynamic_tree_max_topK
            _require(
                top_k is not None and top_k >= 1,
                "dynamic_tree_max_topK",
                f"must be >= 1 when use_dynamic_tree is set, got {top_k}",
            )
            assert top_k is not None  # _require raised otherwise
            total = self.max_total_draft_tokens
            _require(
                self.max_draft_len <= total <= top_k * self.max_draft_len,
                "max_total_draft_tokens",
                f"must be in [max_draft_len, dynamic_tree_max_topK * max_draft_len], got {total}",
            )

    @property
    def max_total_draft_tokens(self) -> int:
        if self.eagle_choices:
            return len(self.eagle_choices)
        if self.use_dynamic_tree:
            return self.total_draft_tokens or (self.dynamic_tree_max_topK or 1) * self.max_draft_len
        return self.max_draft_len


@dataclass(frozen=True)
class DraftTargetConfig(SpeculativeConfig):
    """A second, smaller model (own weights, own KV cache) drafts `max_draft_len` tokens autoregressively."""

    speculative_model_dir: str = ""

    def validate(self) -> None:
        super().validate()
        _require(bool(self.speculative_model_dir), "speculative_model_dir", "is required for DraftTarget")


METHOD_NAMES: dict[type, str] = {
    NGramConfig: "NGram",
    LookaheadConfig: "Lookahead",
    MedusaConfig: "Medusa",
    EagleConfig: "Eagle",
    DraftTargetConfig: "DraftTarget",
}
_METHODS: dict[str, type] = {
    "ngram": NGramConfig,
    "lookahead": LookaheadConfig,
    "medusa": MedusaConfig,
    "eagle": EagleConfig,
    "eagle3": EagleConfig,
    "drafttarget": DraftTargetConfig,
    "draft_target": DraftTargetConfig,
}
# TensorRT-LLM spellings that map onto one of our fields.
_ALIASES = {"speculative_model": "speculative_model_dir"}
_NOT_FIELDS = {"decoding_type", "max_total_draft_tokens"}


def parse_speculative_config(raw: Union[dict[str, Any], SpeculativeConfig, None]) -> Optional[SpeculativeConfig]:
    """The `speculative_config` mapping (or None) as a validated config object."""
    if raw is None or isinstance(raw, SpeculativeConfig):
        if raw is not None:
            raw.validate()
        return raw
    if not isinstance(raw, dict):
        raise SpecConfigError(f"{PREFIX} must be a mapping with a decoding_type, got {raw!r}")
    kind = _method(raw.get("decoding_type"))
    values = _field_values(kind, raw)
    config = kind(**values)
    config.validate()
    return config


def _method(decoding_type: Any) -> type:
    known = "Medusa, Eagle, Eagle3, Lookahead, NGram, DraftTarget"
    if not isinstance(decoding_type, str):
        raise SpecConfigError(f"{PREFIX}.decoding_type is required: one of {known}")
    kind = _METHODS.get(decoding_type.strip().lower())
    if kind is None:
        raise SpecConfigError(f"{PREFIX}.decoding_type={decoding_type!r} is unknown: choose one of {known}")
    return kind


def _field_values(kind: type, raw: dict[str, Any]) -> dict[str, Any]:
    fields = {f.name: f for f in dataclasses.fields(kind)}
    values: dict[str, Any] = {}
    if str(raw.get("decoding_type", "")).lower() == "eagle3":
        values["eagle3"] = True
    for key, value in raw.items():
        name = _ALIASES.get(key, key)
        if key == "max_total_draft_tokens" and kind is EagleConfig:
            name = "total_draft_tokens"
        elif key in _NOT_FIELDS:
            continue
        if name not in fields or (kind is LookaheadConfig and name == "max_draft_len"):  # derived from N
            allowed = sorted(set(fields) - {"eagle3", "total_draft_tokens"} | {"decoding_type"})
            raise SpecConfigError(f"{PREFIX}.{key} is not a {METHOD_NAMES[kind]} key; known: {allowed}")
        values[name] = _coerce(key, value, fields[name])
    return values


def _layer_ids(key: str, value: Any) -> tuple[int, ...]:
    """Distinct layer indices >= 0, ascending (a YAML list or set)."""
    ids = list(value) if isinstance(value, (list, tuple, set)) else None
    if not ids or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids) or len(set(ids)) < len(ids):
        raise SpecConfigError(f"{PREFIX}.{key} must be a non-empty list of distinct layer indices >= 0, got {value!r}")
    return tuple(sorted(ids))


def _coerce(key: str, value: Any, field: dataclasses.Field) -> Any:
    annotation = str(field.type)
    if value is None:
        if "Optional" not in annotation:
            raise SpecConfigError(f"{PREFIX}.{key} must not be null")
        return None
    if "Choices" in annotation:
        return parse_choices(value, f"{PREFIX}.{key}")
    if annotation.startswith("bool"):
        if not isinstance(value, bool):
            raise SpecConfigError(f"{PREFIX}.{key} must be true or false, got {value!r}")
        return value
    if annotation.startswith("float"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecConfigError(f"{PREFIX}.{key} must be a number, got {value!r}")
        return float(value)
    if "tuple[int" in annotation:
        return _layer_ids(key, value)
    if "int" in annotation:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecConfigError(f"{PREFIX}.{key} must be an integer, got {value!r}")
        return value
    if isinstance(value, Path):
        value = str(value)
    if not isinstance(value, str):
        raise SpecConfigError(f"{PREFIX}.{key} must be a string, got {value!r}")
    return value


def _require(condition: bool, key: str, rule: str) -> None:
    if not condition:
        raise SpecConfigError(f"{PREFIX}.{key} {rule}")


# ---- medusa_choices / eagle_choices -------------------------------------------------------------------------


def parse_choices(value: Union[str, list, tuple], name: str = "choices") -> Choices:
    """Tree paths from the contract's string form ("{0, 0, 0}, {0, 1}", optionally wrapped in braces or brackets)
    or from a list of lists; each path is the top-k rank chosen at each depth."""
    if isinstance(value, str):
        value = _choices_from_string(value, name)
    if not isinstance(value, (list, tuple)) or not value:
        raise SpecConfigError(f"{name} must be a non-empty list of paths, got {value!r}")
    paths = []
    for path in value:
        if (
            not isinstance(path, (list, tuple))
            or not path
            or not all(isinstance(r, int) and not isinstance(r, bool) for r in path)
        ):
            raise SpecConfigError(f"{name}: each path must be a non-empty list of integers, got {path!r}")
        paths.append(tuple(path))
    validate_choices(paths, name)
    return paths


def _choices_from_string(text: str, name: str) -> list:
    body = text.strip().replace("{", "[").replace("}", "]")
    if not body:
        raise SpecConfigError(f"{name} is empty")
    if not body.startswith("[["):  # "{0, 0}, {1}" lists the paths without an outer pair of braces
        body = f"[{body}]"
    try:
        return json.loads(body)
    except json.JSONDecodeError as err:
        raise SpecConfigError(f'{name}={text!r} is not a list of paths like "{{0, 0, 0}}, {{0, 1}}" ({err})') from None


def validate_choices(paths: Choices, name: str, max_depth: Optional[int] = None) -> None:
    """Paths are unique, ranks non-negative, and every path's parent path is listed too (a connected tree)."""
    seen = set(paths)
    if len(seen) != len(paths):
        raise SpecConfigError(f"{name} lists a path twice")
    for path in paths:
        if any(rank < 0 for rank in path):
            raise SpecConfigError(f"{name}: path {list(path)} has a negative rank")
        if len(path) > 1 and path[:-1] not in seen:
            raise SpecConfigError(f"{name}: path {list(path)} has no parent path {list(path[:-1])}")
        if max_depth is not None and len(path) > max_depth:
            raise SpecConfigError(f"{name}: path {list(path)} is deeper than {max_depth}")
