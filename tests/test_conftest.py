"""The suite's own fixtures and helpers (tests/conftest.py): per-test seeds and the shared-data guard."""

import os
import random
import zlib

import pytest
import torch

import conftest


@pytest.mark.parametrize("case", ["first", "second"])
def test_global_rngs_are_seeded_from_the_node_id(request, case):
    # the first case draws before the second runs: what it leaves in the global RNGs must not reach the second
    seed = zlib.crc32(request.node.nodeid.encode("utf-8"))
    assert torch.equal(torch.rand(5), torch.rand(5, generator=torch.Generator().manual_seed(seed)))
    assert random.random() == random.Random(seed).random()


def test_shared_data_skips_naming_the_missing_path(tmp_path, monkeypatch):
    monkeypatch.setattr(conftest, "SHARED_DATA", str(tmp_path))
    (tmp_path / "glue").mkdir()
    assert conftest.shared_data("glue") == os.path.join(str(tmp_path), "glue")
    with pytest.raises(pytest.skip.Exception, match="needs the shared data .*wikitext-2.valid.txt"):
        conftest.shared_data("wikitext-2", "valid.txt")
    mark = conftest.needs_shared_data("wikitext-2")
    assert mark.args == (True,) and "wikitext-2" in mark.kwargs["reason"]
    assert conftest.needs_shared_data("glue").args == (False,)
