"""Speculative decoding's algorithms and formats, free of the engine: of tritonllm outside this package these
modules import only `json_files` (reading JSON files); otherwise torch, numpy and safetensors.

- config.py: `speculative_config` parsed into typed configs (errors: SpecConfigError), choices strings.
- tree.py, proposer.py: draft trees and tree templates; the proposer protocol (ProposalInput -> DraftTree).
- ngram.py, lookahead.py, medusa.py: NGramProposer; LookaheadDecoder and its n-gram pool; Medusa heads, their
  checkpoint format and MedusaProposer.
- acceptance.py: verification, the one rule the embedded engine and the tests run.
- checkpoint_files.py, eagle_format.py: reading and writing Medusa / EAGLE checkpoint folders (errors:
  CheckpointError); data/: the shipped heads and draft, and the texts `tritonllm bench spec` uses.

Elsewhere, each importing these modules, never the other way round:
- tritonllm.engine.embedded.speculation: the engine-bound parts (the speculator that drafts and verifies in the
  embedded engine, the methods, the EAGLE draft layers and proposer, the draft model).
- training/ (tritonllm.spec_decode.training): training Medusa heads and EAGLE drafts, and its data; the one part of
  this package that imports the engine, which never imports it.
- tritonllm.commands.spec, bench_spec, bench_bls_spec: the `tritonllm spec` and `tritonllm bench spec | bls-spec`
  commands, which import the engine and training."""
