"""Triton model repositories: build one from the `models/` template, fill `${placeholders}` the way TensorRT-LLM's
`tools/fill_template.py` does, and find the unfilled ones that would break Triton's config parsing.

The template is looked up in this order:
  1. `$TRITONLLM_MODELS_DIR`;
  2. `models/` next to the `backend/` folder (a source checkout or an editable install);
  3. `tritonllm/model_repository/` inside the installed package, where a wheel carries it once packaging maps
     `models/` there as package data. Until then a non-editable install needs (1).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from string import Template
from typing import Any, Iterable, Mapping, Optional

from tritonllm.deploy.pbtxt_check import config_errors
from tritonllm.engine.config import DEVICE_CHOICES, DTYPE_CHOICES, ENGINE_CHOICES, GUIDED_DECODING_BACKENDS
from tritonllm.tokenizer import TOKENIZER_FILES

MODEL_NAMES = ("preprocessing", "tensorrt_llm", "postprocessing", "ensemble", "tensorrt_llm_bls")
# tensorrt_llm parameters whose placeholder has another name (as in TensorRT-LLM's template); build_repo takes either.
PLACEHOLDER_OF_PARAMETER = {
    "gpt_model_path": "engine_dir",
    "gpt_model_type": "batching_strategy",
    "encoder_model_path": "encoder_engine_dir",
}
# fill_template.py pre-fills these, so scripts written for it may leave them out.
QUEUE_DEFAULTS = {"max_queue_size": "0", "max_queue_delay_microseconds": "0"}
# Filled when a fill does not name them: a structural placeholder left unfilled makes the file unparseable, and
# the backend's docs fill the BLS without this one.
FILL_DEFAULTS = {**QUEUE_DEFAULTS, "prompt_embedding_table_data_type": "TYPE_FP16"}
# `field: ${name}`, `field: [ ${name} ]` or `field: "${name}"` outside a parameter's string_value.
_STRUCTURAL = re.compile(r"(\w+)\s*:\s*\[?\s*\"?\$\{(\w+)\}")


class RepoError(ValueError):
    """A model folder, template, substitution or repository that cannot be used; the message says which."""


# ---------------------------------------------------------------------------------------------- template lookup


def template_dir() -> Path:
    """The `models/` template folder (see the module docstring for the lookup order)."""
    named = os.environ.get("TRITONLLM_MODELS_DIR")
    if named:
        path = Path(named)
        if not (path / "tensorrt_llm" / "config.pbtxt").is_file():
            raise RepoError(
                f"TRITONLLM_MODELS_DIR={named} does not hold the model templates (no tensorrt_llm/config.pbtxt)"
            )
        return path
    package = Path(__file__).resolve().parents[1]  # the installed tritonllm (backend/ in a checkout)
    for path in (package.parent / "models", package / "model_repository"):
        if (path / "tensorrt_llm" / "config.pbtxt").is_file():
            return path
    raise RepoError(
        "cannot find the models/ template: set TRITONLLM_MODELS_DIR to the repository's models/ folder "
        "(a non-editable install does not carry it yet)"
    )


# ---------------------------------------------------------------------------------------------- build


def build_repo(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    streaming: bool = True,
    max_batch_size: int = 8,
    engine: str = "auto",
    preprocessing_instances: int = 1,
    postprocessing_instances: int = 1,
    dtype: Optional[str] = None,
    device: Optional[str] = None,
    max_seq_len: Optional[int] = None,
    max_num_tokens: Optional[int] = None,
    kv_cache_max_tokens: Optional[int] = None,
    kv_cache_free_gpu_mem_fraction: Optional[float] = None,
    enable_kv_cache_reuse: bool = True,
    enable_chunked_context: bool = False,
    exclude_input_in_output: bool = False,
    guided_decoding_backend: Optional[str] = "xgrammar",
    parameters: Optional[Mapping[str, Any]] = None,
    overwrite: bool = False,
    draft_model_dir: Optional[str | Path] = None,
) -> Path:
    """Write the preprocessing, tensorrt_llm, postprocessing, ensemble and tensorrt_llm_bls models into `out_dir`,
    every placeholder filled. `model_dir` is a Hugging Face model folder (config.json + tokenizer). `parameters`
    overrides any placeholder by name, or by its tensorrt_llm parameter key (e.g. {"max_batch_size": 64,
    "gpt_model_type": "inflight_batching"}); None or "" leaves a parameter unset. Other models already in
    `out_dir` are left alone; ours are replaced only with `overwrite`. `draft_model_dir` adds a second engine model,
    `tensorrt_llm_draft`, for the BLS draft/target loop (`num_draft_tokens`). `guided_decoding_backend`
    (xgrammar by default, so that guided requests and the OpenAI front's response_format work as built; None: off)
    fills the tensorrt_llm parameter of that name. Returns `out_dir`."""
    model = check_model_dir(model_dir)
    draft = check_draft_model(model, draft_model_dir) if draft_model_dir is not None else None
    check_build_numbers(
        max_batch_size=max_batch_size,
        preprocessing_instances=preprocessing_instances,
        postprocessing_instances=postprocessing_instances,
        max_seq_len=max_seq_len,
        max_num_tokens=max_num_tokens,
        kv_cache_max_tokens=kv_cache_max_tokens,
    )
    check_build_choices(
        engine=engine,
        dtype=dtype,
        device=device,
        kv_cache_free_gpu_mem_fraction=kv_cache_free_gpu_mem_fraction,
        guided_decoding_backend=guided_decoding_backend,
    )
    values = {
        "triton_backend": "python",
        "triton_max_batch_size": max_batch_size,
        "decoupled_mode": streaming,
        "max_queue_delay_microseconds": 0,
        "max_queue_size": 0,
        "preprocessing_instance_count": preprocessing_instances,
        "postprocessing_instance_count": postprocessing_instances,
        "tokenizer_dir": model,
        "engine_dir": model,
        "logits_datatype": "TYPE_FP32",
        "encoder_input_features_data_type": "TYPE_FP16",
        "add_special_tokens": True,
        "skip_special_tokens": True,
        "batching_strategy": "inflight_fused_batching",
        "max_beam_width": 1,
        "batch_scheduler_policy": "guaranteed_no_evict",
        "enable_kv_cache_reuse": enable_kv_cache_reuse,
        "enable_chunked_context": enable_chunked_context,
        "normalize_log_probs": True,
        "exclude_input_in_output": exclude_input_in_output,
        "enable_trt_overlap": False,
        "cancellation_check_period_ms": 100,
        "stats_check_period_ms": 100,
        "engine": engine,
        "dtype": dtype,
        "device": device,
        "max_seq_len": max_seq_len,
        "max_num_tokens": max_num_tokens,
        "max_tokens_in_paged_kv_cache": kv_cache_max_tokens,
        "kv_cache_free_gpu_mem_fraction": kv_cache_free_gpu_mem_fraction,
        "guided_decoding_backend": guided_decoding_backend,
        # tensorrt_llm_bls; triton_grpc_url unset: the BLS reads the port from tritonserver's command line.
        "bls_instance_count": 1,
        "accumulate_tokens": False,
        "tensorrt_llm_model_name": "tensorrt_llm",
        "tensorrt_llm_draft_model_name": None,
        "multimodal_encoders_name": None,
        "triton_grpc_url": None,
        "prompt_embedding_table_data_type": "TYPE_FP16",
    }
    if draft is not None:
        values["tensorrt_llm_draft_model_name"] = DRAFT_MODEL_NAME
    overrides = {PLACEHOLDER_OF_PARAMETER.get(key, key): value for key, value in (parameters or {}).items()}
    check_backend(overrides)
    values.update(overrides)
    repo = write_repo(
        template_dir(),
        Path(out_dir),
        {k: format_value(k, v) for k, v in values.items()},
        overrides=set(overrides),
        overwrite=overwrite,
    )
    if draft is not None:
        add_draft_model(repo, model, draft)
    return repo


DRAFT_MODEL_NAME = "tensorrt_llm_draft"


def check_draft_model(model: str, draft_model_dir: str | Path) -> str:
    """The draft model folder, checked: it must speak the target's vocabulary (the loop exchanges token ids)."""
    draft = check_model_dir(draft_model_dir)
    sizes = [json.loads((Path(folder) / "config.json").read_text()).get("vocab_size") for folder in (model, draft)]
    if sizes[0] != sizes[1]:
        raise RepoError(
            f"the draft model's vocab_size {sizes[1]} differs from the target's {sizes[0]}: draft and "
            "target must share one tokenizer"
        )
    return draft


def add_draft_model(repo: Path, target_dir: str, draft_dir: str) -> None:
    """`tensorrt_llm_draft`: the built tensorrt_llm model (same settings) on the draft model's folder."""
    target = repo / DRAFT_MODEL_NAME
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(repo / "tensorrt_llm", target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    block_bytecode(target)
    config = target / "config.pbtxt"
    text = config.read_text().replace('name: "tensorrt_llm"', f'name: "{DRAFT_MODEL_NAME}"', 1)
    for key in ("gpt_model_path", "tokenizer_dir"):
        text = text.replace(
            f'key: "{key}" value: {{ string_value: "{target_dir}" }}',
            f'key: "{key}" value: {{ string_value: "{draft_dir}" }}',
        )
    config.write_text(text)


def write_repo(
    template: Path, out_dir: Path, values: Mapping[str, str], *, overrides: Iterable[str] = (), overwrite: bool = False
) -> Path:
    """Copy the template's models into `out_dir` and fill them. Built in a staging folder first, so a failure
    leaves `out_dir` as it was."""
    texts = {name: (template / name / "config.pbtxt").read_text() for name in MODEL_NAMES}
    known = set().union(*(placeholders(text) for text in texts.values()))
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise RepoError(f"unknown template parameter(s) {unknown}; known: {sorted(known)}")
    clashes = [name for name in MODEL_NAMES if (out_dir / name).exists()]
    if clashes and not overwrite:
        raise RepoError(f"{out_dir} already holds {clashes}; pass overwrite to replace them")
    out_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tritonllm-build-", dir=out_dir))
    try:
        for name in MODEL_NAMES:
            stage_model(template / name, staging / name, values)
        errors = validate_repo(staging, shown_as=out_dir, templates=template)
        if errors:
            raise RepoError("the built repository is not valid:\n  " + "\n  ".join(errors))
        for name in MODEL_NAMES:
            if (out_dir / name).exists():
                shutil.rmtree(out_dir / name)
            os.replace(staging / name, out_dir / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def block_bytecode(model: Path) -> None:
    """Keep Python from writing bytecode into the model's version folder: the Python backend's stub runs in
    isolated mode (PYTHONDONTWRITEBYTECODE is ignored) and would write `1/__pycache__/` on import, which Triton
    takes for a changed model and reloads. A plain file of that name makes Python skip the write (it cannot
    create the folder) and changes nothing at load."""
    version = model / "1"
    if not (version / "model.py").exists():
        return
    blocker = version / BYTECODE_BLOCKER
    if blocker.is_dir():
        shutil.rmtree(blocker)
    blocker.write_text("")


BYTECODE_BLOCKER = "__pycache__"


def stage_model(source: Path, target: Path, values: Mapping[str, str]) -> None:
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (target / "1").mkdir(exist_ok=True)  # Triton needs a version folder, even an empty one (the ensemble)
    block_bytecode(target)
    config = target / "config.pbtxt"
    text = config.read_text()
    missing = sorted(structural_placeholders(text) - set(values))
    if missing:
        raise RepoError(f"{source.name}/config.pbtxt: no value for structural placeholder(s) {missing}")
    # Every other placeholder sits in a parameter's string_value, where "" means unset.
    config.write_text(Template(text).safe_substitute({**dict.fromkeys(placeholders(text), ""), **values}))
    for path in sorted(target.rglob("*")):
        if path.is_file() and "${" in path.read_text(errors="replace"):
            raise RepoError(f"{path.relative_to(target.parent)} still holds a placeholder after filling")


def check_model_dir(model_dir: str | Path) -> str:
    """The model folder as an absolute path; it must hold config.json and a tokenizer."""
    path = Path(model_dir).expanduser().resolve()
    if not path.is_dir():
        raise RepoError(f"model folder {model_dir} does not exist")
    if not (path / "config.json").is_file():
        raise RepoError(f"model folder {path} has no config.json (a Hugging Face model folder is expected)")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise RepoError(f"model folder {path} has no tokenizer (one of {', '.join(TOKENIZER_FILES)})")
    return str(path)


def check_build_numbers(**numbers: Optional[int]) -> None:
    minimums = {"max_seq_len": 2}
    for name, value in numbers.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < minimums.get(name, 1):
            raise RepoError(f"{name} must be an integer >= {minimums.get(name, 1)}, got {value!r}")


def check_build_choices(
    *,
    engine: str,
    dtype: Optional[str],
    device: Optional[str],
    kv_cache_free_gpu_mem_fraction: Optional[float],
    guided_decoding_backend: Optional[str] = None,
) -> None:
    for name, value, choices in (
        ("engine", engine, ENGINE_CHOICES),
        ("dtype", dtype, DTYPE_CHOICES),
        ("device", device, DEVICE_CHOICES),
        ("guided_decoding_backend", guided_decoding_backend, GUIDED_DECODING_BACKENDS),
    ):
        if value is not None and value not in choices:
            raise RepoError(f"{name} must be one of {choices}, got {value!r}")
    fraction = kv_cache_free_gpu_mem_fraction
    if fraction is not None and not 0 < fraction <= 1:
        raise RepoError(f"kv_cache_free_gpu_mem_fraction must be in (0, 1], got {fraction!r}")


def format_value(name: str, value: Any) -> str:
    """A placeholder value as config.pbtxt text: booleans as true/false, None as "" (unset)."""
    if value is None:
        return ""
    text = ("true" if value else "false") if isinstance(value, bool) else str(value)
    # The value lands inside pbtxt strings, where these would need escaping; no sane setting contains them.
    if any(bad in text for bad in ('"', "\\", "\n")):
        raise RepoError(f"value of {name} must not contain quotes, backslashes or newlines: {text!r}")
    return text


# ---------------------------------------------------------------------------------------------- fill_template


def fill_template(
    config_path: str | Path, substitutions: str | Mapping[str, str], in_place: bool = True, check: bool = True
) -> str:
    """TensorRT-LLM's `fill_template.py` semantics: `substitutions` is "key:value,key:value" (`\\,` and `\\:`
    escape), every key must exist as `${key}` in the file, unknown placeholders stay (safe_substitute), and
    max_queue_size / max_queue_delay_microseconds default to 0 (prompt_embedding_table_data_type to TYPE_FP16,
    which the backend's docs leave out for the BLS). With `check`, a result Triton could not parse (a structural
    placeholder left unfilled, a value of the wrong type) is refused, naming the line and the parameter, and
    nothing is written. Returns the filled text; writes it back when `in_place`."""
    path = Path(config_path)
    text = path.read_text()
    values = parse_substitutions(substitutions) if isinstance(substitutions, str) else dict(substitutions)
    present = placeholders(text)
    check_backend(values)
    for key in values:
        if key not in present:
            left = ", ".join(sorted(present)) or "none"
            raise RepoError(f"key '{key}' does not exist as ${{{key}}} in {path} (placeholders left: {left})")
    filled = Template(text).safe_substitute({**FILL_DEFAULTS, **values})
    if check:
        errors = config_text_errors(filled, str(path), template=text)
        if errors:
            raise RepoError(f"{path} would not load in Triton once filled (nothing written):\n  " + "\n  ".join(errors))
    if in_place:
        path.write_text(filled)
    return filled


def check_backend(values: Mapping[str, Any]) -> None:
    """`triton_backend` can only be `python`: the backend's docs fill `tensorrtllm`, TensorRT-LLM's C++ backend,
    which is not here (Triton would fail at load: no backend library for it). A Python-based backend of that
    name (backends/tensorrtllm/model.py) would have to live in the server's backend folder: the repository would
    then load only under our launcher, and under NVIDIA's server would pick the real C++ backend instead."""
    backend = values.get("triton_backend")
    if backend is not None and str(backend).strip() != "python":
        raise RepoError(
            f"triton_backend {backend!r}: these models run on Triton's Python backend (TensorRT-LLM "
            "through its LLM API, or the embedded engine), not TensorRT-LLM's C++ backend; use "
            "triton_backend:python"
        )


def parse_substitutions(text: str) -> dict[str, str]:
    """ "a:1,b:x\\,y" -> {"a": "1", "b": "x,y"}. A pair splits at its first unescaped ':'; empty pairs are skipped."""
    values: dict[str, str] = {}
    for pair in _split_unescaped(text, ","):
        if not pair.strip():
            continue
        parts = _split_unescaped(pair, ":", maxsplit=1)
        if len(parts) != 2 or not _unescape(parts[0]).strip():
            raise RepoError(f"substitution {pair!r} is not key:value")
        values[_unescape(parts[0]).strip()] = _unescape(parts[1])
    return values


def _split_unescaped(text: str, separator: str, maxsplit: int = -1) -> list[str]:
    """Split at separators not preceded by a backslash; escapes stay in the parts (undone by _unescape)."""
    parts, current, escaped = [], "", False
    for char in text:
        if escaped:
            current, escaped = current + "\\" + char, False
        elif char == "\\":
            escaped = True
        elif char == separator and maxsplit != 0:
            parts.append(current)
            current, maxsplit = "", maxsplit - 1
        else:
            current += char
    parts.append(current + ("\\" if escaped else ""))
    return parts


def _unescape(text: str) -> str:
    return re.sub(r"\\(.)", r"\1", text)


def placeholders(text: str) -> set[str]:
    """Names that string.Template would substitute: `${name}` and `$name`."""
    names = set()
    for match in Template.pattern.finditer(text):
        name = match.group("braced") or match.group("named")
        if name:
            names.add(name)
    return names


def structural_placeholders(text: str) -> set[str]:
    """Placeholders outside parameter values and comments: left unfilled they break protobuf parsing."""
    return {name for _, _, _, name in _structural_hits(text)}


# ---------------------------------------------------------------------------------------------- validate


def validate_repo(
    repo_dir: str | Path, shown_as: Optional[str | Path] = None, templates: Optional[Path] = None
) -> list[str]:
    """Problems that would stop Triton from loading the repository, one line each (empty: none found): a
    config.pbtxt Triton cannot parse (unfilled structural placeholders, values of the wrong type), missing version
    folders, ensemble steps naming absent models. Files are named under `shown_as` (default: `repo_dir`); a bad
    value is traced to its placeholder through the model's template in `templates` (default: the shipped one)."""
    repo = Path(repo_dir)
    if not repo.is_dir():
        return [f"{repo} is not a folder"]
    shown = Path(shown_as) if shown_as is not None else repo
    templates = templates if templates is not None else _shipped_templates()
    errors = []
    for config in sorted(repo.glob("*/config.pbtxt")):
        model = config.parent
        text = config.read_text()
        template = templates / model.name / "config.pbtxt" if templates is not None else None
        errors += config_text_errors(
            text,
            str(shown / model.name / "config.pbtxt"),
            template.read_text() if template and template.is_file() else None,
        )
        if not any(child.is_dir() and child.name.isdigit() for child in model.iterdir()):
            errors.append(f"{model.name}: no version folder (e.g. {model.name}/1/)")
        for step_model in re.findall(r'model_name:\s*"([^"]+)"', text):
            if not (repo / step_model / "config.pbtxt").is_file():
                errors.append(f"{model.name}/config.pbtxt: ensemble step model '{step_model}' is not in {repo}")
    return errors


def config_text_errors(text: str, label: str, template: Optional[str] = None) -> list[str]:
    """Every unfilled structural placeholder of a config.pbtxt, one line each; if there is none, what stops
    Triton's parser (`pbtxt_check`), traced to the placeholder whose value is wrong when `template` is given."""
    errors = [
        f"{label}:{lineno}: {field} holds the unfilled placeholder ${{{name}}} "
        f"(fill it: tritonllm repo fill {label} {name}:VALUE)"
        for lineno, field, _, name in _structural_hits(text)
    ]
    return errors or config_errors(text, label, template)


def _shipped_templates() -> Optional[Path]:
    try:
        return template_dir()
    except RepoError:
        return None


def _structural_hits(text: str) -> list[tuple[int, str, str, str]]:
    """(line number, field, line, placeholder) for each `${...}` outside comments and string_value."""
    hits = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        code = line.split("#", 1)[0]
        if "${" not in code or "string_value" in code:
            continue
        matches = _STRUCTURAL.findall(code)
        if matches:
            hits += [(lineno, field, line, name) for field, name in matches]
        else:
            hits += [(lineno, "a field", line, name) for name in re.findall(r"\$\{(\w+)\}", code)]
    return hits
