"""The `tensorrt_llm_bls` model's logic: one BLS request runs preprocessing -> tensorrt_llm -> postprocessing.

  request.py      reads and checks a BLS request; builds the preprocessing and tensorrt_llm inputs
  sequences.py    the text of each generated sequence: deltas or accumulated text, cut after a stop word
  llm_calls.py    one tensorrt_llm request: over gRPC (decoupled repository) or BLS exec (non-decoupled)
  grpc_endpoint.py  where this server's gRPC endpoint is
  handler.py      runs one BLS request on its own thread and sends its responses
  server.py       the handlers of one model instance and the thread that watches for cancelled clients

Why tensorrt_llm goes over gRPC in a decoupled repository: Triton 2.51's Python stub can crash when a model
sends responses while a BLS `exec(decoupled=True)` iterator is open (docs in the README); a gRPC stream to the
server's own endpoint streams just as well, never opens such an iterator, and can be cancelled (2.51's BLS
iterators cannot), which aborts the engine request and frees its KV blocks."""
