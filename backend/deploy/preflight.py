"""Checks of a model repository that `tritonllm serve` makes before starting tritonserver on it: a mistake found
here costs a second and names the file and parameter, instead of a failed start after the models import torch."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from tritonllm.deploy.tritonserver import ServerError
from tritonllm.tokenizer import tokenizer_folder_problem

# The models of a repository that load a tokenizer from their `tokenizer_dir` parameter.
TOKENIZER_MODELS = ("preprocessing", "postprocessing")


class PreflightError(ServerError):
    pass


def string_parameter(config: Path, key: str) -> Optional[str]:
    """A config.pbtxt parameter's string_value; None when the parameter is absent."""
    pattern = rf'key:\s*"{re.escape(key)}"\s*value:\s*\{{\s*string_value:\s*"([^"]*)"'
    match = re.search(pattern, config.read_text())
    return match.group(1) if match else None


def check_repository(repo: Path) -> None:
    """PreflightError naming the model, its parameter and the folder when a tokenizer folder is unusable."""
    if not Path(repo).is_dir():
        raise PreflightError(f"the model repository {repo} does not exist")
    for model in TOKENIZER_MODELS:
        config = Path(repo) / model / "config.pbtxt"
        if not config.is_file():
            continue  # a repository without this model (the LLM-API one) has nothing to check here
        tokenizer_dir = string_parameter(config, "tokenizer_dir")
        if not tokenizer_dir or tokenizer_dir.startswith("${"):
            raise PreflightError(f"{config}: parameter 'tokenizer_dir' is not set (a Hugging Face tokenizer folder)")
        problem = tokenizer_folder_problem(tokenizer_dir)
        if problem is not None:
            raise PreflightError(
                f"{config}: parameter 'tokenizer_dir' = '{tokenizer_dir}': {problem}; give the model folder "
                "the repository was built from (tritonllm repo build --model DIR)"
            )
