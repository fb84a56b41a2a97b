"""The `tokenizer_dir` parameter of the preprocessing and postprocessing models: required, and loadable."""

from __future__ import annotations

from ..tokenizer import LoadedTokenizer, TokenizerFolderError, load_tokenizer
from .params import ParameterError, Parameters


def required_tokenizer_dir(params: Parameters) -> str:
    tokenizer_dir = params.str("tokenizer_dir")
    if tokenizer_dir is None:
        raise ParameterError(
            f"{params.model_name}: parameter 'tokenizer_dir' is required (a local Hugging Face tokenizer directory)"
        )
    return tokenizer_dir


def load_tokenizer_for_model(tokenizer_dir: str, model_name: str) -> LoadedTokenizer:
    """`load_tokenizer`, with a load failure reported as a bad `tokenizer_dir` parameter of `model_name`."""
    try:
        return load_tokenizer(tokenizer_dir)
    except TokenizerFolderError as error:
        raise ParameterError(f"{model_name}: parameter 'tokenizer_dir' = {tokenizer_dir!r}: {error}") from None
    except Exception as error:
        raise ParameterError(
            f"{model_name}: parameter 'tokenizer_dir' = {tokenizer_dir!r}: cannot load a "
            f"tokenizer ({type(error).__name__}: {error})"
        ) from error
