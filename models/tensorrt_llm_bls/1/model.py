# Triton's Python backend loads TritonPythonModel from this file; the implementation lives in the installed
# tritonllm package, so upgrading the package upgrades every copied repository.
from tritonllm.models.bls import TritonPythonModel  # noqa: F401
