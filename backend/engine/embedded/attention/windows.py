"""Each layer's attention window: the checkpoint's sliding window (ModelConfig.layer_windows, as transformers
applies it) and TensorRT-LLM's `kv_cache_config.max_attention_window`, resolved once at load.

A window W means a query at position p attends to keys at positions p - W + 1 .. p, the last W tokens itself
included: transformers' sliding-window mask (`kv_idx > q_idx - sliding_window`) and TensorRT-LLM's window of W
cached tokens agree on it. Where both set a window the smaller wins. A window of at least max_seq_len sees every
key (TensorRT-LLM clamps it to max_seq_len), so it becomes None, full attention."""

from __future__ import annotations

import logging
from typing import Optional, Sequence

log = logging.getLogger("tritonllm.engine")


def layer_windows(
    checkpoint_windows: Sequence[Optional[int]],
    configured: Optional[Sequence[int]],
    num_layers: int,
    max_seq_len: int,
) -> tuple[Optional[int], ...]:
    """One window (or None) per layer. `configured` repeats over the layers as in TensorRT-LLM (layer i takes
    entry i % len); entries past the layer count are unused there too, which is worth a warning here."""
    if configured and len(configured) > num_layers:
        log.warning(
            "kv_cache_config.max_attention_window has %d entries for %d layers; the last %d are unused",
            len(configured),
            num_layers,
            len(configured) - num_layers,
        )
    windows = []
    for layer in range(num_layers):
        candidates = [checkpoint_windows[layer] if layer < len(checkpoint_windows) else None]
        if configured:
            candidates.append(configured[layer % len(configured)])
        set_windows = [w for w in candidates if w is not None]
        window = min(set_windows) if set_windows else None
        windows.append(None if window is None or window >= max_seq_len else window)
    return tuple(windows)


def describe(windows: Sequence[Optional[int]]) -> str:
    """For the load log: 'full' or the distinct windows with their layer counts."""
    if not any(windows):
        return "full attention"
    counts: dict[str, int] = {}
    for window in windows:
        key = "full" if window is None else str(window)
        counts[key] = counts.get(key, 0) + 1
    return "attention windows " + ", ".join(f"{key} x {n} layers" for key, n in counts.items())
