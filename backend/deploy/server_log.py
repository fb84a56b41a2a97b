"""Reading tritonserver's output: what `tritonllm serve` shows of it, and why a start failed.

tritonserver writes one record a line, `<level><MMDD> <time> <pid> <file>:<line>] "<message>"`, the message
JSON-escaped (a multi-line message stays on one line), plus its start-up tables (lines that begin with `+` or `|`)
and a few bare lines. On a machine without a GPU it also warns, at every start, about CUDA, NVML, DCGM and pinned
memory: GPU_NOISE lists those lines, which `serve` leaves out of its default output (--verbose and the log file
keep everything).

Our models' lines are shown as `HH:MM:SS [logger] message`, and the Python frames Triton appends to a model's
failure are left out when the failure is a user's mistake (a bad parameter, file or folder).

When a start fails, `start_failure_causes` finds the cause in the lines: first the structured line our models
write when their `initialize` fails (triton/start_errors.py), then Triton's own "failed to load" records, then its
other errors."""

from __future__ import annotations

import json
import re
import threading
from collections import deque
from dataclasses import dataclass
from typing import IO, Iterable, Optional

from tritonllm.triton.start_errors import START_ERROR_MARKER, USER_ERROR_NAMES

_RECORD = re.compile(r"^([IWE])\d{4} (\d\d:\d\d:\d\d)\.\d+\s+\d+ ([\w.\-]+):\d+\] (.*)$")

# Start-up messages of a GPU-less machine, matched as substrings of the message. Conservative on purpose: each is
# a fixed text of tritonserver's own, so no line of ours or of a model's can match one.
GPU_NOISE = (
    "CUDA driver version is insufficient",
    "Failed to initialize NVML",
    "DCGM unable to start",
    "CudaDriverHelper has not been initialized",
    "CUDA memory pool disabled",
    "Unable to allocate pinned system memory",
    "Pinned memory pool disabled",
    "failed to get CUDA device count",
    "Unable to get number of CUDA devices",
)
# Source files of the lines that carry our models' and our own messages: never filtered.
_OUR_FILES = ("logging_bridge.py", "pb_stub.cc", "model_lifecycle.cc", "backend_model.cc")
_TRITON_STATUS = re.compile(r"^(Internal|Invalid argument|Not found|Unavailable|Unknown|Unsupported|Already exists): ")
_FAILED_TO_LOAD = re.compile(r"^failed to load '([^']+)' version \d+: (.*)$", re.DOTALL)
_PYTHON_FRAMES = "\n\nAt:\n"


@dataclass(frozen=True)
class LogRecord:
    level: str  # I, W or E
    time: str  # HH:MM:SS
    source: str  # the C++ or Python file that wrote it
    message: str  # unescaped


def parse_record(line: str) -> Optional[LogRecord]:
    """A tritonserver log record, or None for a table row or a bare line."""
    match = _RECORD.match(line.rstrip("\n"))
    if not match:
        return None
    level, time, source, message = match.groups()
    if len(message) >= 2 and message[0] == message[-1] == '"':
        try:
            message = json.loads(message)
        except ValueError:
            message = message[1:-1]
    return LogRecord(level, time, source, message)


def is_gpu_noise(line: str) -> bool:
    record = parse_record(line)
    if record is not None and (record.source in _OUR_FILES or record.message.startswith("[tritonllm")):
        return False
    text = record.message if record is not None else line
    return any(pattern in text for pattern in GPU_NOISE)


def console_line(line: str) -> Optional[str]:
    """What `serve` prints for one line of tritonserver's output by default: None for GPU noise; our models'
    records (through the logging bridge, and start errors) as `HH:MM:SS [logger] message`; the rest unchanged."""
    if is_gpu_noise(line):
        return None
    record = parse_record(line)
    if record is None:
        return line.rstrip("\n")
    failure = _structured_failure(record)
    if failure is not None:
        return f"{record.time} ERROR model '{failure.model}' failed to start: {failure.text()}"
    if record.source == "logging_bridge.py":
        level = {"W": "WARNING ", "E": "ERROR "}.get(record.level, "")
        return f"{record.time} {level}{record.message}"
    return _without_user_error_frames(line.rstrip("\n"), record)


def _without_user_error_frames(line: str, record: LogRecord) -> str:
    """Triton appends the Python frames to a model's failure; for a user's mistake (a bad parameter or file)
    they only hide the message, so the default output leaves them out (the log file and --verbose keep them)."""
    head, found, _ = record.message.partition(_PYTHON_FRAMES)
    if not found or not any(f"{name}: " in head for name in USER_ERROR_NAMES):
        return line
    return line[: line.index("] ") + 2] + json.dumps(head + " (traceback: serve --verbose)")


_FRAME_CELL = re.compile(r"^\S+\.py\(\d+\): \S+$")


class ConsoleFilter:
    """console_line, plus the one thing that needs the lines before: in the model status table Triton prints at
    start-up, the Python frames under a model that failed on a user's mistake (kept for a bug)."""

    def __init__(self):
        self._user_error_row = False

    def __call__(self, line: str) -> Optional[str]:
        if not line.startswith("|"):
            self._user_error_row = False
            return console_line(line)
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells[0]:  # a new row: the model (or the header) in its first cell
            self._user_error_row = any(f"{name}: " in line for name in USER_ERROR_NAMES)
        elif self._user_error_row and (cells[-1] == "At:" or _FRAME_CELL.match(cells[-1])):
            return None
        return line.rstrip("\n")


@dataclass(frozen=True)
class StartFailure:
    model: str
    message: str
    traceback: Optional[str] = None  # only for what is not a user's mistake

    def text(self) -> str:
        return self.message + (f"\n{self.traceback}" if self.traceback else "")


def start_failure_causes(lines: Iterable[str]) -> list[StartFailure]:
    """Why a tritonserver start failed, one entry per failed model (or per server error when no model failed, or
    the output's last lines when it said no error)."""
    lines = list(lines)
    records = [record for record in map(parse_record, lines) if record is not None]
    causes: dict[str, StartFailure] = {}  # in the order the models failed
    ours: set[str] = set()
    for record in records:
        structured = _structured_failure(record)
        if structured is not None and structured.model not in ours:
            causes[structured.model] = structured  # our line wins over Triton's for the same model
            ours.add(structured.model)
        reported = _triton_failure(record)
        if reported is not None:
            causes.setdefault(reported.model, reported)
    if causes:
        return list(causes.values())
    errors = [r.message for r in records if r.level == "E" and not is_gpu_noise(r.message)]
    # tritonserver's own fatal errors ("error: creating server: ...") are bare lines, not records.
    errors += [line.strip() for line in lines if line.startswith("error: ")]
    if errors:
        return [StartFailure("", message) for message in errors[-3:]]
    return [StartFailure("", "no error in its output; its last lines:\n" + "\n".join(last_lines(lines)))]


def last_lines(lines: list[str], count: int = 8) -> list[str]:
    """The last lines of the output that are neither start-up tables nor GPU noise: what a reader needs when the
    server said no error before it exited."""
    kept = [line for line in lines if line.strip() and line[:1] not in "+|" and not is_gpu_noise(line)]
    return [f"    {line}" for line in kept[-count:]] or ["    (none)"]


def _structured_failure(record: LogRecord) -> Optional[StartFailure]:
    if not record.message.startswith(START_ERROR_MARKER):
        return None
    try:
        fields = json.loads(record.message[len(START_ERROR_MARKER) :])
        model, user_error = str(fields["model"]), bool(fields["user_error"])
        message = _without_model(model, str(fields["message"]))
        return StartFailure(
            model,
            message if user_error else f"{fields['error']}: {message}",
            None if user_error else fields.get("traceback"),
        )
    except (ValueError, KeyError, TypeError):
        return None


def _triton_failure(record: LogRecord) -> Optional[StartFailure]:
    match = _FAILED_TO_LOAD.match(record.message)
    if not match:
        return None
    model, message = match.groups()
    message = _TRITON_STATUS.sub("", message, count=1)
    message, _, frames = message.partition(_PYTHON_FRAMES)
    error_type = message.split(":", 1)[0]
    if error_type in USER_ERROR_NAMES:
        return StartFailure(model, _without_model(model, message.split(": ", 1)[-1]))
    return StartFailure(
        model, message.strip(), f"Traceback (from the server log):\n{frames.rstrip()}" if frames else None
    )


def _without_model(model: str, message: str) -> str:
    """Our messages begin with the model's name ("preprocessing: parameter ..."); the cause line names it already."""
    prefix = f"{model}: "
    return message[len(prefix) :] if message.startswith(prefix) else message


def describe_start_failure(code: int, causes: list[StartFailure]) -> str:
    """The ServerError text of a failed start: the exit code, then one line (or block) per cause."""
    head = f"tritonserver exited with code {code} while starting"
    if not causes:
        return head
    lines = [f"  {f'model {c.model!r}: ' if c.model else ''}{c.text()}" for c in causes]
    return head + ":\n" + "\n".join(lines)


SHOW_MODES = ("all", "filtered", "none")


class OutputPump:
    """Drains tritonserver's stdout and stderr (one pipe) in a thread, so the server never blocks on it: every
    line goes to the log file, to the console (`show`: "all", "filtered" by console_line, or "none"), and into
    `recent` (the last KEEP_LINES), for start_failure_causes."""

    KEEP_LINES = 4000

    def __init__(self, stream: IO[bytes], show: str, log_file: Optional[IO[bytes]] = None):
        if show not in SHOW_MODES:
            raise ValueError(f"show must be one of {', '.join(SHOW_MODES)}, got {show!r}")
        self.stream, self.show, self.log_file = stream, show, log_file
        self.recent: deque[str] = deque(maxlen=self.KEEP_LINES)
        self.console_filter = ConsoleFilter()
        self.thread = threading.Thread(target=self._run, name="tritonserver-output", daemon=True)

    def start(self) -> "OutputPump":
        self.thread.start()
        return self

    def join(self, timeout: float) -> list[str]:
        """Waits (at most `timeout`) for the output to end; the lines kept so far."""
        self.thread.join(timeout)
        return list(self.recent)

    def _run(self) -> None:
        try:
            for raw in iter(self.stream.readline, b""):
                self._write(raw)
        finally:
            if self.log_file is not None:
                self.log_file.close()

    def _write(self, raw: bytes) -> None:
        line = raw.decode("utf-8", errors="replace").rstrip("\n")
        self.recent.append(line)
        if self.log_file is not None:
            self.log_file.write(raw)
            self.log_file.flush()
        shown = line if self.show == "all" else self.console_filter(line) if self.show == "filtered" else None
        if shown is not None:
            try:
                print(shown, flush=True)
            except (OSError, ValueError):
                self.show = "none"  # a console that went away (a closed pipe): keep draining the server
