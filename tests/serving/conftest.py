"""The serving tests run the Triton models against tests/fake_pb_utils.py: loaded once here and registered as the
module `fake_pb_utils`, so that each test module can `import fake_pb_utils as fake`."""

import importlib.util
import sys
from pathlib import Path


def _load_fake_pb_utils():
    path = Path(__file__).resolve().parents[1] / "fake_pb_utils.py"
    spec = importlib.util.spec_from_file_location("fake_pb_utils", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sys.modules.setdefault("fake_pb_utils", _load_fake_pb_utils())
