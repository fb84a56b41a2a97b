"""DraftTarget speculation: a second, smaller model with its own paged KV cache drafts greedy chains.

Each target sequence has a shadow sequence here. Before drafting, the shadow keeps the KV of its longest prefix
that agrees with the target's committed tokens (rejected drafts fall away by that rule, whatever happened in
between: acceptance, preemption, a stop) and computes the rest in one catch-up forward, whose last row gives the
first draft token; each further draft token is one single-token forward over all drafting sequences."""

from __future__ import annotations

from typing import Optional
from typing import Sequence as Seq

from tritonllm.spec_decode.proposer import ProposalInput, draft_budget
from tritonllm.spec_decode.tree import DraftTree

from ...types import InvalidRequestError, SamplingParams
from ..block_manager import BlockManager
from ..loader import load_model
from ..model_runner import ModelRunner
from ..network.model_config import ModelLoadError
from ..scheduler import ScheduledBatch
from ..sequence import Sequence

_SHADOW_PARAMS = SamplingParams(max_tokens=1)


class DraftModelProposer:
    def __init__(self, model, model_config, max_draft_len: int, num_blocks: int, block_size: int, dtype, device):
        mc = model_config
        self.max_draft_len = max_draft_len
        self.blocks = BlockManager(num_blocks, block_size)
        self.runner = ModelRunner(
            model, mc.num_layers, mc.num_kv_heads, mc.head_dim, num_blocks, block_size, dtype, device
        )
        self.shadows: dict[int, Sequence] = {}

    @classmethod
    def for_target(cls, spec_config, target) -> "DraftModelProposer":
        """The draft model of `speculative_model_dir`, in the target's dtype and device, with as many KV slots
        (`target`: the engine's TargetParts)."""
        where = "speculative_config.speculative_model_dir"
        try:
            model, config = load_model(spec_config.speculative_model_dir, target.dtype, target.device)
        except ModelLoadError as exc:
            raise InvalidRequestError(f"{where}: {exc}") from None
        if config.vocab_size != target.model_config.vocab_size:
            raise InvalidRequestError(
                f"{where}: the draft model's vocabulary ({config.vocab_size}) differs from the "
                f"target's ({target.model_config.vocab_size}); they must share a tokenizer"
            )
        manager = target.block_manager
        return cls(
            model,
            config,
            spec_config.max_draft_len,
            manager.num_blocks,
            manager.block_size,
            target.dtype,
            target.device,
        )

    def propose(self, batch: Seq[ProposalInput]) -> list[DraftTree]:
        wanted = {item.seq_id: draft_budget(self.max_draft_len, item) for item in batch}
        drafting = [shadow for shadow in (self._synced(item, wanted[item.seq_id]) for item in batch) if shadow]
        for _ in range(max((wanted[s.seq_id] for s in drafting), default=0)):
            active = [s for s in drafting if len(s.output_token_ids) < wanted[s.seq_id]]
            self._forward(active)
        return [
            DraftTree.chain(
                self.shadows[item.seq_id].output_token_ids
                if item.seq_id in self.shadows and wanted[item.seq_id]
                else []
            )
            for item in batch
        ]

    def _synced(self, item: ProposalInput, num_draft: int) -> Optional[Sequence]:
        """The shadow holding `item`'s committed tokens, its KV kept as far as it agrees; None: no draft."""
        if num_draft <= 0:
            return None
        history = list(item.token_ids)
        shadow = self.shadows.get(item.seq_id)
        if shadow is None:
            shadow = self.shadows[item.seq_id] = Sequence(item.seq_id, item.seq_id, 0, history, _SHADOW_PARAMS)
        cached = shadow.all_token_ids()[: shadow.num_computed_tokens]
        agree = next((i for i, (a, b) in enumerate(zip(cached, history)) if a != b), min(len(cached), len(history)))
        shadow.prompt_token_ids, shadow.output_token_ids = history, []
        shadow.num_computed_tokens = min(agree, len(history) - 1)  # the last token is fed again: it drafts
        if not self.blocks.grow(shadow, len(history) + num_draft - 1):
            self.release(item.seq_id)  # the draft cache is full: this sequence decodes plainly this step
            return None
        return shadow

    def _forward(self, shadows: list[Sequence]) -> None:
        batch = ScheduledBatch()
        for shadow in shadows:
            batch.add(shadow, shadow.num_uncomputed_tokens)
        out = self.runner.execute(batch, self.blocks.take_newly_allocated())
        tokens = out.logits.argmax(dim=-1).tolist()
        for shadow in shadows:
            shadow.num_computed_tokens = shadow.num_tokens
        for shadow, token in zip(out.seqs, tokens):
            shadow.output_token_ids.append(token)

    def release(self, seq_id: int) -> None:
        shadow = self.shadows.pop(seq_id, None)
        if shadow is not None:
            self.blocks.free(shadow)
