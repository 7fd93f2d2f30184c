import pytest
import torch

from h3_core.config import TINY_DIT


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(1234)
    yield


@pytest.fixture
def tiny_config():
    return TINY_DIT
