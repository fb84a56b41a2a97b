"""Typed reading of `config.pbtxt` parameters.

Triton hands a model its config as a dict; `parameters` values are strings. `""` and an unfilled `${...}` template
mean "unset". Every bad value is a `ParameterError` that names the parameter, so a broken config fails at load."""

from __future__ import annotations

import builtins
import re
from typing import Any, Callable, Mapping, Optional, TypeVar, overload

T = TypeVar("T")

_PLACEHOLDER = re.compile(r"^\$\{[^}]*\}$")
TRUE_WORDS = {"1", "true", "t", "y", "yes", "on"}
FALSE_WORDS = {"0", "false", "f", "n", "no", "off"}


class ParameterError(ValueError):
    """A config.pbtxt parameter with a value that cannot be used."""


def is_unset(value: Optional[str]) -> bool:
    return value is None or value.strip() == "" or bool(_PLACEHOLDER.match(value.strip()))


def read_parameters(model_config: Mapping[str, Any]) -> dict[str, str]:
    """The set parameters of a model config, as {name: string value}; unset ones are left out."""
    raw = model_config.get("parameters") or {}
    values = {}
    for name, entry in raw.items():
        value = entry.get("string_value") if isinstance(entry, Mapping) else entry
        if not is_unset(value):
            values[name] = str(value).strip()
    return values


class Parameters:
    """Set parameters with typed getters; each getter returns `default` when the parameter is unset."""

    def __init__(self, values: Mapping[str, str], model_name: str = "model"):
        self.values = dict(values)
        self.model_name = model_name

    @classmethod
    def from_model_config(cls, model_config: Mapping[str, Any]) -> "Parameters":
        return cls(read_parameters(model_config), model_config.get("name", "model"))

    def __contains__(self, name: str) -> bool:
        return name in self.values

    def _get(self, name: str, default: T, convert: Callable[[str], T], rule: str) -> T:
        if name not in self.values:
            return default
        text = self.values[name]
        try:
            return convert(text)
        except (TypeError, ValueError):
            raise ParameterError(f"{self.model_name}: parameter '{name}' = {text!r} must be {rule}") from None

    # The getters' names shadow the builtins inside the class, so their annotations spell them `builtins.*`; with a
    # default that is not None a getter never returns None.
    @overload
    def str(self, name: builtins.str, default: builtins.str) -> builtins.str: ...
    @overload
    def str(self, name: builtins.str, default: None = None) -> Optional[builtins.str]: ...

    def str(self, name: builtins.str, default: Optional[builtins.str] = None) -> Optional[builtins.str]:
        return self.values.get(name, default)

    @overload
    def int(
        self, name: builtins.str, default: builtins.int, minimum: Optional[builtins.int] = None
    ) -> builtins.int: ...
    @overload
    def int(
        self, name: builtins.str, default: None = None, minimum: Optional[builtins.int] = None
    ) -> Optional[builtins.int]: ...

    def int(
        self, name: builtins.str, default: Optional[builtins.int] = None, minimum: Optional[builtins.int] = None
    ) -> Optional[builtins.int]:
        value = self._get(name, default, int, "an integer")
        self._check_minimum(name, value, minimum)
        return value

    @overload
    def float(
        self,
        name: builtins.str,
        default: builtins.float,
        minimum: Optional[builtins.float] = None,
        maximum: Optional[builtins.float] = None,
    ) -> builtins.float: ...
    @overload
    def float(
        self,
        name: builtins.str,
        default: None = None,
        minimum: Optional[builtins.float] = None,
        maximum: Optional[builtins.float] = None,
    ) -> Optional[builtins.float]: ...

    def float(
        self,
        name: builtins.str,
        default: Optional[builtins.float] = None,
        minimum: Optional[builtins.float] = None,
        maximum: Optional[builtins.float] = None,
    ) -> Optional[builtins.float]:
        value = self._get(name, default, float, "a number")
        self._check_minimum(name, value, minimum)
        if value is not None and maximum is not None and value > maximum:
            raise ParameterError(f"{self.model_name}: parameter '{name}' = {value} must be <= {maximum}")
        return value

    @overload
    def bool(self, name: builtins.str, default: builtins.bool) -> builtins.bool: ...
    @overload
    def bool(self, name: builtins.str, default: None = None) -> Optional[builtins.bool]: ...

    def bool(self, name: builtins.str, default: Optional[builtins.bool] = None) -> Optional[builtins.bool]:
        return self._get(name, default, parse_bool, "a boolean (true/false/1/0/yes/no)")

    def choice(
        self, name: builtins.str, choices: tuple[builtins.str, ...], default: Optional[builtins.str] = None
    ) -> Optional[builtins.str]:
        value = self.values.get(name, default)
        if value is not None and value not in choices:
            raise ParameterError(f"{self.model_name}: parameter '{name}' = {value!r} must be one of {choices}")
        return value

    def _check_minimum(self, name, value, minimum) -> None:
        if value is not None and minimum is not None and value < minimum:
            raise ParameterError(f"{self.model_name}: parameter '{name}' = {value} must be >= {minimum}")


def parse_bool(text: str) -> bool:
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(text)
