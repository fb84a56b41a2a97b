"""Speculative decoding inside the embedded engine: the parts built on the engine's layers, runner and block
manager. speculator.py drafts before the schedule and verifies after the forward (with
tritonllm.spec_decode.acceptance); build.py turns a speculative config into a method (methods.py) given the
target's parts (`TargetParts`, never the engine core); eagle_proposer.py and draft_model.py run draft layers and
draft models on their own KV caches; eagle.py / eagle3.py are the EAGLE draft layers (their files:
spec_decode.eagle_format); draft_head.py scores drafts with the target's LM head.

Imports go one way: this package uses tritonllm.spec_decode's engine-free algorithms and formats, never
spec_decode.training; of the engine, only engine_core constructs the Speculator."""
