"""A converted folder's tokenizer is its source's plain one, and loads with transformers alone (issue 57): for every
family, in a fresh process without nprf_hf, with no terminal, `AutoTokenizer.from_pretrained(dir,
trust_remote_code=True)` (the model card's line) asks nothing, warns nothing and encodes as the source did. Without
the flag, transformers 5.23 reads config.json (which names the NPRF code) before tokenizer_config.json, asks, and
warns: the limit docs/DESIGN.md and the card state, checked here so that they change when transformers does."""

import json
import os
import subprocess
import sys
import textwrap

import transformers

import nprf_hf
from nprf_hf.families import FAMILIES

from conftest import minilm_path

TEXTS = ["Hello world, the tokenizer is plain.", ["a sentence", "and its pair"]]
CORPUS = ["hello world the tokenizer is plain", "a sentence and its pair", "kernelized attention with relative"] * 4
PROMPT = "Do you wish to run the custom code"

LOADER = textwrap.dedent(
    """
    import importlib.util, json, sys
    # as if nprf_hf were not installed: drop its editable install's finder (-I already keeps cwd and PYTHONPATH off)
    sys.meta_path[:] = [finder for finder in sys.meta_path if "nprf_hf" not in getattr(finder, "__module__", "")]
    print("PACKAGE", importlib.util.find_spec("nprf_hf"))
    from transformers import AutoTokenizer
    folders, texts = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    encoded = {}
    for folder in folders:
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
        encoded[folder] = [type(tokenizer).__name__] + [tokenizer(*([t] if isinstance(t, str) else t)).input_ids
                                                        for t in texts]
    print("ENCODED" + json.dumps(encoded), flush=True)
    print("WITHOUT THE FLAG", file=sys.stderr, flush=True)
    AutoTokenizer.from_pretrained(folders[0])
    """
)


def family_tokenizer(family, tmp_path):
    """A small tokenizer of the family's own class (its name goes to tokenizer_config.json)."""
    name = family.prefix + "Tokenizer"
    if family.model_type in ("bert", "electra", "distilbert"):  # WordPiece: MiniLM's vocabulary
        return getattr(transformers, name).from_pretrained(minilm_path())
    if family.model_type == "roberta":  # byte-level BPE, trained here on a few lines
        from tokenizers import ByteLevelBPETokenizer

        bpe = ByteLevelBPETokenizer()
        bpe.train_from_iterator(CORPUS, vocab_size=300, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
        return transformers.RobertaTokenizer(tokenizer_object=bpe._tokenizer)
    pieces = sorted({"▁" + word for line in CORPUS for word in line.split()} | set("".join(CORPUS).replace(" ", "")))
    vocab = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [(p, -float(len(p))) for p in pieces]
    return transformers.XLMRobertaTokenizer(vocab=vocab + [("<mask>", 0.0)])  # Unigram, as sentencepiece's


def tiny_source(family, tokenizer, folder):
    """A tiny softmax checkpoint of the family with `tokenizer`, saved in `folder`."""
    sizes = (dict(dim=32, n_heads=2, n_layers=2, hidden_dim=37) if family.layout == "distilbert" else
             dict(hidden_size=32, num_attention_heads=2, num_hidden_layers=2, intermediate_size=37))
    config = getattr(transformers, family.prefix + "Config")(
        vocab_size=len(tokenizer), max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id, **sizes
    )
    getattr(transformers, family.class_name("model", nprf=False))(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def encode(tokenizer):
    return [type(tokenizer).__name__] + [tokenizer(*([t] if isinstance(t, str) else t)).input_ids for t in TEXTS]


def test_every_family_loads_its_tokenizer_without_the_package(tmp_path):
    expected = {}
    for model_type, family in FAMILIES.items():
        tokenizer = family_tokenizer(family, tmp_path)
        source, out = tmp_path / f"{model_type}-src", tmp_path / f"{model_type}-nprf"
        tiny_source(family, tokenizer, source)
        nprf_hf.convert_checkpoint(str(source), str(out))
        # the class the folder names (ELECTRA's is BERT's) is the one transformers builds
        assert json.load(open(out / "tokenizer_config.json"))["tokenizer_class"] == type(tokenizer).__name__
        expected[str(out)] = encode(transformers.AutoTokenizer.from_pretrained(str(source)))

    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), HF_MODULES_CACHE=str(tmp_path / "modules"))
    script = tmp_path / "load.py"
    script.write_text(LOADER)
    completed = subprocess.run(
        [sys.executable, "-I", str(script), json.dumps(list(expected)), json.dumps(TEXTS)], cwd=tmp_path, env=env,
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300,
    )
    assert "PACKAGE None" in completed.stdout, completed.stdout + completed.stderr[-3000:]
    encoded = json.loads(completed.stdout.split("ENCODED", 1)[1].splitlines()[0])
    assert encoded == expected
    with_flag, without = completed.stderr.split("WITHOUT THE FLAG\n")
    assert with_flag.strip() == "" and PROMPT not in completed.stdout.split("ENCODED")[0]
    # without trust_remote_code: transformers asks (stdin is no terminal: it takes no for an answer) and warns
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert PROMPT in completed.stdout.split("ENCODED")[1] and "You are using a model of type" in without


def test_the_model_card_loads_the_tokenizer_with_the_flag(tmp_path):
    from nprf_hf.modelcard import build_model_card

    nprf_hf.NPRFBertModel(nprf_hf.NPRFBertConfig(
        vocab_size=99, hidden_size=32, num_attention_heads=2, num_hidden_layers=1, intermediate_size=37,
    )).save_pretrained(tmp_path)
    card = str(build_model_card(str(tmp_path), eval_results=False, repo_id="user/model"))
    assert 'AutoTokenizer.from_pretrained("user/model", trust_remote_code=True)' in card
