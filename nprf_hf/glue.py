"""GLUE data loading and metrics, shared by `examples/run_glue.py` (Trainer) and
`examples/run_glue_no_trainer.py` (Accelerate).

Three data sources give the same columns (those of the Hub dataset `nyu-mll/glue`):
  - the Hub: `load_glue_raw(task_name="sst2")`
  - the original `glue_data` TSV release: `load_glue_raw(task_name="sst2", glue_dir=...)`
  - local CSV / TSV / JSON files: `load_glue_raw(train_file=..., validation_file=...)`

Metrics are computed offline with scikit-learn / scipy (`compute_glue_metrics`).
No model code and no script plumbing here (the scripts' shared plumbing is `examples/glue_scripts.py`);
`datasets`, `sklearn` and `scipy` are imported inside the functions that need them, so that importing this
module stays light.
"""

import logging
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np


logger = logging.getLogger(__name__)


class UsageError(ValueError):
    """A mistake in a script's arguments or input files (unknown task, missing folder, bad flag combination):
    the GLUE scripts report it in one line and exit 2, like argparse, instead of a traceback
    (`examples/glue_scripts.py`'s `run_script`)."""


GLUE_TASKS = ("cola", "mnli", "mrpc", "qnli", "qqp", "rte", "sst2", "stsb", "wnli")

# Text columns of each task in `nyu-mll/glue` (second is None for single-sentence tasks).
TASK_TO_KEYS = {
    "cola": ("sentence", None),
    "mnli": ("premise", "hypothesis"),
    "mrpc": ("sentence1", "sentence2"),
    "qnli": ("question", "sentence"),
    "qqp": ("question1", "question2"),
    "rte": ("sentence1", "sentence2"),
    "sst2": ("sentence", None),
    "stsb": ("sentence1", "sentence2"),
    "wnli": ("sentence1", "sentence2"),
}

# Label names in id order, as in `nyu-mll/glue`; None for the regression task STS-B.
TASK_LABEL_NAMES = {
    "cola": ("unacceptable", "acceptable"),
    "mnli": ("entailment", "neutral", "contradiction"),
    "mrpc": ("not_equivalent", "equivalent"),
    "qnli": ("entailment", "not_entailment"),
    "qqp": ("not_duplicate", "duplicate"),
    "rte": ("entailment", "not_entailment"),
    "sst2": ("negative", "positive"),
    "stsb": None,
    "wnli": ("not_entailment", "entailment"),
}

# Directory of each task inside the original `glue_data` release.
GLUE_DIR_NAMES = {
    "cola": "CoLA",
    "mnli": "MNLI",
    "mrpc": "MRPC",
    "qnli": "QNLI",
    "qqp": "QQP",
    "rte": "RTE",
    "sst2": "SST-2",
    "stsb": "STS-B",
    "wnli": "WNLI",
}

# Split name (as on the Hub) -> file name inside the task directory of `glue_data`.
_GLUE_DIR_SPLITS = {"train": "train.tsv", "validation": "dev.tsv", "test": "test.tsv"}
_MNLI_DIR_SPLITS = {
    "train": "train.tsv",
    "validation_matched": "dev_matched.tsv",
    "validation_mismatched": "dev_mismatched.tsv",
    "test_matched": "test_matched.tsv",
    "test_mismatched": "test_mismatched.tsv",
}

# Hub column -> header name in the `glue_data` TSV files. Test files have no label column.
_TSV_HEADER_COLUMNS = {
    "cola": {"sentence": "sentence", "label": "label"},
    "mnli": {"premise": "sentence1", "hypothesis": "sentence2", "label": "gold_label"},
    "mrpc": {"sentence1": "#1 String", "sentence2": "#2 String", "label": "Quality"},
    "qnli": {"question": "question", "sentence": "sentence", "label": "label"},
    "qqp": {"question1": "question1", "question2": "question2", "label": "is_duplicate"},
    "rte": {"sentence1": "sentence1", "sentence2": "sentence2", "label": "label"},
    "sst2": {"sentence": "sentence", "label": "label"},
    "stsb": {"sentence1": "sentence1", "sentence2": "sentence2", "label": "score"},
    "wnli": {"sentence1": "sentence1", "sentence2": "sentence2", "label": "label"},
}
# CoLA train/dev have no header: source code, label, author's mark, sentence.
_COLA_POSITIONS = {"label": 1, "sentence": 3}
_COLA_NUM_FIELDS = 4


def normalize_task_name(task_name: str) -> str:
    """'SST-2' / 'sst-2' / 'sst2' -> 'sst2'; raises ValueError for anything that is not a GLUE task."""
    name = task_name.lower().replace("-", "").replace("_", "")
    if name not in GLUE_TASKS:
        raise UsageError(f"task_name={task_name!r} is not a GLUE task; allowed values: {', '.join(GLUE_TASKS)}")
    return name


def glue_eval_splits(task_name: Optional[str]) -> List[str]:
    """The labelled evaluation splits of a task: both MNLI dev sets, else 'validation'."""
    if task_name is not None and normalize_task_name(task_name) == "mnli":
        return ["validation_matched", "validation_mismatched"]
    return ["validation"]


def glue_test_splits(task_name: Optional[str]) -> List[str]:
    if task_name is not None and normalize_task_name(task_name) == "mnli":
        return ["test_matched", "test_mismatched"]
    return ["test"]


def metric_suffix(split: str) -> str:
    """Suffix of the metric names of an evaluation split ('_mm' for MNLI mismatched, as in HF's run_glue)."""
    return "_mm" if split.endswith("mismatched") else ""


# ----------------------------------------------------------------------------------------------
# glue_data TSV files
# ----------------------------------------------------------------------------------------------


def _parse_label(raw: str, task_name: str, path: str, line_no: int):
    names = TASK_LABEL_NAMES[task_name]
    if names is None:  # STS-B similarity score
        try:
            value = float(raw)
        except ValueError:
            value = float("nan")
        if not math.isfinite(value):
            raise UsageError(f"{path}, line {line_no}: score {raw!r} is not a finite number")
        return value
    if raw in names:
        return names.index(raw)
    if raw.strip().isdigit() and int(raw) < len(names):
        return int(raw)
    raise UsageError(
        f"{path}, line {line_no}: label {raw!r} is not one of {list(names)} or 0..{len(names) - 1} for task {task_name}"
    )


def read_glue_tsv(path: str, task_name: str) -> Dict[str, list]:
    """Read one TSV file of the original `glue_data` release.

    Fields are split on tabs with quoting off (GLUE text holds bare `"` that a CSV reader would use
    to merge rows); a UTF-8 BOM is dropped. CoLA train/dev have no header and are read by position;
    every other file is read by its header names.

    Returns Hub-style columns: the task's text columns, `label` (class id; float score for STS-B;
    -1 for unlabelled test files) and `idx` (0-based row number).
    """
    task_name = normalize_task_name(task_name)
    with open(path, encoding="utf-8-sig", newline="") as f:
        lines = f.read().split("\n")
    while lines and lines[-1].strip("\r") == "":
        lines.pop()
    lines = [line[:-1] if line.endswith("\r") else line for line in lines]
    if not lines:
        raise UsageError(f"{path} is empty")

    text_keys = [k for k in TASK_TO_KEYS[task_name] if k is not None]
    header_columns = _TSV_HEADER_COLUMNS[task_name]
    first = lines[0].split("\t")
    if all(header_columns[k] in first for k in text_keys):
        num_fields = len(first)
        positions = {k: first.index(name) for k, name in header_columns.items() if name in first}
        first_data_line = 1
    elif task_name == "cola" and len(first) == _COLA_NUM_FIELDS:
        num_fields = _COLA_NUM_FIELDS
        positions = dict(_COLA_POSITIONS)
        first_data_line = 0
    else:
        expected = [header_columns[k] for k in text_keys]
        raise UsageError(f"{path}: first line has no header with the columns {expected} of task {task_name}: {first}")

    columns = {k: [] for k in text_keys}
    columns["label"] = []
    for line_no, line in enumerate(lines[first_data_line:], start=first_data_line + 1):
        fields = line.split("\t")
        if len(fields) != num_fields:
            raise UsageError(f"{path}, line {line_no}: expected {num_fields} tab-separated fields, found {len(fields)}")
        for k in text_keys:
            columns[k].append(fields[positions[k]])
        if "label" in positions:
            columns["label"].append(_parse_label(fields[positions["label"]], task_name, path, line_no))
        else:
            columns["label"].append(-1.0 if task_name == "stsb" else -1)
    columns["idx"] = list(range(len(columns["label"])))
    return columns


def _glue_features(task_name: str):
    from datasets import ClassLabel, Features, Value

    features = {k: Value("string") for k in TASK_TO_KEYS[task_name] if k is not None}
    names = TASK_LABEL_NAMES[task_name]
    features["label"] = Value("float32") if names is None else ClassLabel(names=list(names))  # -1: unlabelled
    features["idx"] = Value("int32")
    return Features(features)


def glue_dir_files(glue_dir: str, task_name: str) -> Dict[str, str]:
    """Split name -> path of the files present for a task. `glue_dir` is the `glue_data` root
    (holding e.g. `SST-2/`) or the task's own directory (holding `train.tsv`, `dev.tsv`)."""
    task_name = normalize_task_name(task_name)
    if not os.path.isdir(glue_dir):
        raise UsageError(f"no such directory: glue_dir={glue_dir!r} (the glue_data root or the task's folder)")
    task_dir = os.path.join(glue_dir, GLUE_DIR_NAMES[task_name])
    if not os.path.isdir(task_dir):
        task_dir = glue_dir
    layout = _MNLI_DIR_SPLITS if task_name == "mnli" else _GLUE_DIR_SPLITS
    files = {split: os.path.join(task_dir, name) for split, name in layout.items()}
    files = {split: path for split, path in files.items() if os.path.isfile(path)}
    if not files:
        raise UsageError(
            f"glue_dir={glue_dir!r} has none of the files of task {task_name}: expected "
            f"{os.path.join(GLUE_DIR_NAMES[task_name], '{' + ','.join(layout.values()) + '}')}"
        )
    return files


def load_glue_dir(glue_dir: str, task_name: str):
    """A `datasets.DatasetDict` of every split of a task found in a `glue_data` directory, with the
    columns and label ids of `nyu-mll/glue` (MNLI: validation_matched / validation_mismatched)."""
    from datasets import Dataset, DatasetDict

    task_name = normalize_task_name(task_name)
    splits = {}
    for split, path in glue_dir_files(glue_dir, task_name).items():
        columns = read_glue_tsv(path, task_name)
        splits[split] = Dataset.from_dict(columns, features=_glue_features(task_name))
        logger.info("Read %d rows of %s %s from %s", len(columns["idx"]), task_name, split, path)
    return DatasetDict(splits)


# ----------------------------------------------------------------------------------------------
# Any source -> DatasetDict, task info, tokenization
# ----------------------------------------------------------------------------------------------


def load_local_files(train_file=None, validation_file=None, test_file=None, cache_dir=None):
    """CSV / TSV / JSON(L) files -> DatasetDict with splits train / validation / test (those given).
    TSV is read with quoting off, like the GLUE files."""
    from datasets import load_dataset

    data_files = {
        split: path
        for split, path in (("train", train_file), ("validation", validation_file), ("test", test_file))
        if path is not None
    }
    if not data_files:
        raise UsageError("give at least one of train_file / validation_file / test_file")
    extensions = {path.rsplit(".", 1)[-1].lower() for path in data_files.values()}
    if len(extensions) != 1:
        raise UsageError(f"train_file / validation_file / test_file must share one extension, got {sorted(extensions)}")
    extension = extensions.pop()
    if extension == "csv":
        return load_dataset("csv", data_files=data_files, cache_dir=cache_dir)
    if extension == "tsv":
        return load_dataset("csv", data_files=data_files, delimiter="\t", quoting=3, cache_dir=cache_dir)
    if extension in ("json", "jsonl"):
        return load_dataset("json", data_files=data_files, cache_dir=cache_dir)
    raise UsageError(f"data file extension {extension!r} is not supported; allowed values: csv, tsv, json, jsonl")


def load_glue_raw(
    task_name=None,
    glue_dir=None,
    train_file=None,
    validation_file=None,
    test_file=None,
    cache_dir=None,
    token=None,
):
    """The raw GLUE-style DatasetDict: from `glue_dir` (needs task_name), from local files, or else
    from the Hub dataset `nyu-mll/glue` (needs task_name and network)."""
    local_files = any(f is not None for f in (train_file, validation_file, test_file))
    if glue_dir is not None and local_files:
        raise UsageError("give either glue_dir or train_file/validation_file/test_file, not both")
    if glue_dir is not None:
        if task_name is None:
            raise UsageError("glue_dir needs task_name (one of: " + ", ".join(GLUE_TASKS) + ")")
        return load_glue_dir(glue_dir, task_name)
    if local_files:
        return load_local_files(train_file, validation_file, test_file, cache_dir=cache_dir)
    if task_name is None:
        raise UsageError("give task_name (a GLUE task: " + ", ".join(GLUE_TASKS) + "), glue_dir, or train_file/validation_file")
    from datasets import load_dataset

    return load_dataset("nyu-mll/glue", normalize_task_name(task_name), cache_dir=cache_dir, token=token)


@dataclass
class GlueTaskInfo:
    """What the scripts need to know about a (GLUE or custom) sequence-classification data set."""

    task_name: Optional[str]
    sentence1_key: str
    sentence2_key: Optional[str]
    is_regression: bool
    label_list: Optional[List] = None  # label values in id order (None for regression)
    eval_splits: List[str] = field(default_factory=lambda: ["validation"])
    test_splits: List[str] = field(default_factory=lambda: ["test"])

    @property
    def num_labels(self) -> int:
        return 1 if self.is_regression else len(self.label_list)


def glue_task_info(raw_datasets, task_name: Optional[str] = None) -> GlueTaskInfo:
    """Text columns, labels and splits of a raw DatasetDict (from `load_glue_raw`)."""
    if not raw_datasets:
        raise UsageError("raw_datasets has no splits")
    reference = raw_datasets["train"] if "train" in raw_datasets else next(iter(raw_datasets.values()))
    columns = reference.column_names
    if task_name is not None:
        task_name = normalize_task_name(task_name)
        key1, key2 = TASK_TO_KEYS[task_name]
        missing = [k for k in (key1, key2, "label") if k is not None and k not in columns]
        if missing:
            raise UsageError(f"data for task {task_name} lacks the columns {missing} (has {columns})")
        names = TASK_LABEL_NAMES[task_name]
        label_dtype = getattr(reference.features["label"], "dtype", None)
        if names is not None and label_dtype not in ("int8", "int16", "int32", "int64"):
            raise UsageError(
                f"with task_name={task_name!r} the label column must hold class ids 0..{len(names) - 1} "
                f"(for {list(names)}), found dtype {label_dtype}"
            )
        return GlueTaskInfo(
            task_name=task_name,
            sentence1_key=key1,
            sentence2_key=key2,
            is_regression=names is None,
            label_list=None if names is None else list(names),
            eval_splits=[s for s in glue_eval_splits(task_name) if s in raw_datasets],
            test_splits=[s for s in glue_test_splits(task_name) if s in raw_datasets],
        )

    if "label" not in columns:
        raise UsageError(f"data files need a 'label' column (have {columns})")
    is_regression = reference.features["label"].dtype in ("float16", "float32", "float64")
    label_list = None
    if not is_regression:
        label_list = sorted({label for split in raw_datasets if split != "test" for label in raw_datasets[split]["label"]})
        if len(label_list) < 2:
            raise UsageError(f"labels must take at least 2 values for classification, found {label_list}")
    non_label = [c for c in columns if c not in ("label", "idx")]
    if "sentence1" in non_label and "sentence2" in non_label:
        key1, key2 = "sentence1", "sentence2"
    elif len(non_label) >= 2:
        key1, key2 = non_label[:2]
    elif len(non_label) == 1:
        key1, key2 = non_label[0], None
    else:
        raise UsageError(f"data files need at least one text column besides 'label' (have {columns})")
    return GlueTaskInfo(
        task_name=None,
        sentence1_key=key1,
        sentence2_key=key2,
        is_regression=is_regression,
        label_list=label_list,
        eval_splits=[s for s in ("validation",) if s in raw_datasets],
        test_splits=[s for s in ("test",) if s in raw_datasets],
    )


def resolve_label_ids(info: GlueTaskInfo, model_label2id: Optional[Dict[str, int]] = None):
    """Map the data's labels to the model's output ids.

    Returns `(label_to_id, label2id)`: `label_to_id` maps a raw label value of the data to a model id
    (None = raw values already are the ids), `label2id` is the name -> id map to store in the model
    config (None for regression). A model whose config already names the same labels (in any case,
    in any order, e.g. a checkpoint fine-tuned on this task) keeps its order.
    """
    if info.is_regression:
        return None, None
    names = [str(label) for label in info.label_list]
    if model_label2id and sorted(k.lower() for k in model_label2id) == sorted(n.lower() for n in names):
        by_lower = {k.lower(): v for k, v in model_label2id.items()}
        model_ids = [int(by_lower[n.lower()]) for n in names]
        if model_ids != list(range(len(names))):
            logger.info("Using the label order of the model config: %s", dict(zip(names, model_ids)))
    else:
        model_ids = list(range(len(names)))
    label2id = dict(zip(names, model_ids))
    if info.task_name is not None:  # the data holds class ids 0..C-1 in the order of label_list
        label_to_id = None if model_ids == list(range(len(names))) else dict(enumerate(model_ids))
    else:  # custom files: the data holds the label values themselves
        label_to_id = dict(zip(info.label_list, model_ids))
    return label_to_id, label2id


def tokenize_glue(
    raw_datasets,
    info: GlueTaskInfo,
    tokenizer,
    max_seq_length: int = 128,
    label_to_id: Optional[dict] = None,
    pad_to_max_length: bool = False,
    num_proc: Optional[int] = None,
    load_from_cache_file: bool = True,
):
    """Tokenize every split; keep only the tokenizer outputs and `labels` (model ids; -1 for unlabelled rows).
    Without `pad_to_max_length` rows keep their own length: pad per batch (DataCollatorWithPadding)."""
    key1, key2 = info.sentence1_key, info.sentence2_key
    if getattr(tokenizer, "model_max_length", None) and max_seq_length > tokenizer.model_max_length:
        logger.warning(
            "max_seq_length=%d exceeds the tokenizer's model_max_length=%d; using %d",
            max_seq_length,
            tokenizer.model_max_length,
            tokenizer.model_max_length,
        )
        max_seq_length = tokenizer.model_max_length

    def preprocess(examples):
        texts = (examples[key1],) if key2 is None else (examples[key1], examples[key2])
        texts = tuple(["" if t is None else t for t in column] for column in texts)
        result = tokenizer(
            *texts, padding="max_length" if pad_to_max_length else False, max_length=max_seq_length, truncation=True
        )
        if "label" in examples:
            labels = examples["label"]
            if label_to_id is not None:
                labels = [-1 if label == -1 else label_to_id[label] for label in labels]
            result["labels"] = labels  # a new column: "label" would keep the raw column's type
        return result

    return raw_datasets.map(
        preprocess,
        batched=True,
        num_proc=num_proc,
        remove_columns=next(iter(raw_datasets.values())).column_names,
        load_from_cache_file=load_from_cache_file,
        desc="Tokenizing",
    )


def take_first(dataset, max_samples: Optional[int]):
    """The first `max_samples` rows (all rows when None or larger than the data)."""
    if max_samples is None:
        return dataset
    if max_samples < 1:
        raise UsageError(f"max samples must be a positive integer, got {max_samples}")
    return dataset.select(range(min(max_samples, len(dataset))))


# ----------------------------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------------------------


def glue_metric_names(task_name: Optional[str], is_regression: bool = False) -> List[str]:
    """Metric names reported for a task (the names of the `glue` metric of `evaluate`)."""
    if task_name is None:
        return ["mse"] if is_regression else ["accuracy"]
    task_name = normalize_task_name(task_name)
    if task_name == "cola":
        return ["matthews_correlation"]
    if task_name == "stsb":
        return ["pearson", "spearmanr"]
    if task_name in ("mrpc", "qqp"):
        return ["accuracy", "f1"]
    return ["accuracy"]


def predictions_from_outputs(outputs, is_regression: bool) -> np.ndarray:
    """Model outputs ([N, C] logits or [N] / [N, 1] scores) -> [N] predictions (class ids or scores)."""
    outputs = np.asarray(outputs)
    if is_regression:
        if outputs.ndim == 2 and outputs.shape[1] == 1:
            outputs = outputs[:, 0]
        if outputs.ndim != 1:
            raise ValueError(f"regression outputs must have shape [N] or [N, 1], got {outputs.shape}")
        return outputs.astype(np.float64)
    if outputs.ndim == 2:
        return outputs.argmax(axis=-1)
    if outputs.ndim != 1:
        raise ValueError(f"classification outputs must be [N, num_labels] logits or [N] class ids, got {outputs.shape}")
    return outputs


def _correlation(kind: str, x: np.ndarray, y: np.ndarray) -> float:
    from scipy import stats

    if np.ptp(x) == 0 or np.ptp(y) == 0:
        # Undefined for a constant input; report 0 (no linear/rank relation), as sklearn does for MCC.
        logger.warning("%s correlation of a constant input is undefined; reporting 0.0", kind)
        return 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = stats.pearsonr(x, y)[0] if kind == "pearson" else stats.spearmanr(x, y)[0]
    return float(result)


def compute_glue_metrics(
    predictions: Sequence, references: Sequence, task_name: Optional[str] = None, is_regression: bool = False
) -> Dict[str, float]:
    """GLUE metrics of predictions against references.

    predictions: [N] class ids or scores, or [N, C] logits (argmax is taken).
    references: [N] class ids (floats for STS-B / regression).
    Returns: CoLA matthews_correlation; STS-B pearson, spearmanr; MRPC/QQP accuracy, f1 (positive
    class 1); other tasks accuracy; no task: accuracy (mse for regression). With more than one
    metric, `combined_score` is their mean (as in HF's run_glue).
    """
    if task_name is not None:
        task_name = normalize_task_name(task_name)
        is_regression = task_name == "stsb"
    predictions = predictions_from_outputs(predictions, is_regression)
    references = np.asarray(references)
    if references.ndim != 1:
        raise ValueError(f"references must have shape [N], got {references.shape}")
    if len(predictions) != len(references):
        raise ValueError(f"predictions ({len(predictions)}) and references ({len(references)}) differ in length")
    if len(references) == 0:
        raise ValueError("predictions and references are empty")
    if not np.all(np.isfinite(predictions.astype(np.float64))):
        raise ValueError("predictions contain NaN or infinite values")
    if not np.all(np.isfinite(references.astype(np.float64))):
        raise ValueError("references contain NaN or infinite values")
    if not is_regression and np.any(references < 0):
        raise ValueError("references contain negative labels (-1 marks unlabelled rows, e.g. GLUE test splits)")

    results = {}
    for name in glue_metric_names(task_name, is_regression):
        if name == "accuracy":
            results[name] = float(np.mean(predictions == references))
        elif name == "f1":
            from sklearn.metrics import f1_score

            results[name] = float(f1_score(references, predictions, pos_label=1, average="binary", zero_division=0))
        elif name == "matthews_correlation":
            from sklearn.metrics import matthews_corrcoef

            results[name] = float(matthews_corrcoef(references, predictions))
        elif name in ("pearson", "spearmanr"):
            results[name] = _correlation(name, predictions.astype(np.float64), references.astype(np.float64))
        elif name == "mse":
            results[name] = float(np.mean((predictions.astype(np.float64) - references.astype(np.float64)) ** 2))
    if len(results) > 1:
        results["combined_score"] = float(np.mean(list(results.values())))
    return results


def make_compute_metrics(task_name: Optional[str], is_regression: bool):
    """`compute_metrics` for the Trainer: EvalPrediction -> compute_glue_metrics(...)."""

    def compute_metrics(eval_prediction):
        outputs = eval_prediction.predictions
        if isinstance(outputs, tuple):
            outputs = outputs[0]
        return compute_glue_metrics(outputs, eval_prediction.label_ids, task_name, is_regression)

    return compute_metrics


def training_texts(columns, sentence1_key: str, sentence2_key: Optional[str]) -> list:
    """The texts of a raw split (a Dataset or a dict of columns) as attention transfer takes them:
    strings, or (first, second) pairs."""
    first = list(columns[sentence1_key])
    if sentence2_key is None:
        return first
    return list(zip(first, columns[sentence2_key]))
