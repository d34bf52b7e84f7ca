"""nprf_hf.glue: GLUE readers (real glue_data TSVs and every task's layout) and metrics."""

import csv
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from scipy import stats
from sklearn.metrics import f1_score, matthews_corrcoef

from nprf_hf import glue

from conftest import needs_shared_data, shared_data_path


DATA = shared_data_path("glue")
needs_data = needs_shared_data("glue")


def raw_lines(path):
    with open(path, encoding="utf-8-sig", newline="") as f:
        return [line for line in f.read().split("\n") if line]


# ----------------------------------------------------------------------------------------------
# Metrics against sklearn / scipy on random labels
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("task", glue.GLUE_TASKS)
def test_metrics_match_sklearn_scipy(task, seed):
    rng = np.random.default_rng(seed)
    n = 200
    if task == "stsb":
        references = rng.uniform(0, 5, n)
        predictions = references + rng.normal(0, 1.5, n)
        result = glue.compute_glue_metrics(predictions, references, task)
        assert result["pearson"] == pytest.approx(stats.pearsonr(predictions, references)[0], abs=1e-12)
        assert result["spearmanr"] == pytest.approx(stats.spearmanr(predictions, references)[0], abs=1e-12)
        assert result["combined_score"] == pytest.approx((result["pearson"] + result["spearmanr"]) / 2)
        return
    num_labels = len(glue.TASK_LABEL_NAMES[task])
    references = rng.integers(0, num_labels, n)
    logits = rng.normal(size=(n, num_labels)) + 1.5 * np.eye(num_labels)[references]  # better than chance
    predictions = logits.argmax(-1)
    result = glue.compute_glue_metrics(logits, references, task)  # logits: argmax taken inside
    assert result == glue.compute_glue_metrics(predictions, references, task)
    accuracy = float(np.mean(predictions == references))
    if task == "cola":
        assert set(result) == {"matthews_correlation"}
        assert result["matthews_correlation"] == pytest.approx(matthews_corrcoef(references, predictions), abs=1e-12)
    elif task in ("mrpc", "qqp"):
        assert set(result) == {"accuracy", "f1", "combined_score"}
        assert result["accuracy"] == pytest.approx(accuracy)
        assert result["f1"] == pytest.approx(f1_score(references, predictions), abs=1e-12)
        assert result["combined_score"] == pytest.approx((accuracy + result["f1"]) / 2)
    else:
        assert result == {"accuracy": pytest.approx(accuracy)}


def test_metrics_without_task():
    rng = np.random.default_rng(3)
    references = rng.integers(0, 4, 50)
    predictions = rng.integers(0, 4, 50)
    assert glue.compute_glue_metrics(predictions, references) == {
        "accuracy": pytest.approx(np.mean(predictions == references))
    }
    scores, targets = rng.normal(size=(50, 1)), rng.normal(size=50)
    mse = glue.compute_glue_metrics(scores, targets, is_regression=True)["mse"]
    assert mse == pytest.approx(np.mean((scores[:, 0] - targets) ** 2))


def test_trainer_compute_metrics_takes_eval_prediction():
    rng = np.random.default_rng(4)
    logits, labels = rng.normal(size=(30, 2)), rng.integers(0, 2, 30)
    compute = glue.make_compute_metrics("mrpc", is_regression=False)
    expected = glue.compute_glue_metrics(logits.argmax(-1), labels, "mrpc")
    assert compute(SimpleNamespace(predictions=logits, label_ids=labels)) == expected
    assert compute(SimpleNamespace(predictions=(logits, None), label_ids=labels)) == expected


def test_constant_predictions_give_zero_correlation_not_nan():
    references = np.linspace(0, 5, 20)
    result = glue.compute_glue_metrics(np.full(20, 2.5), references, "stsb")
    assert result["pearson"] == 0.0 and result["spearmanr"] == 0.0
    assert glue.compute_glue_metrics(np.zeros(20, dtype=int), np.arange(20) % 2, "cola")["matthews_correlation"] == 0.0


@pytest.mark.parametrize(
    "predictions, references, task, match",
    [
        ([0, 1, 1], [0, 1], "sst2", "differ in length"),
        ([], [], "sst2", "empty"),
        ([0.5, float("nan")], [1.0, 2.0], "stsb", "NaN"),
        ([0, 1], [0, -1], "sst2", "unlabelled"),
        ([0, 1], [0, 1], "squad", "task_name='squad'.*allowed values"),
        (np.zeros((2, 2, 2)), [0, 1], "sst2", "classification outputs"),
        (np.zeros((2, 3)), [0.0, 1.0], "stsb", "regression outputs"),
    ],
)
def test_metrics_reject_bad_input(predictions, references, task, match):
    with pytest.raises(ValueError, match=match):
        glue.compute_glue_metrics(predictions, references, task)


def test_task_names():
    assert glue.normalize_task_name("SST-2") == "sst2"
    assert glue.normalize_task_name("STS-B") == "stsb"
    assert glue.normalize_task_name("CoLA") == "cola"
    with pytest.raises(ValueError, match="allowed values: cola, mnli"):
        glue.normalize_task_name("mnli-mm")
    assert glue.glue_eval_splits("mnli") == ["validation_matched", "validation_mismatched"]
    assert glue.metric_suffix("validation_mismatched") == "_mm" and glue.metric_suffix("validation_matched") == ""


def test_import_is_light():
    """glue.py pulls in no datasets / sklearn / scipy / torch at import time."""
    path = os.path.abspath(glue.__file__)
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('glue_alone', {path!r})\n"
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
        "heavy = [m for m in ('datasets', 'sklearn', 'scipy', 'torch', 'transformers', 'evaluate') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------------------------------------
# Real glue_data TSVs
# ----------------------------------------------------------------------------------------------


@needs_data
@pytest.mark.parametrize(
    "task, folder, num_train, num_dev, has_header",
    [("sst2", "SST-2", 67349, 872, True), ("cola", "CoLA", 8551, 1043, False), ("mrpc", "MRPC", 3667, 408, True)],
)
def test_real_glue_dir_row_counts(task, folder, num_train, num_dev, has_header):
    data = glue.load_glue_dir(DATA, task)
    assert {split: len(ds) for split, ds in data.items()} == {"train": num_train, "validation": num_dev}
    key1, key2 = glue.TASK_TO_KEYS[task]
    for split, file_name, expected in (("train", "train.tsv", num_train), ("validation", "dev.tsv", num_dev)):
        lines = raw_lines(os.path.join(DATA, folder, file_name))
        assert len(lines) - int(has_header) == expected  # one row per line: nothing merged, nothing dropped
        ds = data[split]
        assert ds.column_names == [k for k in (key1, key2) if k] + ["label", "idx"]
        assert ds.features["label"].names == list(glue.TASK_LABEL_NAMES[task])
        assert set(ds["label"]) == {0, 1}
        # first and last rows are the first and last data lines of the file
        for row, line in ((ds[0], lines[int(has_header)]), (ds[-1], lines[-1])):
            fields = line.split("\t")
            if task == "cola":
                assert (row["sentence"], row["label"]) == (fields[3], int(fields[1]))
            elif task == "sst2":
                assert (row["sentence"], row["label"]) == (fields[0], int(fields[1]))
            else:
                assert (row["sentence1"], row["sentence2"], row["label"]) == (fields[3], fields[4], int(fields[0]))
        # the label column agrees with the file line by line
        label_field = {"cola": 1, "sst2": 1, "mrpc": 0}[task]
        assert ds["label"] == [int(line.split("\t")[label_field]) for line in lines[int(has_header):]]


@needs_data
def test_real_glue_dir_bare_quotes_do_not_merge_rows():
    path = os.path.join(DATA, "MRPC", "train.tsv")
    data = glue.read_glue_tsv(path, "mrpc")
    quoted = [s for s in data["sentence1"] + data["sentence2"] if '"' in s]
    assert len(quoted) > 100  # the file does hold bare quotes ...
    with open(path, encoding="utf-8-sig", newline="") as f:
        csv_rows = list(csv.reader(f, delimiter="\t"))  # ... that a quoting CSV reader merges rows on
    assert len(csv_rows) - 1 < len(data["label"]) == 3667
    assert not any("\n" in s or "\t" in s for s in data["sentence1"] + data["sentence2"])


@needs_data
def test_glue_dir_accepts_task_folder_and_root():
    root = glue.load_glue_dir(DATA, "CoLA")
    folder = glue.load_glue_dir(os.path.join(DATA, "CoLA"), "cola")
    assert root["validation"]["sentence"] == folder["validation"]["sentence"]
    with pytest.raises(ValueError, match="none of the files of task rte"):
        glue.load_glue_dir(DATA, "rte")


# ----------------------------------------------------------------------------------------------
# The glue_data layout of every task (small files written like the originals)
# ----------------------------------------------------------------------------------------------


def write_tsv(path, rows):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write("\n".join("\t".join(row) for row in rows) + "\n")


MNLI_TRAIN_HEADER = ["index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse",
                     "sentence1_parse", "sentence2_parse", "sentence1", "sentence2", "label1", "gold_label"]
MNLI_DEV_HEADER = MNLI_TRAIN_HEADER[:-1] + ["label2", "label3", "label4", "label5", "gold_label"]
STSB_HEADER = ["index", "genre", "filename", "year", "old_index", "source1", "source2", "sentence1", "sentence2", "score"]


def mnli_row(header, i, label):
    row = [str(i), "p", "q", "fiction", "(a)", "(b)", "(ROOT a)", "(ROOT b)", f'premise "{i}', f"hypothesis {i}"]
    return row + [label] * (len(header) - len(row))


def test_glue_dir_mnli_layout(tmp_path):
    labels = ["contradiction", "entailment", "neutral", "entailment"]
    write_tsv(tmp_path / "MNLI" / "train.tsv", [MNLI_TRAIN_HEADER] + [mnli_row(MNLI_TRAIN_HEADER, i, l) for i, l in enumerate(labels)])
    write_tsv(tmp_path / "MNLI" / "dev_matched.tsv", [MNLI_DEV_HEADER] + [mnli_row(MNLI_DEV_HEADER, 0, "neutral")])
    write_tsv(tmp_path / "MNLI" / "dev_mismatched.tsv", [MNLI_DEV_HEADER] + [mnli_row(MNLI_DEV_HEADER, 0, "contradiction")] * 2)
    test_header = MNLI_TRAIN_HEADER[:10]
    write_tsv(tmp_path / "MNLI" / "test_matched.tsv", [test_header] + [mnli_row(test_header, 5, "")[:10]])
    data = glue.load_glue_dir(str(tmp_path), "mnli")
    assert set(data) == {"train", "validation_matched", "validation_mismatched", "test_matched"}
    assert data["train"].column_names == ["premise", "hypothesis", "label", "idx"]
    names = glue.TASK_LABEL_NAMES["mnli"]
    assert data["train"]["label"] == [names.index(l) for l in labels]
    assert data["train"][0]["premise"] == 'premise "0'
    assert data["validation_mismatched"]["label"] == [2, 2]
    assert data["test_matched"]["label"] == [-1]
    info = glue.glue_task_info(data, "mnli")
    assert info.eval_splits == ["validation_matched", "validation_mismatched"]
    assert info.test_splits == ["test_matched"] and info.num_labels == 3


@pytest.mark.parametrize(
    "task, folder, header, rows, expected_columns, expected_labels",
    [
        ("qnli", "QNLI", ["index", "question", "sentence", "label"],
         [["0", "q?", "s.", "not_entailment"], ["1", "q2?", "s2.", "entailment"]],
         {"question": ["q?", "q2?"], "sentence": ["s.", "s2."]}, [1, 0]),
        ("rte", "RTE", ["index", "sentence1", "sentence2", "label"],
         [["0", "a", "b", "entailment"], ["1", "c", "d", "not_entailment"]],
         {"sentence1": ["a", "c"], "sentence2": ["b", "d"]}, [0, 1]),
        ("wnli", "WNLI", ["index", "sentence1", "sentence2", "label"],
         [["0", "a", "b", "1"], ["1", "c", "d", "0"]],
         {"sentence1": ["a", "c"], "sentence2": ["b", "d"]}, [1, 0]),
        ("qqp", "QQP", ["id", "qid1", "qid2", "question1", "question2", "is_duplicate"],
         [["7", "1", "2", 'how "x', "why y", "0"], ["8", "3", "4", "what", "who", "1"]],
         {"question1": ['how "x', "what"], "question2": ["why y", "who"]}, [0, 1]),
        ("stsb", "STS-B", STSB_HEADER,
         [["0", "g", "f", "2012", "1", "s", "s", "a man", "a dog", "3.800"], ["1", "g", "f", "2012", "2", "s", "s", "x", "y", "0.5"]],
         {"sentence1": ["a man", "x"], "sentence2": ["a dog", "y"]}, [3.8, 0.5]),
    ],
)
def test_glue_dir_other_task_layouts(tmp_path, task, folder, header, rows, expected_columns, expected_labels):
    write_tsv(tmp_path / folder / "train.tsv", [header] + rows)
    write_tsv(tmp_path / folder / "dev.tsv", [header] + rows[:1])
    label_column = header.index({"qqp": "is_duplicate", "stsb": "score"}.get(task, "label"))
    test_header = [h for i, h in enumerate(header) if i != label_column]
    write_tsv(tmp_path / folder / "test.tsv", [test_header] + [[f for i, f in enumerate(rows[0]) if i != label_column]])
    data = glue.load_glue_dir(str(tmp_path), task)
    assert set(data) == {"train", "validation", "test"}
    for column, values in expected_columns.items():
        assert data["train"][column] == values
    assert data["train"]["label"] == pytest.approx(expected_labels)
    assert data["validation"]["label"] == pytest.approx(expected_labels[:1])
    assert data["test"]["label"] == [-1]
    assert data["test"][expected_columns and next(iter(expected_columns))] == next(iter(expected_columns.values()))[:1]
    info = glue.glue_task_info(data, task)
    assert info.is_regression == (task == "stsb") and info.num_labels == (1 if task == "stsb" else 2)


def test_glue_tsv_errors_name_file_and_line(tmp_path):
    path = tmp_path / "RTE" / "train.tsv"
    write_tsv(path, [["index", "sentence1", "sentence2", "label"], ["0", "a", "b", "entailment"], ["1", "a", "b"]])
    with pytest.raises(ValueError, match=r"train.tsv, line 3: expected 4 tab-separated fields, found 3"):
        glue.read_glue_tsv(str(path), "rte")
    write_tsv(path, [["index", "sentence1", "sentence2", "label"], ["0", "a", "b", "maybe"]])
    with pytest.raises(ValueError, match=r"line 2: label 'maybe' is not one of \['entailment', 'not_entailment'\]"):
        glue.read_glue_tsv(str(path), "rte")
    write_tsv(path, [["0", "a", "b", "entailment"]])
    with pytest.raises(ValueError, match="no header with the columns"):
        glue.read_glue_tsv(str(path), "rte")
    path = tmp_path / "STS-B" / "train.tsv"
    write_tsv(path, [STSB_HEADER, ["0", "g", "f", "2012", "1", "s", "s", "a", "b", "nan"]])
    with pytest.raises(ValueError, match="score 'nan' is not a finite number"):
        glue.read_glue_tsv(str(path), "stsb")


def test_crlf_and_bom_are_handled(tmp_path):
    path = tmp_path / "train.tsv"
    path.write_bytes("\ufeffsentence\tlabel\r\nfine film\t1\r\nbad \" film\t0\r\n".encode("utf-8"))
    data = glue.read_glue_tsv(str(path), "sst2")
    assert data == {"sentence": ["fine film", 'bad " film'], "label": [1, 0], "idx": [0, 1]}


# ----------------------------------------------------------------------------------------------
# Local files, task info, labels, tokenization
# ----------------------------------------------------------------------------------------------


def test_local_tsv_with_string_labels(tmp_path):
    write_tsv(tmp_path / "train.tsv", [["text", "label"], ['a "quoted', "pos"], ["b", "neg"], ["c", "neutral"]])
    write_tsv(tmp_path / "dev.tsv", [["text", "label"], ["d", "neg"]])
    raw = glue.load_glue_raw(train_file=str(tmp_path / "train.tsv"), validation_file=str(tmp_path / "dev.tsv"))
    assert raw["train"]["text"] == ['a "quoted', "b", "c"]
    info = glue.glue_task_info(raw)
    assert (info.sentence1_key, info.sentence2_key, info.is_regression) == ("text", None, False)
    assert info.label_list == ["neg", "neutral", "pos"]
    label_to_id, label2id = glue.resolve_label_ids(info)
    assert label_to_id == {"neg": 0, "neutral": 1, "pos": 2} and label2id == label_to_id
    # a model that already names these labels keeps its order (any case)
    label_to_id, label2id = glue.resolve_label_ids(info, {"POS": 0, "NEG": 1, "NEUTRAL": 2})
    assert label_to_id == {"neg": 1, "neutral": 2, "pos": 0}


def test_glue_task_label_order_from_model():
    info = glue.GlueTaskInfo("sst2", "sentence", None, False, ["negative", "positive"])
    assert glue.resolve_label_ids(info, {"LABEL_0": 0, "LABEL_1": 1}) == (None, {"negative": 0, "positive": 1})
    assert glue.resolve_label_ids(info, {"POSITIVE": 0, "NEGATIVE": 1}) == ({0: 1, 1: 0}, {"negative": 1, "positive": 0})


def test_local_file_errors(tmp_path):
    with pytest.raises(ValueError, match="share one extension"):
        glue.load_local_files(train_file="a.csv", validation_file="b.json")
    with pytest.raises(ValueError, match="'txt' is not supported"):
        glue.load_local_files(train_file="a.txt")
    with pytest.raises(ValueError, match="glue_dir needs task_name"):
        glue.load_glue_raw(glue_dir=str(tmp_path))
    write_tsv(tmp_path / "train.tsv", [["sentence", "label"], ["a", "0"]])
    raw = glue.load_local_files(train_file=str(tmp_path / "train.tsv"))
    with pytest.raises(ValueError, match=r"lacks the columns \['sentence1', 'sentence2'\]"):
        glue.glue_task_info(raw, "rte")
    write_tsv(tmp_path / "rte.tsv", [["sentence1", "sentence2", "label"], ["a", "b", "entailment"]])
    raw = glue.load_local_files(train_file=str(tmp_path / "rte.tsv"))
    with pytest.raises(ValueError, match="label column must hold class ids 0..1"):
        glue.glue_task_info(raw, "rte")


def test_tokenize_keeps_dynamic_lengths_and_maps_labels(tmp_path):
    from transformers import BertTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "a", "b", "c"]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = BertTokenizerFast(vocab_file=str(tmp_path / "vocab.txt"))
    write_tsv(tmp_path / "SST-2" / "train.tsv", [["sentence", "label"], ["a b c a b", "1"], ["a", "0"]])
    write_tsv(tmp_path / "SST-2" / "test.tsv", [["index", "sentence"], ["0", "b c"]])
    raw = glue.load_glue_dir(str(tmp_path), "sst2")
    info = glue.glue_task_info(raw, "sst2")
    data = glue.tokenize_glue(raw, info, tokenizer, max_seq_length=5, label_to_id={0: 1, 1: 0})
    assert sorted(data["train"].column_names) == ["attention_mask", "input_ids", "labels", "token_type_ids"]
    assert [len(ids) for ids in data["train"]["input_ids"]] == [5, 3]  # truncated, not padded
    assert data["train"]["labels"] == [0, 1]
    assert data["test"]["labels"] == [-1]
    padded = glue.tokenize_glue(raw, info, tokenizer, max_seq_length=6, pad_to_max_length=True)
    assert [len(ids) for ids in padded["train"]["input_ids"]] == [6, 6]
    assert len(glue.take_first(data["train"], 1)) == 1 and len(glue.take_first(data["train"], 10)) == 2
    with pytest.raises(ValueError, match="positive integer"):
        glue.take_first(data["train"], 0)
