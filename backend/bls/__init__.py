"""The `tensorrt_llm_bls` model's logic: one BLS request runs preprocessing -> tensorrt_llm -> postprocessing.

  request.py      reads and checks a BLS request; builds the preprocessing and tensorrt_llm inputs
  sequences.py    the text of each generated sequence: deltas or accumulated text, cut after a stop word
  llm_calls.py    one tensorrt_llm request: over gRPC (decoupled repository) or BLS exec (non-decoupled)
  grpc_endpoint.py  where this server's gRPC endpoint is
  handler.py      runs one BLS request on its own thread and sends its responses
  server.py       the handlers of one model instance and the thread that watches for cancelled clients

Why tensorrt_llm goes over gRPC in a decoupled repository: with a BLS `exec(decoupled=True)` iterator (TensorRT-LLM's
BLS pattern) and clients cancelling streams among concurrent ones, Triton 2.51's Python backend crashed the whole
server (SIGSEGV) in every one of three stress runs here, after wrong text had reached some clients; and 2.51
cannot cancel such an iterator. A gRPC stream to the server's own endpoint streams just as well, and a `stop`
request with the same id ends it (an engine abort, KV blocks freed) without cancelling the stream, which 2.51's
gRPC front end can also crash on (llm_calls). The same stress runs passed with it (README, "The BLS model")."""
