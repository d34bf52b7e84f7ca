import os

import pytest

# Nothing is downloaded at test time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

WIKITEXT = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "wikitext-2", "valid.txt")


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
