"""The embedded engine's synchronous core: admits requests, runs one scheduled step at a time, applies sampled
tokens and finish rules. Not thread-safe: `EmbeddedEngine` drives it from one thread."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Optional

import torch

from ..config import EngineConfig
from ..seam import EngineStats
from ..types import CompletionOutput, InvalidRequestError, RequestOutput, SamplingParams, require_guided_backend
from .assembly import attention_kernels, build_runner, kv_block_count, load_target, lora_runtime, place
from .beam_requests import BeamRequests, beam_snapshot
from .beam_search import BeamSearch
from .block_manager import BlockManager, blocks_for
from .cuda_graphs import graphs_supported
from .device import resolve_device
from .guided import build_guided_decoder
from .model_runner import StepOutput
from .network.layers import use_fused_kernels
from .quant.fusion import defer_fp8_scales, fold_int4_norms, hand_fp8_rows
from .request import EngineRequest
from .sampler import SampledTokens, sample, sample_on_device
from .scheduler import ScheduledBatch, Scheduler
from .sequence import Sequence
from .speculation.build import TargetParts
from .speculation.speculator import Speculator
from .stop_rules import matched_stop

if TYPE_CHECKING:
    from tritonllm.lora.cache import CachedAdapter
    from tritonllm.lora.runtime import AdapterRef

log = logging.getLogger("tritonllm.engine")
STEP_RANGE_PREFIX = "step "


class EngineCore:
    def __init__(self, config: EngineConfig):
        started = time.monotonic()
        problems = config.embedded_unsupported()
        if problems:
            raise InvalidRequestError("the embedded engine cannot honour: " + "; ".join(problems))
        self.parallel = None  # tensor and pipeline parallelism (parallel/setup.py); None in a single process
        if config.world_size > 1:
            from .parallel.setup import Parallel

            self.parallel = Parallel.start(config, resolve_device(config.device))
            config = Parallel.adjusted(config)
        self.config = config
        placement = place(config, self.parallel)
        self.device, self.attn_backend = placement.device, placement.attn_backend
        self.dtype, self.kv_dtype = placement.dtype, placement.kv_dtype
        target = load_target(config, self.parallel, placement)
        self.model, self.model_config = target.model, target.config
        self.max_seq_len, self.attention_windows = target.max_seq_len, target.attention_windows
        block_size = config.kv_cache_config.tokens_per_block
        kernels = attention_kernels(placement, target, block_size)
        if fused_kernels_wanted(self.attn_backend, self.device):
            use_fused_kernels(self.model)
            hand_fp8_rows(self.model, self.device)
        graph_settings = config.cuda_graph_settings() if graphs_supported(self.device) else None
        num_blocks = kv_block_count(config, self.parallel, placement, target, kernels, graph_settings is not None)
        self.block_manager = BlockManager(num_blocks, block_size, config.kv_cache_config.enable_block_reuse)
        self.lora = lora_runtime(config, self.parallel, placement, self.model_config)
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_batch_size,
            config.max_num_tokens,
            config.enable_chunked_prefill,
            guaranteed_no_evict=config.scheduler_config.capacity_scheduler_policy == "GUARANTEED_NO_EVICT",
            max_loras=self.lora.settings.max_loras if self.lora else None,
        )
        self.runner = build_runner(config, self.parallel, placement, target, num_blocks, kernels, graph_settings)
        self.runner.lora = self.lora
        self.speculator = self._speculator()
        if fused_kernels_wanted(self.attn_backend, self.device):
            defer_fp8_scales(self.model, self.device, lora_enabled=self.lora is not None)
            fold_int4_norms(self.model, self.device, lora_enabled=self.lora is not None)
        # Grammars over the logits' width (the model's vocabulary, which may pad the tokenizer's).
        self.guided = build_guided_decoder(
            config.guided_decoding_backend, config.tokenizer or config.model, self.model_config.vocab_size
        )
        self.speculator.guide = self.guided
        self.beams = BeamRequests(
            self.scheduler,
            self.block_manager,
            self.runner.copy_block,
            self.new_seq_id,
            self.finish_sequence,
            self.max_seq_len,
            self.guided,
        )
        self.requests: dict[int, EngineRequest] = {}
        self.overlap = overlap_wanted(config, self.device)
        self.num_host_bound = 0  # live requests whose steps need their latest tokens on the host (no overlap)
        self._pending: Optional[SampledTokens] = None  # the last overlapped step's tokens, not applied yet
        self.num_steps = 0
        # Wall seconds inside step() by the phase of the batch it scheduled (bench engine reports them).
        self.step_seconds = {"prefill": 0.0, "decode": 0.0}
        self.token_wait_seconds = 0.0  # of those, waiting for an overlapped step's tokens (the GPU's share)
        self._phase = "decode"
        self.num_overlapped_steps = 0
        self.last_context_tokens = 0
        self._seq_ids = itertools.count()
        log.info(
            "embedded engine ready in %.1f s: %s on %s (%s), %s attention, %d KV blocks x %d tokens (%s), "
            "max_seq_len %d, max_batch_size %d, max_num_tokens %d",
            time.monotonic() - started,
            config.model,
            self.device,
            self.dtype,
            self.attn_backend,
            num_blocks,
            block_size,
            self.kv_dtype,
            self.max_seq_len,
            config.max_batch_size,
            config.max_num_tokens,
        )

    def _speculator(self) -> Speculator:
        """The speculator over this target. Drafts are proposed and accepted on rank 0 alone: the other ranks run
        its plans and build no drafter; rank 0's drafter reads whole copies of the target's embedding and head."""
        config = self.config
        parts = TargetParts(self.model, self.model_config, self.runner, self.block_manager, self.dtype, self.device)
        if self.parallel is not None:
            parallel = self.parallel
            parts.drafter_view = lambda: parallel.whole_ends(config.model, self.dtype, config.load_format)
        drafting = self.parallel is None or self.parallel.is_leader
        return Speculator(parts, config.speculative_settings() if drafting else None)

    def new_seq_id(self) -> int:
        return next(self._seq_ids)

    # -- requests ---------------------------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError for a request this engine can never run."""
        params.validate(self.max_seq_len)
        require_guided_backend(params, self.config.guided_decoding_backend)
        if params.beam_width > self.config.max_beam_width:
            raise InvalidRequestError(
                f"beam_width={params.beam_width} exceeds the engine's max_beam_width {self.config.max_beam_width}"
            )
        prompt_len = len(prompt_token_ids)
        if prompt_len == 0:
            raise InvalidRequestError("the prompt is empty: at least one input token is required")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"input token id {bad[0]} is outside the vocabulary [0, {vocab})")
        total = prompt_len + params.max_tokens
        if total > self.max_seq_len:
            raise InvalidRequestError(
                f"prompt length {prompt_len} + max_tokens {params.max_tokens} = {total} "
                f"exceeds max_seq_len {self.max_seq_len}"
            )
        if not self.config.enable_chunked_prefill and prompt_len > self.config.max_num_tokens:
            raise InvalidRequestError(
                f"prompt length {prompt_len} exceeds max_num_tokens "
                f"{self.config.max_num_tokens} (enable chunked prefill for longer prompts)"
            )
        bad = [t for t in params.draft_tokens or () if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(
                f"draft token id {bad[0]} (draft_input_ids) is outside the vocabulary [0, {vocab})"
            )
        if params.draft_logits is not None and params.draft_logits.shape[-1] != vocab:
            raise InvalidRequestError(
                f"draft_logits has {params.draft_logits.shape[-1]} columns, the vocabulary {vocab}"
            )
        if params.lookahead_config is not None:
            self.speculator.check_lookahead(params.lookahead_config)
        if params.guided_decoding is not None and params.guided and self.guided is not None:
            self.guided.compile(params.guided_decoding)  # a guide that does not compile fails here, cached if it does
            if params.guided_prefix_len:
                if params.guided_prefix_len > prompt_len:
                    raise InvalidRequestError(
                        f"guided_prefix_len={params.guided_prefix_len} exceeds the prompt's {prompt_len} tokens"
                    )
                self.guided.check_prefix(params.guided_decoding, prompt_token_ids[-params.guided_prefix_len :])
        needed = blocks_for(total, self.block_manager.block_size) * params.beam_width
        if needed > self.block_manager.num_blocks:
            beams = f" ({params.beam_width} beams)" if params.beam_width > 1 else ""
            raise InvalidRequestError(
                f"the request needs {needed} KV blocks{beams} but the cache holds only {self.block_manager.num_blocks}"
            )

    def prepare_lora(self, lora_request) -> Optional[AdapterRef]:
        """Check a LoRARequest on the caller's thread (None without one)."""
        if lora_request is None:
            return None
        if self.lora is None:
            raise InvalidRequestError(
                "this request names a LoRA adapter but LoRA is not enabled (set enable_lora: "
                "true / lora_config in model.yaml)"
            )
        from tritonllm.lora.runtime import AdapterRef, LoraRequestError

        if isinstance(lora_request, AdapterRef):
            return lora_request
        try:
            return self.lora.prepare(lora_request)
        except (LoraRequestError, ValueError) as exc:
            raise InvalidRequestError(str(exc)) from None

    def add_request(
        self, request_id: int, prompt_token_ids: list[int], params: SamplingParams, lora_request=None
    ) -> EngineRequest:
        self.validate(prompt_token_ids, params)
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id} is already running")
        lora = self._acquire_lora(self.prepare_lora(lora_request))
        request = EngineRequest(request_id, list(prompt_token_ids), params, lora=lora)
        if params.beam_width > 1:  # one live beam until the first step forks it
            most_tokens = min(params.max_tokens, self.max_seq_len - len(prompt_token_ids))
            request.beam = BeamSearch.for_params(params, most_tokens)
        for index in range(1 if request.beam else params.n):
            seq = Sequence(
                self.new_seq_id(),
                request_id,
                index,
                request.prompt_token_ids,
                params,
                generator=_generator(params.seed, index),
                lora=lora,
            )
            request.seqs.append(seq)
            if params.guided and self.guided is not None:
                self.guided.start(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = request
        self.num_host_bound += needs_host_tokens(params)
        return request

    def _acquire_lora(self, ref: Optional[AdapterRef]) -> Optional[CachedAdapter]:
        if ref is None:
            return None
        from tritonllm.lora.runtime import LoraRequestError

        assert self.lora is not None  # prepare_lora refuses adapters while LoRA is off
        try:
            return self.lora.acquire(ref)
        except LoraRequestError as exc:
            raise InvalidRequestError(str(exc)) from None

    def abort_request(self, request_id: int) -> Optional[EngineRequest]:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.num_host_bound -= needs_host_tokens(request.params)
        if request.lora is not None:
            assert self.lora is not None  # only an engine with LoRA pins adapters
            self.lora.release(request.lora)
        for seq in request.seqs:
            if not seq.is_finished:
                seq.finish("cancelled")
            self.scheduler.remove(seq)
            self.speculator.release(seq)
            self._release_guide(seq)
        return request

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._pending is not None

    # -- stepping ---------------------------------------------------------------------------------------------

    def step(self) -> list[EngineRequest]:
        """Run one step (schedule, run, postprocess); returns the requests that produced tokens or finished in it."""
        started = time.perf_counter()
        try:
            return self._step()
        finally:
            self.step_seconds[self._phase] += time.perf_counter() - started

    def _step(self) -> list[EngineRequest]:
        if self._overlapping():
            return list(self._overlapped_step().values())
        updated = self._resolve_pending()  # leaving overlap: the last overlapped step's tokens first
        batch = self._schedule()
        if batch.is_empty:
            return list(updated.values())
        with step_range(batch):
            out = self._run(batch)
            updated.update(self._postprocess(batch, out))
        self.num_steps += 1
        return list(updated.values())

    def _schedule(self) -> ScheduledBatch:
        """The next batch, with the speculator's drafts for the running sequences proposed first."""
        self.speculator.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        if not batch.is_empty:
            self._note_scheduled(batch)
        return batch

    def _run(self, batch: ScheduledBatch) -> StepOutput:
        out = self.runner.execute(batch, self.block_manager.take_newly_allocated())
        self.speculator.observe(out)
        return out

    def _postprocess(self, batch: ScheduledBatch, out: StepOutput) -> dict[int, EngineRequest]:
        """Count what the step computed, register full blocks for reuse, then sample plain sequences and verify
        the drafted ones."""
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += num_new - seq.num_draft_tokens  # drafts count once accepted
            self.block_manager.register_full_blocks(seq, seq.cache_key)
        updated = self._plain_tokens(out) if out.seqs else {}
        for index, seq in enumerate(out.seqs):
            if seq.draft is not None:
                updated[seq.request_id] = self.requests[seq.request_id]
                self.speculator.verify(out, index, self._append_token)
        return updated

    def _note_scheduled(self, batch) -> None:
        """Per-request metrics of a scheduled step, and how many prompt tokens it computes."""
        now = time.time_ns()
        self.last_context_tokens = 0
        self._phase = batch.phase
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            if not seq.metrics.first_scheduled_time_ns:
                seq.metrics.first_scheduled_time_ns = now
            if seq.num_computed_tokens < len(seq.prompt_token_ids):
                seq.metrics.prefill_steps += 1
                self.last_context_tokens += min(num_new, len(seq.prompt_token_ids) - seq.num_computed_tokens)

    # -- the overlap scheduler (TensorRT-LLM's; `disable_overlap_scheduler`) ------------------------------------

    def _overlapping(self) -> bool:
        """Whether this step may run ahead of the last one's tokens: overlap on, no speculation, and no request
        whose next step needs its latest tokens on the host (needs_host_tokens)."""
        return self.overlap and self.speculator.method is None and self.num_host_bound == 0

    def _overlapped_step(self) -> dict[int, EngineRequest]:
        """Schedule and launch this step while the last step's tokens are still on their way to the host: decoding
        sequences read their input token on the device. Then apply the last step's tokens (finish rules included:
        a sequence that ended there has computed one token too many here, which is dropped)."""
        batch = self.scheduler.schedule()
        if batch.is_empty:  # every running sequence awaits its last token
            return self._resolve_pending()
        self._note_scheduled(batch)
        last = self._pending.tokens if self._pending is not None else None
        with step_range(batch):
            out = self.runner.execute(batch, self.block_manager.take_newly_allocated(), last)
            sampled = SampledTokens(out.seqs, *sample_on_device(out.head_logits, out.seqs))
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += num_new
        for row, seq in enumerate(out.seqs):
            seq.pending_tokens += 1
            seq.pending_row = row
            seq.final_pending = (
                len(seq.output_token_ids) + seq.pending_tokens >= seq.params.max_tokens
                or seq.num_tokens >= self.max_seq_len
            )
        updated = self._resolve_pending()
        for seq in batch.seqs:
            self.block_manager.register_full_blocks(seq, seq.cache_key)
        self._pending = sampled
        self.num_steps += 1
        self.num_overlapped_steps += 1
        return updated

    def _resolve_pending(self) -> dict[int, EngineRequest]:
        """Apply the tokens of the last overlapped step (waiting for their copy to the host)."""
        if self._pending is None:
            return {}
        pending, self._pending = self._pending, None
        updated = {}
        started = time.perf_counter()
        tokens = pending.host()
        self.token_wait_seconds += time.perf_counter() - started
        for seq, token, logprob in zip(pending.seqs, *tokens):
            seq.pending_tokens -= 1
            if seq.is_finished:  # ended (or aborted) while this token was computed
                continue
            updated[seq.request_id] = self.requests[seq.request_id]
            self._append_token(seq, token, logprob)
        return updated

    def _plain_tokens(self, out) -> dict[int, EngineRequest]:
        """Sample the sequences without a draft (one logits row each)."""
        plain = [i for i, seq in enumerate(out.seqs) if seq.draft is None]
        if not plain:
            return {}
        seqs = [out.seqs[i] for i in plain]
        logits = out.logits if len(plain) == out.logits.shape[0] else out.logits[[out.first_rows[i] for i in plain]]
        for row, seq in enumerate(seqs):
            if seq.params.return_generation_logits:  # raw, before the sampler changes them in place
                seq.generation_logits.append(logits[row].cpu().clone())
        updated = self._next_tokens(logits, seqs)
        for i in plain:
            self.speculator.remember_hidden(out, i)
        return updated

    def _next_tokens(self, logits: torch.Tensor, seqs: list[Sequence]) -> dict[int, EngineRequest]:
        updated = {}
        requests = [self.requests[seq.request_id] for seq in seqs]
        rows = [row for row, request in enumerate(requests) if request.beam is None]
        if rows:
            plain = [seqs[row] for row in rows]
            chosen = logits[rows] if len(rows) < len(seqs) else logits
            if self.guided is not None:  # beam rows are masked in their beam step
                self.guided.mask(chosen, plain)
            tokens, logprobs = sample(chosen, plain)
            for seq, token, logprob in zip(plain, tokens, logprobs):
                updated[seq.request_id] = self.requests[seq.request_id]
                self._append_token(seq, token, logprob)
        # Store every beam's logits first: a beam step changes the beams' tokens, so it must not run before a
        # sibling's row of this same step is in (that row would then be stale).
        beam_requests = {}
        for row, (seq, request) in enumerate(zip(seqs, requests)):
            if request.beam is not None:
                request.beam_logits[seq.seq_id] = logits[row]
                beam_requests[request.request_id] = request
        for request in beam_requests.values():
            if all(beam.seq_id in request.beam_logits for beam in request.seqs):
                self.beams.step(request)
                updated[request.request_id] = request
        return updated

    def _append_token(self, seq: Sequence, token: int, logprob: float) -> None:
        now = time.time_ns()
        seq.metrics.first_token_time_ns = seq.metrics.first_token_time_ns or now
        seq.metrics.last_token_time_ns = now
        params = seq.params
        if token == params.end_id and not params.ignore_eos:
            if seq.generation_logits:  # the end token is not returned, nor its logits
                seq.generation_logits.pop()
            self.finish_sequence(seq, "stop", token)
            return
        if self._guide_ends(seq, token):
            return
        seq.output_token_ids.append(token)
        seq.logprobs.append(logprob)
        seq.cumulative_logprob += logprob
        stop = matched_stop(params, token, seq.all_token_ids)
        if stop is not None:
            self.finish_sequence(seq, "stop", stop)
        elif len(seq.output_token_ids) >= params.max_tokens or seq.num_known_tokens >= self.max_seq_len:
            self.finish_sequence(seq, "length")

    def _guide_ends(self, seq: Sequence, token: int) -> bool:
        """Advance a guided sequence's matcher with its new token; True when that ended the sequence: the grammar
        terminated (a stop token, dropped as the end token is), or rejected the token (a bug: then it stops)."""
        if self.guided is None or seq.seq_id not in self.guided.matchers:
            return False
        ended = self.guided.advance(seq, token)
        if ended is None:
            log.error("the grammar of request %d rejected its token %d; ending the sequence", seq.request_id, token)
            self.finish_sequence(seq, "stop")
            return True
        if ended:
            self.finish_sequence(seq, "stop", token)
        return ended

    def _release_guide(self, seq: Sequence) -> None:
        if self.guided is not None:
            self.guided.release(seq)

    def finish_sequence(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        seq.finish(reason, stop_reason)
        self.scheduler.remove(seq)
        self.speculator.release(seq)
        self._release_guide(seq)
        request = self.requests[seq.request_id]
        if request.finished:
            del self.requests[seq.request_id]
            self.num_host_bound -= needs_host_tokens(request.params)
            if request.lora is not None:
                assert self.lora is not None  # only an engine with LoRA pins adapters
                self.lora.release(request.lora)

    def fail_all(self) -> list[EngineRequest]:
        """Drop every request (after an engine error); their blocks are freed."""
        self._pending = None
        failed = list(self.requests.values())
        for request in failed:
            self.abort_request(request.request_id)
        return failed

    def shutdown(self) -> None:
        """Release what outlives the core's requests: under tensor or pipeline parallelism, stop the followers."""
        if self.parallel is not None:
            self.parallel.stop_followers(self.runner)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_total_blocks=self.block_manager.num_blocks,
            num_free_blocks=self.block_manager.num_free_blocks,
            tokens_per_block=self.block_manager.block_size,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_steps=self.num_steps,
            max_seq_len=self.max_seq_len,
            max_batch_size=self.config.max_batch_size,
            max_num_tokens=self.config.max_num_tokens,
            num_cached_blocks=self.block_manager.num_cached_free_blocks,
            num_reused_blocks=self.block_manager.num_reused_blocks,
            num_context_requests=sum(
                1 for s in self.scheduler.running if s.num_computed_tokens < len(s.prompt_token_ids)
            ),
            num_context_tokens=self.last_context_tokens,
            num_paused_requests=sum(1 for s in self.scheduler.waiting if s.metrics.num_preemptions),
        )


def snapshot(request: EngineRequest, mark_delivered: bool) -> RequestOutput:
    """A RequestOutput copy of the request's state; `token_ids_diff` holds what was not delivered before."""
    if request.beam is not None:
        return beam_snapshot(request)
    outputs = []
    for seq in request.seqs:
        generation_logits = (
            torch.stack(seq.generation_logits)
            if seq.params.return_generation_logits and seq.generation_logits
            else None
        )
        outputs.append(
            CompletionOutput(
                index=seq.index,
                token_ids=list(seq.output_token_ids),
                logprobs=list(seq.logprobs),
                cumulative_logprob=seq.cumulative_logprob,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                request_perf_metrics=replace(seq.metrics),
                generation_logits=generation_logits,
                _diff_start=seq.num_delivered_tokens,
            )
        )
        if mark_delivered:
            seq.num_delivered_tokens = len(seq.output_token_ids)
    first = request.seqs[0]
    context_logits = torch.cat(first.context_logits) if first.context_logits else None
    return RequestOutput(
        request.request_id, request.prompt_token_ids, outputs, finished=request.finished, context_logits=context_logits
    )


def step_range(batch: ScheduledBatch):
    """A profiler range around one step's launches, "step prefill" or "step decode": `bench engine --profile`
    splits device time by it (bench_phases.py). Without a profiler it costs a few microseconds a step."""
    return torch.profiler.record_function(STEP_RANGE_PREFIX + batch.phase)


def overlap_wanted(config: EngineConfig, device: torch.device) -> bool:
    """The overlap scheduler runs unless `disable_overlap_scheduler`, on CUDA: there the host prepares a step while
    the GPU runs the last; on CPU the forward runs on the host anyway, so overlapping would only cost the extra
    token a sequence computes after its end."""
    return not config.disable_overlap_scheduler and device.type == "cuda"


def fused_kernels_wanted(attn_backend: str, device: torch.device) -> bool:
    """The norms, rotary embeddings and gated activations as fused Triton kernels: with the Triton attention
    backend on CUDA (where they save launches; in the CPU interpreter they would only cost time)."""
    return attn_backend == "TRITON" and device.type == "cuda"


def needs_host_tokens(params: SamplingParams) -> bool:
    """Whether a request's next step depends on its latest tokens on the host (logit processors, beams, external
    drafts, lookahead, logits to return, a grammar's mask), so that steps must not run ahead of them."""
    return bool(
        params.guided
        or params.beam_width > 1
        or params.embedding_bias is not None
        or params.bad_words
        or params.min_tokens
        or params.repetition_penalty not in (None, 1.0)
        or params.presence_penalty
        or params.frequency_penalty
        or params.draft_tokens
        or params.lookahead_config is not None
        or params.return_context_logits
        or params.return_generation_logits
    )


def _generator(seed: Optional[int], index: int) -> torch.Generator:
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed((seed + index) % (2**63))
    return generator
