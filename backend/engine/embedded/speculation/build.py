"""What speculation gets of the target engine (`TargetParts`), and the engine-side method for a parsed speculative
config: n-gram and lookahead (tritonllm.spec_decode), Medusa heads (spec_decode.medusa, scored with the target's
LM head), a draft model (draft_model.py) or an EAGLE draft layer (eagle_proposer.py with eagle.py / eagle3.py).
A checkpoint that cannot be loaded is an InvalidRequestError naming speculative_config.speculative_model_dir."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ...types import InvalidRequestError
from ..block_manager import BlockManager
from ..model_runner import ModelRunner
from ..network.llama import LlamaForCausalLM
from ..network.model_config import ModelConfig, ModelLoadError
from .methods import LookaheadMethod, ProposerMethod, SpeculativeMethod

WHERE = "speculative_config.speculative_model_dir"


@dataclass
class TargetParts:
    """The target engine's parts that speculation uses: its model (embedding, LM head, captured layers) and model
    config, the runner (hidden states of all positions, KV slot copies), the block manager (the target's KV slots),
    and the dtype and device drafters are built on."""

    model: LlamaForCausalLM
    model_config: ModelConfig
    runner: ModelRunner
    block_manager: BlockManager
    dtype: torch.dtype
    device: torch.device
    # The target's embedding and head as a drafter reads them, made on first call: the model itself, or under
    # tensor parallelism whole copies of both (parallel/whole_ends.py; the rank's own are vocabulary slices).
    drafter_view: Optional[Callable[[], Any]] = None

    def ends(self):
        return self.model if self.drafter_view is None else self.drafter_view()


def build_method(spec_config, target: TargetParts) -> Optional[SpeculativeMethod]:
    """The engine-side method for a parsed speculative config (None without one)."""
    if spec_config is None:
        return None
    kind = spec_config.decoding_type
    if kind == "Eagle" and target.model_config.gemma is not None:
        raise InvalidRequestError(
            f"speculative_config.decoding_type=Eagle is not supported for {target.model_config.architecture}: "
            "EAGLE draft layers are Llama layers, fed the target's embeddings unscaled and scored without its "
            "logit soft-capping"
        )
    if kind == "NGram":
        from tritonllm.spec_decode.ngram import NGramProposer

        return ProposerMethod(NGramProposer(spec_config))
    if kind == "Lookahead":
        return LookaheadMethod(spec_config)
    if kind == "Medusa":
        return ProposerMethod(_medusa_proposer(spec_config, target), needs_hidden=True)
    if kind == "DraftTarget":
        from .draft_model import DraftModelProposer

        return ProposerMethod(DraftModelProposer.for_target(spec_config, target))
    if kind == "Eagle":
        return _eagle_method(spec_config, target)
    raise ValueError(f"speculative_config.decoding_type={kind} is not built yet in the embedded engine")


def _medusa_proposer(spec_config, target: TargetParts):
    from tritonllm.spec_decode.checkpoint_files import CheckpointError
    from tritonllm.spec_decode.medusa import MedusaProposer, load_medusa

    from .draft_head import DraftHead

    try:
        heads = load_medusa(spec_config.speculative_model_dir, target.dtype, target.device)
        mc = target.model_config
        if heads.draft_vocab is not None and int(heads.draft_vocab.max()) >= mc.vocab_size:
            raise ModelLoadError(
                f"the heads' draft_vocab holds token ids past the model's vocabulary ({mc.vocab_size})"
            )
        if heads.shared_lm_head and target.model.config.vocab_size != mc.vocab_size:
            raise ModelLoadError(
                "these Medusa heads share the base model's LM head, which tensor parallelism splits over the ranks "
                "(the heads run on rank 0 alone): use heads with their own projections"
            )
        if heads.shared_lm_head:
            # The heads' ResBlocks feed the target's own output head (prepacked on CPU): one matmul for all heads.
            if heads.hidden_size != mc.hidden_size or heads.vocab_size not in (0, mc.vocab_size):
                raise ModelLoadError(
                    f"heads sharing the base LM head are for hidden size {heads.hidden_size} / "
                    f"vocab {heads.vocab_size or '?'}, the model has {mc.hidden_size} / "
                    f"{mc.vocab_size}"
                )
            heads.share_lm_head(DraftHead(target.model, heads.draft_vocab).logits, mc.vocab_size)
        elif (heads.hidden_size, heads.vocab_size) != (mc.hidden_size, mc.vocab_size):  # own projections
            raise ModelLoadError(
                f"heads are for hidden size {heads.hidden_size} / vocab {heads.vocab_size}, the "
                f"model has {mc.hidden_size} / {mc.vocab_size}"
            )
        return MedusaProposer(
            heads, spec_config.medusa_choices, spec_config.max_draft_len, spec_config.min_path_probability
        )
    except (CheckpointError, ModelLoadError) as exc:
        raise InvalidRequestError(f"{WHERE}: {exc}") from None


def _eagle_method(spec_config, target: TargetParts):
    """EAGLE-1/2 or EAGLE-3 (decoding_type Eagle3): the draft layer of `speculative_model_dir` on the target's dtype
    and device, with as many KV slots as the target's cache (one layer's worth). An EAGLE-3 draft reads the outputs
    of some target layers, which the target then returns with its final hidden states."""
    from .eagle_proposer import EagleMethod, EagleProposer

    try:
        draft = _load_eagle_draft(spec_config, target)
    except ModelLoadError as exc:
        raise InvalidRequestError(f"{WHERE}: {exc}") from None
    if spec_config.eagle3:
        target.model.capture_layers = tuple(draft.capture_layers)
    manager = target.block_manager
    dynamic = spec_config.use_dynamic_tree  # EAGLE-2's tree, else a chain or the static eagle_choices tree
    return EagleMethod(
        EagleProposer(
            draft,
            target.ends(),
            spec_config.max_draft_len,
            spec_config.eagle_choices,
            manager.num_blocks,
            manager.block_size,
            target.dtype,
            target.device,
            dynamic_top_k=spec_config.dynamic_tree_max_topK if dynamic else None,
            total_tokens=spec_config.max_total_draft_tokens if dynamic else None,
        )
    )


def _load_eagle_draft(spec_config, target: TargetParts):
    from .eagle import load_eagle
    from .eagle3 import load_eagle3

    folder, mc = spec_config.speculative_model_dir, target.model_config
    if not spec_config.eagle3:
        return load_eagle(folder, target.dtype, target.device, target=mc)
    return load_eagle3(
        folder,
        target.dtype,
        target.device,
        target=mc,
        target_num_layers=mc.num_layers,
        capture_layers=spec_config.eagle3_layers_to_capture,
    )
