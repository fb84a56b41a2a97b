"""What `tritonllm serve` shows of tritonserver's output and how it finds why a start failed, on lines copied
from real Triton 2.51 runs on a GPU-less machine (a bad parameter, a folder without a tokenizer)."""

from __future__ import annotations

import io
import json
import sys

import pytest

from tritonllm.deploy.server_log import (
    ConsoleFilter,
    OutputPump,
    console_line,
    describe_start_failure,
    is_gpu_noise,
    start_failure_causes,
)
from tritonllm.triton.params import ParameterError
from tritonllm.triton.start_errors import start_error_line

NOISE = [
    'W1201 20:04:58.679086 29877 pinned_memory_manager.cc:273] "Unable to allocate pinned system memory, pinned '
    'memory pool will not be available: CUDA driver version is insufficient for CUDA runtime version"',
    'I1201 20:04:58.679221 29877 cuda_memory_manager.cc:117] "CUDA memory pool disabled"',
    'E1201 20:04:58.679393 29877 server.cc:241] "CudaDriverHelper has not been initialized."',
    "Error: Failed to initialize NVML",
    'W1201 20:05:06.354521 29877 metrics.cc:798] "DCGM unable to start: DCGM initialization error"',
]
BRIDGED = (
    'I1201 20:05:01.334806 29877 logging_bridge.py:21] "[tritonllm.tensorrt_llm_bls] calling tensorrt_llm over '
    'gRPC at localhost:31386"'
)
OURS_MENTIONING_CUDA = (
    'E1201 20:05:01.334806 29877 logging_bridge.py:21] "[tritonllm.engine] device cuda: CUDA driver version is '
    'insufficient for CUDA runtime version"'
)
STRUCTURED = (
    'E1201 20:05:01.127767 29877 start_errors.py:74] "tritonllm start error: {\\"model\\": \\"tensorrt_llm\\", '
    '\\"error\\": \\"ParameterError\\", \\"message\\": \\"tensorrt_llm: parameter \'max_beam_width\' = \'two\' '
    'must be an integer\\", \\"user_error\\": true}"'
)
STUB_FAILURE = (
    'I1201 20:05:01.133430 29877 pb_stub.cc:366] "Failed to initialize Python stub: ParameterError: tensorrt_llm: '
    "parameter 'max_beam_width' = 'two' must be an integer\\n\\nAt:\\n  /src/backend/triton/params.py(59): _get\\n\""
)
TOKENIZER_FAILURE = (
    "E1201 19:56:28.686724 23827 model_lifecycle.cc:642] \"failed to load 'preprocessing' version 1: Internal: "
    "ParameterError: preprocessing: parameter 'tokenizer_dir' = '/m': cannot load a tokenizer\\n\\nAt:\\n  "
    '/src/backend/triton/tokenizer_param.py(23): load_tokenizer_for_model\\n"'
)
BUG_FAILURE = (
    "E1201 19:56:28.686724 23827 model_lifecycle.cc:642] \"failed to load 'postprocessing' version 1: Internal: "
    "KeyError: 'vocab'\\n\\nAt:\\n  /src/backend/models/postprocessing.py(146): initialize\\n\""
)
ENSEMBLE = (
    "E1201 19:56:28.722644 23827 model_repository_manager.cc:703] \"Invalid argument: ensemble 'ensemble' depends "
    "on 'postprocessing' which has no loaded version.\""
)
TABLE = "| tensorrt_llm     | 1       | READY   |"


def test_gpu_less_noise_is_recognised_and_nothing_else():
    assert all(is_gpu_noise(line) for line in NOISE)
    for line in (BRIDGED, OURS_MENTIONING_CUDA, STRUCTURED, STUB_FAILURE, TOKENIZER_FAILURE, ENSEMBLE, TABLE):
        assert not is_gpu_noise(line), line
    assert [console_line(line) for line in NOISE] == [None] * len(NOISE)


def test_our_lines_are_made_readable_and_the_rest_kept():
    assert (
        console_line(BRIDGED)
        == "20:05:01 [tritonllm.tensorrt_llm_bls] calling tensorrt_llm over gRPC at localhost:31386"
    )
    assert console_line(OURS_MENTIONING_CUDA).startswith("20:05:01 ERROR [tritonllm.engine] device cuda")
    assert console_line(STRUCTURED) == (
        "20:05:01 ERROR model 'tensorrt_llm' failed to start: parameter 'max_beam_width' = 'two' must be an integer"
    )
    assert console_line(TABLE) == TABLE and console_line(ENSEMBLE) == ENSEMBLE


def test_a_user_mistake_loses_its_python_frames_on_the_console_a_bug_keeps_them():
    shown = console_line(STUB_FAILURE)
    assert "params.py" not in shown and "must be an integer (traceback: serve --verbose)" in shown
    assert console_line(BUG_FAILURE) == BUG_FAILURE


def test_the_cause_of_a_failed_start_is_our_structured_line_else_tritons():
    lines = NOISE + [BRIDGED, STRUCTURED, STUB_FAILURE, TOKENIZER_FAILURE, ENSEMBLE, TABLE]
    causes = start_failure_causes(lines)
    assert [(c.model, c.message, c.traceback) for c in causes] == [
        ("tensorrt_llm", "parameter 'max_beam_width' = 'two' must be an integer", None),  # ours, the model's prefix cut
        ("preprocessing", "parameter 'tokenizer_dir' = '/m': cannot load a tokenizer", None),  # Triton's, no frames
    ]
    assert describe_start_failure(1, causes).splitlines() == [
        "tritonserver exited with code 1 while starting:",
        "  model 'tensorrt_llm': parameter 'max_beam_width' = 'two' must be an integer",
        "  model 'preprocessing': parameter 'tokenizer_dir' = '/m': cannot load a tokenizer",
    ]


def test_a_bug_keeps_its_traceback():
    (cause,) = start_failure_causes([BUG_FAILURE])
    assert cause.message == "KeyError: 'vocab'" and "postprocessing.py(146): initialize" in cause.traceback
    assert "Traceback" in describe_start_failure(1, [cause])


def test_our_structured_line_round_trips_through_tritons_escaping():
    try:
        raise KeyError("vocab")
    except KeyError as error:
        bug = start_error_line("postprocessing", error)
    line = f"E1201 19:56:28.686724 23827 start_errors.py:74] {json.dumps(bug)}"
    (cause,) = start_failure_causes([line])
    assert cause.model == "postprocessing" and cause.message == "KeyError: 'vocab'"
    assert "Traceback (most recent call last)" in cause.traceback


def test_without_a_failed_model_the_last_errors_are_the_cause():
    port = 'E1201 19:56:28.722644 23827 grpc_server.cc:2558] "Failed to listen on 0.0.0.0:8001: address in use"'
    (cause,) = start_failure_causes(NOISE + [port, TABLE])
    assert cause.model == "" and "address in use" in cause.message


def test_tritons_bare_fatal_line_is_a_cause():
    fatal = "error: creating server: Internal - failed to stat file /repo/tensorrt_llm/1"
    (cause,) = start_failure_causes(NOISE + [BRIDGED, TABLE, fatal])
    assert cause.message == fatal


def test_without_any_error_the_last_plain_lines_are_shown():
    lines = NOISE + ['I1201 20:05:01.1 29877 server.cc:1] "line %d"' % i for i in range(12)] + [TABLE, "+---+"]
    (cause,) = start_failure_causes(lines)
    assert "said no error" not in cause.message and "no error in its output" in cause.message
    shown = cause.message.splitlines()[1:]
    assert len(shown) == 8 and shown[-1].endswith('"line 11"') and shown[0].endswith('"line 4"')
    assert not any("NVML" in line or TABLE in line for line in shown)
    text = describe_start_failure(1, [cause])
    assert text.startswith("tritonserver exited with code 1 while starting:\n") and '"line 11"' in text


def test_the_pump_writes_everything_to_the_file_and_filters_the_console(capsys, tmp_path):
    text = "\n".join([*NOISE, BRIDGED, TABLE]) + "\n"
    log = open(tmp_path / "server.log", "ab")
    lines = OutputPump(io.BytesIO(text.encode()), "filtered", log).start().join(timeout=5)
    assert lines == text.splitlines() and (tmp_path / "server.log").read_text() == text
    assert capsys.readouterr().out.splitlines() == [console_line(BRIDGED), TABLE]
    OutputPump(io.BytesIO(text.encode()), "all").start().join(timeout=5)
    assert capsys.readouterr().out == text


STATUS_TABLE = """\
| Model            | Version | Status                                                                          |
| tensorrt_llm     | 1       | UNAVAILABLE: Internal: ParameterError: tensorrt_llm: parameter 'max_beam_width' |
|                  |         | = 'two' must be an integer                                                      |
|                  |         |                                                                                 |
|                  |         | At:                                                                             |
|                  |         |   /src/backend/triton/params.py(59): _get                                       |
|                  |         |   /src/backend/models/tensorrt_llm.py(27): initialize                           |
| postprocessing   | 1       | UNAVAILABLE: Internal: KeyError: 'vocab'                                        |
|                  |         |                                                                                 |
|                  |         | At:                                                                             |
|                  |         |   /src/backend/models/postprocessing.py(146): initialize                        |
| tensorrt_llm_bls | 1       | READY                                                                           |
+------------------+---------+---------------------------------------------------------------------------------+"""


def test_the_status_table_loses_the_frames_of_a_user_mistake_only():
    keep = ConsoleFilter()
    shown = [line for line in map(keep, STATUS_TABLE.splitlines()) if line is not None]
    table = STATUS_TABLE.splitlines()
    assert shown == table[:4] + table[7:]  # tensorrt_llm's "At:" and frames gone; the bug's kept


def test_a_failing_initialize_logs_one_structured_line_and_still_fails(monkeypatch, tmp_path):
    import fake_pb_utils as fake

    from tritonllm.models.preprocessing import TritonPythonModel

    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake)
    monkeypatch.setattr(fake.Logger, "records", [])
    config = {
        "name": "preprocessing",
        "parameters": {"tokenizer_dir": {"string_value": str(tmp_path)}},
    }
    with pytest.raises(ParameterError):
        TritonPythonModel().initialize({"model_name": "preprocessing", "model_config": json.dumps(config)})
    ((level, message),) = fake.Logger.records
    assert level == "error"
    # as Triton writes it: the message JSON-escaped on one record line
    (cause,) = start_failure_causes([f"E1201 19:56:28.686724 23827 start_errors.py:74] {json.dumps(message)}"])
    assert cause.model == "preprocessing" and cause.traceback is None
    assert cause.message == f"parameter 'tokenizer_dir' = '{tmp_path}': the folder {tmp_path} holds no tokenizer " + (
        "(none of tokenizer.json, tokenizer.model, vocab.json, spiece.model, vocab.txt)"
    )
