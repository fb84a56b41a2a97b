"""One rank of the tensor- and pipeline-parallel tests: `python tp_worker.py MODEL_DIR OUT_JSON` under a
torchrun-style environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; TP_WORKER_PIPELINE: pipeline_parallel_size,
1 by default, the rest of the world splits each stage's layers). Rank 0 runs `run_scenarios` and writes what it saw;
a follower runs each engine's steps (run_follower) and writes how many. The single-rank reference runs the same
`run_scenarios` in the test process. With a third argument (`follower` / `leader`), `lost_rank`: one rank is killed
mid-service and the other writes what it saw."""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from tritonllm.engine.config import EngineConfig
from tritonllm.engine.embedded.engine import EmbeddedEngine
from tritonllm.engine.embedded.engine_core import EngineCore
from tritonllm.engine.types import GuidedDecodingParams, LoRARequest, SamplingParams

PROMPTS = [[5, 17, 42, 99, 3, 250], [7, 8, 9], [600, 512, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [33]]
SHARED = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]  # three blocks of 4: reused by the second prompt


def layout() -> tuple[int, int]:
    """(tensor_parallel_size, pipeline_parallel_size) of this run's world."""
    pipeline = int(os.environ.get("TP_WORKER_PIPELINE", "1"))
    return int(os.environ["WORLD_SIZE"]) // pipeline, pipeline


def engine_settings(model_dir: str, tensor_parallel_size: int, pipeline_parallel_size: int = 1) -> list[dict]:
    """The engines each scenario runs on, in order: roomy with prefix reuse, then a KV budget that preempts."""
    base = {
        "model": model_dir,
        "dtype": "float32",
        "device": "cpu",
        "max_batch_size": 4,
        "max_num_tokens": 64,
        "tensor_parallel_size": tensor_parallel_size,
        "pipeline_parallel_size": pipeline_parallel_size,
    }
    return [
        {**base, "kv_cache_config": {"tokens_per_block": 4, "max_tokens": 256, "enable_block_reuse": True}},
        {
            **base,
            "scheduler_config": {"capacity_scheduler_policy": "MAX_UTILIZATION"},
            "kv_cache_config": {"tokens_per_block": 4, "max_tokens": 40, "enable_block_reuse": False},
        },
    ]


def greedy(max_tokens: int, logits: bool = False) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, return_generation_logits=logits, return_context_logits=logits
    )


def drain(core: EngineCore) -> None:
    while core.has_work:
        core.step()


def generate(core: EngineCore, prompts, params: SamplingParams, first_id: int) -> list:
    requests = [core.add_request(first_id + i, p, params) for i, p in enumerate(prompts)]
    drain(core)
    return [r.seqs[0] for r in requests]


def roomy_scenarios(core: EngineCore) -> dict:
    start = core.block_manager.num_free_blocks
    seqs = generate(core, PROMPTS, greedy(12, logits=True), 0)
    tokens = [s.output_token_ids for s in seqs]
    logits = [[row.tolist() for row in s.generation_logits[:3]] for s in seqs[:1]]
    context = [torch.cat(s.context_logits)[:, :50].tolist() for s in seqs[:2]]  # the prompts' rows, vocab cut
    aborted = core.add_request(100, PROMPTS[2], greedy(20))
    core.step()
    core.step()
    core.abort_request(100)
    drain(core)
    reused_before = core.block_manager.num_reused_blocks
    prefix = [s.output_token_ids for s in generate(core, [SHARED + [1, 2], SHARED + [3, 4]], greedy(8), 200)]
    prefix += [s.output_token_ids for s in generate(core, [SHARED + [5]], greedy(8), 300)]
    return {
        "tokens": tokens,
        "logits": logits,
        "context_logits": context,
        "aborted_tokens": len(aborted.seqs[0].output_token_ids),
        "prefix_tokens": prefix,
        "reused_blocks": core.block_manager.num_reused_blocks - reused_before,
        "free_blocks": [start, core.block_manager.num_free_blocks],
    }


def preempting_scenarios(core: EngineCore) -> dict:
    start = core.block_manager.num_free_blocks
    seqs = generate(core, PROMPTS[:3], greedy(16), 0)
    return {
        "tokens": [s.output_token_ids for s in seqs],
        "preemptions": sum(s.metrics.num_preemptions for s in seqs),
        "free_blocks": [start, core.block_manager.num_free_blocks],
    }


def served_settings(model_dir: str, tensor_parallel_size: int, pipeline_parallel_size: int = 1) -> list[dict]:
    """The threaded engines that follow the core scenarios: the roomy one again, beam search, speculative decoding
    by n-grams and by a draft model (the model itself: every draft token accepted), guided decoding."""
    roomy = engine_settings(model_dir, tensor_parallel_size, pipeline_parallel_size)[0]
    draft = {"decoding_type": "DraftTarget", "max_draft_len": 3, "speculative_model_dir": model_dir}
    served = [
        roomy,
        {**roomy, "max_beam_width": 3},
        {**roomy, "speculative_config": {"decoding_type": "NGram", "max_draft_len": 3, "max_matching_ngram_size": 2}},
        {**roomy, "speculative_config": draft},
        {**roomy, "guided_decoding_backend": "xgrammar"},
    ]
    if lora_adapters():
        served.append({**roomy, "enable_lora": True, "lora_config": {"max_lora_rank": 4, "max_loras": 2}})
    if pipeline_parallel_size == 1 and os.environ.get("TP_WORKER_MEDUSA"):
        medusa = {"decoding_type": "Medusa", "speculative_model_dir": os.environ["TP_WORKER_MEDUSA"]}
        served.append({**roomy, "speculative_config": {**medusa, "medusa_choices": [[0], [1], [0, 0], [0, 1]]}})
    if pipeline_parallel_size == 1 and os.environ.get("TP_WORKER_EAGLE"):  # EAGLE-1, then EAGLE-3's folder
        eagle, eagle3 = os.environ["TP_WORKER_EAGLE"].split(os.pathsep)
        chain = {"max_draft_len": 3, "eagle_choices": [[0], [0, 0], [0, 0, 0], [1]]}
        served.append(
            {**roomy, "speculative_config": {"decoding_type": "Eagle", "speculative_model_dir": eagle, **chain}}
        )
        served.append(
            {**roomy, "speculative_config": {"decoding_type": "Eagle3", "speculative_model_dir": eagle3, **chain}}
        )
    return served


LORA_PLAN = [0, None, 1, 2, 0, None]  # the LoRA scenario's adapter (index) per request, None: the base model


def lora_adapters() -> list[str]:
    """PEFT adapter folders for the LoRA scenario (TP_WORKER_LORA, separated by os.pathsep); none: no scenario."""
    value = os.environ.get("TP_WORKER_LORA", "")
    return value.split(os.pathsep) if value else []


def run_scenarios(model_dir: str, tensor_parallel_size: int, pipeline_parallel_size: int = 1) -> list[dict]:
    """Rank 0's (or the single rank's) view of every scenario; each engine is shut down after its scenario."""
    results = []
    all_settings = engine_settings(model_dir, tensor_parallel_size, pipeline_parallel_size)
    for settings, scenario in zip(all_settings, (roomy_scenarios, preempting_scenarios)):
        core = EngineCore(EngineConfig.from_dict(settings))
        results.append(scenario(core))
        results[-1]["steps"] = core.num_steps
        core.shutdown()
    results += [served_scenario(s) for s in served_settings(model_dir, tensor_parallel_size, pipeline_parallel_size)]
    return results


def served_scenario(settings: dict) -> dict:
    """The threaded EmbeddedEngine over `settings`: greedy requests (or beams of 3 with max_beam_width); its
    shutdown must stop the followers."""
    engine = EmbeddedEngine(EngineConfig.from_dict(settings))
    if settings.get("enable_lora"):
        return lora_scenario(engine)
    drafts = record_drafts(engine)
    beams = settings.get("max_beam_width", 1)
    params = greedy(16) if beams == 1 else SamplingParams(max_tokens=8, end_id=2, beam_width=beams, n=beams)
    if settings.get("guided_decoding_backend"):
        params = SamplingParams(max_tokens=10, end_id=2, guided_decoding=GuidedDecodingParams(regex="[a-e]+( [a-e]+)*"))
    outputs = [engine.generate(p, params).outputs for p in PROMPTS[:2] + [SHARED * 2]]
    stats = engine.wait_idle()
    engine.shutdown()
    return {
        "tokens": [[o.token_ids for o in outs] for outs in outputs],
        "drafted": _draft_metric(outputs, "total_draft_tokens"),
        "accepted": _draft_metric(outputs, "total_accepted_draft_tokens"),
        "free_blocks": [stats.num_total_blocks, stats.num_free_blocks],
        "steps": stats.num_steps,
        "drafts": drafts,
    }


def record_drafts(engine: EmbeddedEngine) -> list:
    """Every draft the engine's speculative method proposes, as token lists (filled while the engine runs): what
    the drafter read (hidden states, embedding, head) shows in them even when none is accepted."""
    method, drafts = engine.core.speculator.method, []
    if method is None:
        return drafts
    propose = method.drafts

    def recorded(items, seqs):
        proposed = propose(items, seqs)
        drafts.append([None if d is None else d.tokens for d in proposed])
        return proposed

    method.drafts = recorded
    return drafts


def lora_scenario(engine: EmbeddedEngine) -> dict:
    """Requests with each adapter and without, all at once (two slots for three adapters: one is evicted and
    loaded again), then the base model alone."""
    adapters = lora_adapters()
    plan = LORA_PLAN
    handles = [
        engine.generate_async(
            PROMPTS[i % len(PROMPTS)],
            greedy(10),
            lora_request=None if a is None else LoRARequest(f"a{a}", a + 1, adapters[a]),
        )
        for i, a in enumerate(plan)
    ]
    tokens = [h.result().outputs[0].token_ids for h in handles]
    base = [engine.generate(PROMPTS[i % len(PROMPTS)], greedy(10)).outputs[0].token_ids for i in range(len(plan))]
    stats = engine.wait_idle()
    engine.shutdown()
    return {
        "tokens": tokens,
        "base_tokens": base,
        "free_blocks": [stats.num_total_blocks, stats.num_free_blocks],
        "steps": stats.num_steps,
    }


def _draft_metric(outputs, name: str) -> int:
    return sum(getattr(o.request_perf_metrics, name) for outs in outputs for o in outs if o.request_perf_metrics)


def lost_rank(model_dir: str, out_path: str, lost: str) -> int:
    """A rank dies mid-service (the test kills it once `out_path`.ready exists). `lost` = "follower": rank 0 then
    asks for more and writes what it got; "leader": the follower writes how its loop ended; "hung": as "follower",
    but the follower is stopped (SIGSTOP), not killed, and rank 0 exits at once (its engine thread still waits)."""
    from tritonllm.engine.embedded.parallel.follower import run_follower
    from tritonllm.engine.embedded.parallel.group import RankLostError, leave_group
    from tritonllm.engine.seam import EngineError

    settings = EngineConfig.from_dict(engine_settings(model_dir, *layout())[0])
    result: dict = {}
    if int(os.environ["RANK"]) == 0:
        engine = EmbeddedEngine(settings)
        result["before"] = engine.generate(PROMPTS[0], greedy(4)).outputs[0].token_ids
        open(out_path + ".ready", "w").close()
        if lost == "leader":
            time.sleep(600)  # killed here
        while not os.path.exists(out_path + ".go"):  # the follower is gone once this exists
            time.sleep(0.05)
        for key in ("during", "after"):
            try:
                engine.generate(PROMPTS[1], greedy(4))
                result[key] = "answered"
            except EngineError as err:
                result[key] = str(err)
        result["failed"] = engine.failed
        if lost == "hung":
            with open(out_path, "w") as out:
                json.dump(result, out)
            os._exit(0)  # the engine thread waits on the stopped rank for good: no clean shutdown to wait for
        engine.shutdown()
    else:
        try:
            run_follower(settings)
            result["follower"] = "stopped by rank 0"
        except RankLostError as err:
            result["follower"] = str(err)
    leave_group()
    with open(out_path, "w") as out:
        json.dump(result, out)
    return 0


def main(model_dir: str, out_path: str) -> None:
    from tritonllm.engine.embedded.parallel.follower import run_follower
    from tritonllm.engine.embedded.parallel.group import leave_group

    if int(os.environ["RANK"]) == 0:
        result = run_scenarios(model_dir, *layout())
    else:
        settings = engine_settings(model_dir, *layout()) + served_settings(model_dir, *layout())
        result = [{"steps": run_follower(EngineConfig.from_dict(s))} for s in settings]
    with open(out_path, "w") as out:
        json.dump(result, out)
    leave_group()


def end_process(code: int) -> None:
    """Exit without the interpreter's teardown once the group is left and the output flushed: a C++ destructor of
    that teardown aborts a rank now and then ("terminate called without an active exception"), as it did the
    `tritonllm follow` processes (commands/follow.py ends the same way), reporting a clean run as a crash."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    if len(sys.argv) > 3:
        end_process(lost_rank(sys.argv[1], sys.argv[2], sys.argv[3]))
    main(sys.argv[1], sys.argv[2])
    end_process(0)
