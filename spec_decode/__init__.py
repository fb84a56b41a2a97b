"""Speculative decoding: proposers (n-gram, lookahead, Medusa, the EAGLE-1/2 checkpoint format), one verification
path, the Medusa head trainer and `tritonllm bench spec`. Everything here is engine-independent; the embedded engine
drives it from tritonllm.engine.embedded.speculative (with spec_methods.py, draft_model.py and eagle_proposer.py, the
draft model's and the Eagle layer's own KV caches).

Phase 2, engine integration (built as below, except: GUARANTEED_NO_EVICT needs no extra reservation, since drafts
are capped at the tokens a request may still commit; verification samples each row with the request's own
sampler instead of calling `acceptance.*`, which is exact for deterministic drafts, and uses rejection sampling
only for drafts with probabilities; lookahead's window tokens ride after the tree in the same forward):
- Scheduler: a running sequence with k draft nodes schedules 1 + k query tokens (root + nodes) under the same
  "computed tokens catch up with known tokens" rule; drafts count against `max_num_tokens` and are reserved with
  `block_manager.grow(seq, num_computed + 1 + k)`. GUARANTEED_NO_EVICT admission adds max_total_draft_tokens.
- Runner: returns logits (and, for Medusa/Eagle, final-norm hidden states) at all 1 + k positions, not just the
  last; draft tokens are written to KV slots at `root_position + depth`, never hashed for prefix reuse.
- Attention: chains need nothing new (causal). Trees need a per-sequence [1+k, 1+k] ancestor mask
  (`DraftTree.attention_mask`) appended to the causal mask over the cached context in attention.py.
- Verification: `acceptance.greedy_accept` / `rejection_sample_*` on the sampler's processed rows; the committed
  tokens go through the normal finish rules (stop words, max_tokens, end_id) one by one.
- Rollback: num_computed_tokens = tokens before the root + 1 + accepted; for a tree whose accepted path is not a
  prefix of the node order, the accepted nodes' KV is copied down to consecutive slots first. The block manager
  frees tail blocks past the new length. Metrics: total_draft_tokens += k, total_accepted_draft_tokens += accepted.
- Refused at load with a clear error until proven: tree drafts with sampling + draft probabilities, beam search.
"""
