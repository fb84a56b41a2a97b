"""One upload for a step's arrays: each comes back with its values and shape, int32 where asked, and starting on a
16-byte boundary (Triton compiles a kernel variant per pointer alignment)."""

import numpy as np
import torch

from tritonllm.engine.embedded.host_arrays import HostArrays, padded_rows


def test_arrays_come_back_whole_typed_and_aligned():
    host = HostArrays()
    host.add("a", [1, 2, 3])
    host.add("table", np.arange(6).reshape(2, 3))
    host.add("b", [7], int32=True)
    host.add("c", [8, 9, 10, 11, 12], int32=True)
    arrays = host.upload(torch.device("cpu"))
    assert arrays["a"].tolist() == [1, 2, 3] and arrays["a"].dtype == torch.int64
    assert arrays["table"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert arrays["b"].tolist() == [7] and arrays["c"].tolist() == [8, 9, 10, 11, 12]
    assert arrays["c"].dtype == torch.int32
    for tensor in arrays.values():
        assert tensor.data_ptr() % 16 == 0


def test_block_tables_are_cut_or_padded_to_the_width():
    assert padded_rows([[4, 5, 6], [7]], 2).tolist() == [[4, 5], [7, 0]]
