"""The suite's own fixtures (tests/conftest.py): per-test seeds."""

import random
import zlib

import pytest
import torch


@pytest.mark.parametrize("case", ["first", "second"])
def test_global_rngs_are_seeded_from_the_node_id(request, case):
    # the first case draws before the second runs: what it leaves in the global RNGs must not reach the second
    seed = zlib.crc32(request.node.nodeid.encode("utf-8"))
    assert torch.equal(torch.rand(5), torch.rand(5, generator=torch.Generator().manual_seed(seed)))
    assert random.random() == random.Random(seed).random()
