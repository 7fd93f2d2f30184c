import pytest
import torch

from h3_core.config import TINY_DIT


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    """Every model in the tests is tiny: torch's thread pool wakes cost more than they give on a small
    CPU (measured 16 ms against 14 us per tiny attention call on 2 cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(1234)
    yield


@pytest.fixture
def tiny_config():
    return TINY_DIT
