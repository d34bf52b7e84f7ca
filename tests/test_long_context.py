"""Long documents: chunk-and-pool, the long-context recipe (convert option too), the long-document benchmark's
construction and the long-retrieval fine-tuning script, on a tiny BERT with MiniLM's tokenizer."""

import importlib.util
import json
import os

import pytest
import torch
from transformers import AutoModel, AutoTokenizer, BertConfig, BertModel

from nprf_hf.convert import convert_checkpoint
from nprf_hf.long_context import (
    chunk_and_pool,
    chunk_token_states,
    contrastive_logits,
    disjoint_span_starts,
    document_states,
    embed_documents,
    encode_token_ids,
    long_context_distillation,
    long_context_trainable,
    push_memory,
    read_long_text,
    windows,
)

from conftest import minilm_path, shared_data, tiny_config


ROOT = os.path.join(os.path.dirname(__file__), "..")


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny softmax BERT with 64 positions (MiniLM's tokenizer and sentence-transformers files), its NPRF
    conversion with 300 positions, and a small WikiText file of a few articles."""
    wikitext = shared_data("wikitext-2", "valid.txt")
    root = tmp_path_factory.mktemp("long")
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    config = BertConfig(**tiny_config(vocab_size=len(tokenizer), num_attention_heads=4, intermediate_size=64))
    torch.manual_seed(0)
    softmax_dir = str(root / "softmax")
    BertModel(config).save_pretrained(softmax_dir)
    tokenizer.save_pretrained(softmax_dir)
    for name in ("modules.json", "sentence_bert_config.json"):
        with open(os.path.join(minilm_path(), name)) as src, open(os.path.join(softmax_dir, name), "w") as dst:
            dst.write(src.read())
    os.makedirs(os.path.join(softmax_dir, "1_Pooling"))
    with open(os.path.join(minilm_path(), "1_Pooling", "config.json")) as src:
        pooling = json.load(src)
    pooling["word_embedding_dimension"] = 32
    with open(os.path.join(softmax_dir, "1_Pooling", "config.json"), "w") as dst:
        json.dump(pooling, dst)
    nprf_dir = str(root / "nprf")
    convert_checkpoint(softmax_dir, nprf_dir, num_random_features=16, max_position_embeddings=300)
    with open(wikitext, encoding="utf-8") as handle:
        lines = handle.readlines()[:400]
    text = root / "long.txt"
    text.write_text("".join(lines), encoding="utf-8")
    return root, softmax_dir, nprf_dir, str(text), tokenizer


def test_windows_cover_the_document_with_the_stated_overlap():
    ids = list(range(23))
    parts = windows(ids, 10, 0)
    assert parts == [ids[0:10], ids[10:20], ids[20:23]]
    parts = windows(ids, 10, 4)
    assert [p[0] for p in parts] == [0, 6, 12, 18] and parts[-1][-1] == 22
    assert all(len(p) <= 10 for p in parts)
    assert windows(ids[:7], 10, 3) == [ids[:7]]
    with pytest.raises(ValueError, match="overlap"):
        windows(ids, 10, 10)


def test_chunk_and_pool_is_the_token_weighted_mean_of_window_embeddings(tiny):
    _, softmax_dir, _, _, tokenizer = tiny
    model = AutoModel.from_pretrained(softmax_dir).eval()
    generator = torch.Generator().manual_seed(3)
    doc = torch.randint(1000, 5000, (150,), generator=generator).tolist()
    with torch.no_grad():
        pooled = chunk_and_pool(model, tokenizer, [doc], window=62, max_windows_per_batch=2)[0]
        parts = windows(doc, 62)
        each = torch.cat([encode_token_ids(model, tokenizer, [p]) for p in parts])  # unpadded, one by one
        weights = torch.tensor([len(p) for p in parts], dtype=torch.float32)
        expected = torch.nn.functional.normalize((each * weights[:, None]).sum(0), dim=-1)
        torch.testing.assert_close(pooled, expected, atol=1e-5, rtol=1e-5)  # padded batching changes nothing
        # a document of one window is that window's embedding, as a whole-document pass gives it
        short = doc[:40]
        torch.testing.assert_close(chunk_and_pool(model, tokenizer, [short], 62), embed_documents(model, tokenizer, [short]))
    assert abs(float(pooled.norm()) - 1) < 1e-5


def test_read_long_text_splits_wikitext_at_article_titles(tiny, tmp_path):
    *_, text, _ = tiny
    documents = read_long_text(text)
    with open(text, encoding="utf-8") as handle:
        titles = [line for line in handle if line.startswith(" = ") and not line.startswith(" = = ")]
    assert len(documents) == len(titles) >= 1
    assert not any(doc.startswith("=") for doc in documents)
    plain = tmp_path / "plain.txt"
    plain.write_text("first block\nstill first\n\nsecond block\n", encoding="utf-8")
    assert read_long_text(str(plain)) == ["first block still first", "second block"]
    with pytest.raises(ValueError, match="no such file"):
        read_long_text(str(tmp_path / "missing.txt"))


@pytest.mark.parametrize("train", ["attention", "encoder"])
def test_recipe_trains_exactly_the_declared_parameters(tiny, train):
    _, softmax_dir, nprf_dir, text, tokenizer = tiny
    teacher = AutoModel.from_pretrained(softmax_dir)
    student = AutoModel.from_pretrained(nprf_dir)
    before = {name: p.detach().clone() for name, p in student.named_parameters()}
    teacher_before = {name: p.detach().clone() for name, p in teacher.named_parameters()}
    declared = {name for name, _ in long_context_trainable(student, train)}
    report = long_context_distillation(
        student, teacher, tokenizer, read_long_text(text), steps=3, batch_size=2, document_length=200,
        passage_length=16, short_batch_size=4, learning_rate=1e-2, table_learning_rate=1e-1, train=train,
        eval_documents=2, show_progress=False,
    )
    assert set(report.trainable) == declared and declared
    changed = {name for name, p in student.named_parameters() if not torch.equal(p, before[name])}
    assert changed and changed <= declared
    for name, p in student.named_parameters():
        if name not in declared:
            assert torch.equal(p, before[name]), name
    if train == "attention":
        assert not any("value" in name or "intermediate" in name or "embeddings" in name for name in declared)
    else:
        assert any("intermediate" in name for name in changed) and not any("embeddings" in n for n in declared)
    assert all(torch.equal(p, teacher_before[name]) for name, p in teacher.named_parameters())
    assert all(p.requires_grad for p in student.parameters())  # restored
    assert len(report.history) == 3 and all(torch.isfinite(torch.tensor(h["loss"])) for h in report.history)
    assert set(report.before) == set(report.after) == {
        "document vs chunk-and-pool", "token vs its window", "passage", "short text"}
    assert "token" not in report.history[0]  # off by default: the teacher runs only its pooled windows


def test_chunk_token_states_are_each_tokens_state_in_its_window(tiny):
    _, softmax_dir, nprf_dir, _, tokenizer = tiny
    model = AutoModel.from_pretrained(softmax_dir).eval()
    generator = torch.Generator().manual_seed(5)
    doc = torch.randint(1000, 5000, (130,), generator=generator).tolist()

    def alone(part, of=model):  # one window, unpadded, its content tokens' last hidden states
        ids = torch.tensor([[tokenizer.cls_token_id, *part, tokenizer.sep_token_id]])
        return of(input_ids=ids).last_hidden_state[0, 1:-1]

    with torch.no_grad():
        states = chunk_token_states(model, tokenizer, doc, window=50, max_windows_per_batch=2)
        expected = torch.cat([alone(p) for p in windows(doc, 50)])
        torch.testing.assert_close(states, expected, atol=1e-5, rtol=1e-5)
        # with overlap 20 the windows start at 0, 30, 60, 90; token 39 lies 10 before the first window's last
        # token and 9 after the second's first -> the first; token 45 lies 4 before the first's last and 15
        # after the second's first -> the second
        overlapped = chunk_token_states(model, tokenizer, doc, window=50, overlap=20)
        parts = windows(doc, 50, 20)
        assert [len(p) for p in parts] == [50, 50, 50, 40]
        first, second = alone(parts[0]), alone(parts[1])
        torch.testing.assert_close(overlapped[39], first[39], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(overlapped[45], second[15], atol=1e-5, rtol=1e-5)
        assert overlapped.shape == (130, 32) and not torch.allclose(first[39], second[9], atol=1e-3)
        # one whole-document pass gives the pooled embedding and the states of the content tokens
        nprf = AutoModel.from_pretrained(nprf_dir).eval()
        embedding, tokens = document_states(nprf, tokenizer, doc)
        torch.testing.assert_close(embedding, embed_documents(nprf, tokenizer, [doc])[0])
        torch.testing.assert_close(tokens, alone(doc, of=nprf))


def test_token_term_trains_the_declared_parameters_and_brings_tokens_to_their_windows(tiny):
    _, softmax_dir, nprf_dir, text, tokenizer = tiny
    student = AutoModel.from_pretrained(nprf_dir)
    before = {name: p.detach().clone() for name, p in student.named_parameters()}
    declared = {name for name, _ in long_context_trainable(student, "encoder")}
    report = long_context_distillation(
        student, AutoModel.from_pretrained(softmax_dir), tokenizer, read_long_text(text), steps=8, batch_size=2,
        document_length=200, passage_length=16, short_batch_size=2, learning_rate=3e-3, table_learning_rate=1e-1,
        train="encoder", token_weight=5.0, contrastive_weight=0.0, eval_documents=2, show_progress=False,
    )
    assert all("token" in h and h["token"] > 0 for h in report.history)
    assert all(torch.equal(p, before[name]) for name, p in student.named_parameters() if name not in declared)
    assert report.after["token vs its window"] > report.before["token vs its window"]
    with pytest.raises(ValueError, match="token_weight"):
        long_context_distillation(student, AutoModel.from_pretrained(softmax_dir), tokenizer, read_long_text(text),
                                  document_length=200, passage_length=16, token_weight=-1.0)


def test_memory_spans_tile_the_stream_and_never_hold_a_passages_own_text():
    starts = disjoint_span_starts(1050, 4, 100, torch.Generator().manual_seed(3))
    assert len(starts) == 4 and starts == sorted(starts) and len(set(starts)) == 4
    assert all(start % 100 == 0 and start + 100 <= 1050 for start in starts)  # disjoint tiles inside the stream
    assert disjoint_span_starts(1050, 99, 100, torch.Generator().manual_seed(3)) == list(range(0, 1000, 100))
    passages, documents, memory = (torch.nn.functional.normalize(torch.randn(n, 8), dim=-1) for n in (4, 2, 3))
    logits = contrastive_logits(passages, documents, 0.1, memory, [0, 200, 500], [150, 400], 100)
    # document 0 is tokens 150..249 and overlaps memory span 200..299; document 1 (400..499) ends just before 500..
    blocked = torch.zeros(4, 5, dtype=torch.bool)
    blocked[:2, 3] = True
    assert torch.equal(torch.isinf(logits), blocked)
    expected = torch.cat([passages @ documents.T, passages @ memory.T], dim=1) / 0.1
    torch.testing.assert_close(logits[~blocked], expected[~blocked])
    torch.testing.assert_close(contrastive_logits(passages, documents, 0.1), expected[:, :2])
    # first in, first out, and nothing of the step's graph kept
    pushed, starts = push_memory(memory, [0, 200, 500], documents.requires_grad_(), [150, 400])
    assert starts == [500, 150, 400] and not pushed.requires_grad
    torch.testing.assert_close(pushed, torch.cat([memory[2:], documents.detach()]))


def test_recipe_with_a_memory_of_negatives_has_a_contrastive_term_even_for_one_document(tiny):
    _, softmax_dir, nprf_dir, text, tokenizer = tiny
    runs = {}
    for negatives in (0, 8):
        report = long_context_distillation(
            AutoModel.from_pretrained(nprf_dir), AutoModel.from_pretrained(softmax_dir), tokenizer,
            read_long_text(text), steps=2, batch_size=1, document_length=150, passage_length=16, short_batch_size=2,
            contrastive_weight=1.0, negatives=negatives, eval_documents=1, show_progress=False,
        )
        runs[negatives] = report.history
    assert all("contrastive" not in h for h in runs[0])
    # the memory has its own generator: the same documents and passages, the same other terms, plus InfoNCE
    assert all(h["contrastive"] > 0 for h in runs[8])
    assert runs[8][0]["document"] == runs[0][0]["document"]
    with pytest.raises(ValueError, match="negatives >= 0"):
        long_context_distillation(AutoModel.from_pretrained(nprf_dir), AutoModel.from_pretrained(softmax_dir),
                                  tokenizer, read_long_text(text), document_length=150, passage_length=16,
                                  negatives=-1)


def test_recipe_is_deterministic_for_a_seed(tiny):
    _, softmax_dir, nprf_dir, text, tokenizer = tiny
    documents = read_long_text(text)
    runs = []
    for _ in range(2):
        student = AutoModel.from_pretrained(nprf_dir)
        report = long_context_distillation(
            student, AutoModel.from_pretrained(softmax_dir), tokenizer, documents, steps=2, batch_size=2,
            document_length=150, passage_length=16, short_batch_size=2, eval_documents=1, show_progress=False,
        )
        runs.append(report.history)
    assert runs[0] == runs[1]


def test_recipe_rejects_bad_settings_with_the_fix(tiny):
    _, softmax_dir, nprf_dir, text, tokenizer = tiny
    student, teacher = AutoModel.from_pretrained(nprf_dir), AutoModel.from_pretrained(softmax_dir)
    documents = read_long_text(text)
    with pytest.raises(ValueError, match="--max-position-embeddings >= 402"):
        long_context_distillation(student, teacher, tokenizer, documents, document_length=400, steps=1)
    with pytest.raises(ValueError, match="window=100"):
        long_context_distillation(student, teacher, tokenizer, documents, document_length=200, window=100, steps=1)
    with pytest.raises(ValueError, match="train='everything'"):
        long_context_distillation(student, teacher, tokenizer, documents, document_length=200, train="everything")
    with pytest.raises(ValueError, match="passage_length=64 exceeds the teacher's window=62"):
        long_context_distillation(student, teacher, tokenizer, documents, document_length=200, steps=1)
    with pytest.raises(ValueError, match="teacher must be the softmax source"):
        long_context_distillation(student, student, tokenizer, documents, document_length=200)


def test_convert_runs_the_recipe_and_reports_it(tiny, tmp_path, capsys):
    from nprf_hf.cli import main

    _, softmax_dir, _, text, _ = tiny
    out = tmp_path / "long"
    code = main(["convert", softmax_dir, str(out), "--num-random-features", "16", "--max-position-embeddings", "300",
                 "--long-context-text", text, "--long-context-steps", "2", "--long-context-batch-size", "2",
                 "--long-context-document-length", "200", "--long-context-short-batch-size", "2",
                 "--long-context-passage-length", "16"])
    assert code == 0
    assert "Long-context recipe: 2 steps" in capsys.readouterr().out
    with open(out / "conversion_report.json") as handle:
        report = json.load(handle)
    assert report["long_context"]["steps"] == 2 and len(report["long_context"]["history"]) == 2
    assert (out / "modules.json").exists()


# ---------------------------------------------------------------------------------------------
# benchmarks/long_documents.py
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bench():
    return _load("benchmarks/long_documents.py", "benchmark_long_documents")


def test_benchmark_tasks_are_deterministic_for_a_seed_and_well_formed(bench, tiny):
    *_, text, tokenizer = tiny
    articles = bench.wikitext_tokens(tokenizer, text)
    first = bench.build_tasks(tokenizer, articles, [122, 202], 5, 16, seed=1, special_tokens=2, queries_per_document=3)
    again = bench.build_tasks(tokenizer, articles, [122, 202], 5, 16, seed=1, special_tokens=2, queries_per_document=3)
    other = bench.build_tasks(tokenizer, articles, [122, 202], 5, 16, seed=2, special_tokens=2, queries_per_document=3)
    assert first == again and first != other
    for (task, length), (documents, queries, owners) in first.items():
        assert len(documents) >= 2 and len(owners) == len(queries)
        assert sorted(set(owners)) == list(range(len(documents)))
        assert all(len(doc) == length - 2 for doc in documents), (task, length)
    docs, queries, owners = first["retrieval", 202]
    assert len(queries) == 3 * len(docs)
    for owner, query in zip(owners, queries):  # each query is a passage of its own document's last 40%
        doc = docs[owner]
        starts = [i for i in range(len(doc) - 15) if doc[i : i + 16] == query]
        assert starts and starts[0] >= int(0.6 * 200)
    docs, queries, _ = first["passkey", 202]
    for doc, query in zip(docs, queries):
        name = tokenizer.decode(query).split("for ")[1].rstrip("?").strip()
        decoded = tokenizer.decode(doc).lower()
        assert name.lower() in decoded and "pass key is" in decoded and "pass key" not in decoded.split(name.lower())[0]
    docs, queries, _ = first["needle", 122]
    assert len({tuple(doc[:10]) for doc in docs}) <= 2  # one shared haystack (a needle may open a document)
    for doc, query in zip(docs, queries):
        city = tokenizer.decode(query).split(" in ")[1].rstrip("?").strip()
        assert f"best thing to do in {city.lower()}" in tokenizer.decode(doc).lower()
    docs, queries, _ = first["needle_distinct", 202]
    haystacks = first["retrieval", 202][0]
    assert len({tuple(doc[:10]) for doc in docs}) == len(docs)  # every candidate its own text
    for doc, haystack, query in zip(docs, haystacks, queries):
        city = tokenizer.decode(query).split(" in ")[1].rstrip("?").strip()
        fact = tokenizer(f" The best thing to do in {city} is", add_special_tokens=False)["input_ids"]
        at = next(i for i in range(len(doc)) if doc[i : i + len(fact)] == fact)
        assert 0.1 * 200 - 1 <= at <= 0.9 * 200 and doc[:at] == haystack[:at]  # its own document, at 10-90% depth


def test_benchmark_runs_every_method_and_writes_table_and_plot(bench, tiny, tmp_path, capsys):
    _, softmax_dir, nprf_dir, text, _ = tiny
    data = tmp_path / "data"
    data.mkdir()
    (data / "valid.txt").write_text(open(text, encoding="utf-8").read(), encoding="utf-8")
    stem = str(tmp_path / "ld")
    sentences = tmp_path / "dev.tsv"
    sentences.write_text("sentence\tlabel\na fine film .\t1\na dull , lifeless film .\t0\n", encoding="utf-8")
    rows = bench.main(["--model", softmax_dir, "--nprf", f"tiny={nprf_dir}", "--data", str(data), "--lengths", "120",
                       "250", "--docs", "4", "--window", "62", "--passage-length", "16", "--threads", "1",
                       "--faithfulness-file", str(sentences), "--output", stem])
    assert {(r["task"], r["length"], r["method"]) for r in rows} == {
        (t, n, m) for t in bench.TASKS for n in (120, 250) for m in ("truncate", "chunk-and-pool", "tiny")
    }
    assert all(0 <= r["top1"] <= 1 and r["seconds"] > 0 for r in rows)
    with open(stem + ".json") as handle:
        saved = json.load(handle)
    assert saved["meta"]["chunk_and_pool"] == {"window": 62, "overlap": 0}
    assert set(saved["short_text_cosine"]) == {"tiny"} and -1 <= saved["short_text_cosine"]["tiny"] <= 1
    assert os.path.getsize(stem + ".png") > 1000
    assert "| chunk-and-pool |" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # the NPRF model has 300 positions
        bench.main(["--model", softmax_dir, "--nprf", f"tiny={nprf_dir}", "--data", str(data), "--lengths", "301",
                    "--docs", "3", "--faithfulness-file", "", "--output", stem])


def test_benchmark_sets_config_fields_of_an_nprf_model_at_load(bench, tiny):
    _, softmax_dir, nprf_dir, _, _ = tiny
    assert bench.nprf_spec("far=/a/b,rpe_far_bias=-30,attention_algorithm=banded") == (
        "far", "/a/b", {"rpe_far_bias": -30, "attention_algorithm": "banded"})
    args = bench.parse_args(["--model", softmax_dir, "--nprf", f"plain={nprf_dir}", "--nprf", f"far={nprf_dir},rpe_far_bias=-30",
                             "--faithfulness-file", ""])
    _, models = bench.load_models(args)
    assert models["plain"].config.rpe_far_bias == 0 and models["far"].config.rpe_far_bias == -30
    with pytest.raises(SystemExit):  # a setting without a value
        bench.parse_args(["--model", softmax_dir, "--nprf", f"far={nprf_dir},rpe_far_bias", "--faithfulness-file", ""])


# ---------------------------------------------------------------------------------------------
# examples/run_long_retrieval.py
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def finetune():
    return _load("examples/run_long_retrieval.py", "run_long_retrieval")


def test_long_retrieval_fine_tuning_end_to_end(finetune, tiny, tmp_path):
    from sentence_transformers import SentenceTransformer

    _, softmax_dir, nprf_dir, text, _ = tiny
    common = ["--train_file", text, "--document_length", "200", "--passage_length", "16", "--batch_size", "2",
              "--max_steps", "2", "--learning_rate", "1e-3", "--threads", "1"]
    out = tmp_path / "nprf-ft"
    results = finetune.main(["--model_name_or_path", nprf_dir, "--output_dir", str(out), "--gradient_checkpointing",
                             "--attention_recompute", "always", *common])
    assert results["mode"] == "whole document" and results["peak_memory_bytes"] > 0
    log = [json.loads(line) for line in open(out / "train_log.jsonl")]
    assert [entry["step"] for entry in log] == [1, 2] and all(entry["grad_norm"] > 0 for entry in log)
    tuned = AutoModel.from_pretrained(str(out))
    assert tuned.config.attention_recompute == "always"
    original = AutoModel.from_pretrained(nprf_dir)
    assert any(not torch.equal(a, b) for a, b in zip(tuned.parameters(), original.parameters()))
    embedding = SentenceTransformer(str(out), trust_remote_code=True).encode(["a short sentence"])
    assert embedding.shape == (1, 32)
    assert not any(name.startswith(".tmp-") for name in os.listdir(tmp_path))

    baseline = finetune.main(["--model_name_or_path", softmax_dir, "--output_dir", str(tmp_path / "cp"),
                              "--chunk_and_pool", *common])
    assert baseline["mode"] == "chunk-and-pool" and baseline["window"] == 62


def test_long_retrieval_under_accelerate_launch_ddp_on_cpu_processes(tiny, tmp_path):
    import subprocess
    import sys

    _, _, nprf_dir, text, _ = tiny
    out = tmp_path / "ddp"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               os.path.join(ROOT, "examples", "accelerate", "cpu_ddp.yaml"),
               os.path.join(ROOT, "examples", "run_long_retrieval.py"), "--model_name_or_path", nprf_dir,
               "--train_file", text, "--document_length", "200", "--passage_length", "16", "--batch_size", "2",
               "--max_steps", "2", "--threads", "1", "--learning_rate", "1e-3", "--output_dir", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(out / "train_results.json") as handle:
        results = json.load(handle)
    assert results["processes"] == 2 and results["parameters_in_sync"]


def test_long_retrieval_refuses_to_overwrite_and_wrong_modes(finetune, tiny, tmp_path, capsys):
    _, softmax_dir, nprf_dir, text, _ = tiny
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    common = ["--train_file", text, "--document_length", "200", "--max_steps", "1"]
    with pytest.raises(SystemExit):
        finetune.main(["--model_name_or_path", nprf_dir, "--output_dir", str(full), *common])
    assert "not empty" in capsys.readouterr().err and (full / "keep.txt").read_text() == "mine"
    with pytest.raises(SystemExit, match="chunk_and_pool"):
        finetune.main(["--model_name_or_path", softmax_dir, "--output_dir", str(tmp_path / "a"), *common])
    with pytest.raises(SystemExit, match="max-position-embeddings >= 402"):
        finetune.main(["--model_name_or_path", nprf_dir, "--output_dir", str(tmp_path / "b"), *common[:2],
                       "--document_length", "400", "--max_steps", "1"])


def test_recipe_document_term_equals_an_independent_computation(tiny, monkeypatch):
    """The recipe's main objective, 1 - cos(student's whole-document embedding, teacher's chunk-and-pool), at its
    first step (before any update), against the same quantity computed here with plain model calls: the teacher on
    each window of 62 content tokens alone, its normalized mean embedding, averaged weighted by the window's tokens."""
    from nprf_hf import long_context

    _, softmax_dir, nprf_dir, text, tokenizer = tiny
    teacher, student = AutoModel.from_pretrained(softmax_dir).eval(), AutoModel.from_pretrained(nprf_dir).eval()
    drawn = []
    original = long_context._span_starts
    monkeypatch.setattr(long_context, "_span_starts", lambda *a: drawn.append(original(*a)) or drawn[-1])
    documents = read_long_text(text)
    report = long_context_distillation(
        student, teacher, tokenizer, documents, steps=1, batch_size=2, document_length=150, passage_length=16,
        short_batch_size=0, contrastive_weight=0.0, learning_rate=1e-6, table_learning_rate=1e-6, eval_documents=1,
        show_progress=False,
    )
    # the student's weights before its one update: the first step's term was computed with them
    student = AutoModel.from_pretrained(nprf_dir).eval()
    stream = [t for d in documents if d.strip() for t in tokenizer(d, add_special_tokens=False)["input_ids"]]
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id

    def embedding(model, ids):
        with torch.no_grad():
            hidden = model(input_ids=torch.tensor([[cls, *ids, sep]])).last_hidden_state[0]
        return torch.nn.functional.normalize(hidden.mean(0), dim=0)  # a sentence embedding, as an embedder gives it

    terms = []
    for start in drawn[-1]:  # the training step's documents (the held-out ones were drawn first)
        doc = stream[start : start + 150]
        parts = [doc[i : i + 62] for i in range(0, len(doc), 62)]
        pooled = sum(len(p) * embedding(teacher, p) for p in parts)
        whole = embedding(student, doc)
        terms.append(1 - torch.nn.functional.cosine_similarity(whole, pooled, dim=0))
    assert len(terms) == 2
    expected = float(torch.stack(terms).mean())
    assert expected > 0 and abs(report.history[0]["document"] - expected) <= 1e-3 * expected
