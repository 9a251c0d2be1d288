import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """On the 2-core CI machine two BLAS threads make small matmuls ~6x slower (measured)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
