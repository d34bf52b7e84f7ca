# Copyright 2025 The nprf-hf authors. Licensed under the Apache License, Version 2.0.
"""Model cards for NPRF checkpoints and publishing them on the Hub.

    write_model_card(model_dir, eval_results=..., base_model=..., datasets=..., task_name=...)
        -> writes MODEL_DIR/README.md: YAML front matter (library_name, pipeline_tag, tags, datasets,
           metrics, base_model, model-index from eval_results.json) + usage, NPRF settings, the
           conversion recipe and the limits. CARD_TEMPLATE below is the only template.
    push_nprf_to_hub(model_or_dir, repo_id, tokenizer=None, card_kwargs=...)
        -> weights, config, remote code files, tokenizer and this card in one commit; a directory gets its card
           written in place first, so a failed push (`hub.PushError`) loses nothing.
        (`model.push_to_hub` uploads weights, config and code, but a generic README.md.)
    push_saved_model(model_dir, repo_id, ...)
        -> what a script's `--push_to_hub` does last: any saved model folder, an NPRF one with this card.
    nprf-hf card MODEL_DIR [--eval-results eval_results.json] [--base-model ID] [--dataset ID] ...
    nprf-hf push MODEL_DIR REPO_ID
        -> the command lines of `write_model_card` and of pushing a saved folder (declared in `cli.py`).
"""

import json
import logging
import os
import string
import tempfile

from .families import HEADS, NPRF_FAMILIES, family_of, position_offset
from .hub import HUB_ID, PushError, looks_like_path, push_folder


logger = logging.getLogger(__name__)


BASE_TAGS = ("nprf", "kernelized-attention", "relative-position", "random-features", "linear-attention", "custom_code")

# eval_results.json keys (after the "eval_" prefix) that are not quality metrics
NON_METRICS = (
    "loss", "runtime", "samples_per_second", "steps_per_second", "samples", "epoch", "model_preparation_time",
    "combined_score", "jit_compilation_time",
)
METRIC_TYPES = {"pearson": "pearsonr"}  # our metric names -> Hub metric ids
METRIC_NAMES = {
    "accuracy": "Accuracy",
    "f1": "F1",
    "matthews_correlation": "Matthews Correlation",
    "pearson": "Pearson Correlation",
    "spearmanr": "Spearman Correlation",
    "perplexity": "Perplexity",
}
GLUE_DATASET = "nyu-mll/glue"

CARD_TEMPLATE = """
# $model_name

$family_name with the attention of *Stable, Fast and Accurate: Kernelized Attention with Relative Positional
Encoding* (Luo et al., NeurIPS 2021), built with the `nprf-hf` package. Every head
computes normalized positive random feature (NPRF) attention with a T5-bucketed relative position bias:
queries and keys are L2-normalized, mapped through $num_random_features positive random features
(`$feature_map`), and the relative bias enters as a Toeplitz matrix, so the attention costs
O(n log n) (`fft`) or O(n) (`banded`) instead of O(n^2) in the input length n.

$provenance

- Architecture: `$architecture` (`model_type: $model_type`), pipeline `$pipeline_tag`
$task_line

## Evaluation

$results

## Usage

The modeling code ships with the weights (`modeling_nprf.py`, `configuration_nprf.py` and the files they import):
load it with `trust_remote_code=True` (or, with the nprf-hf package installed, `import nprf_hf`, which registers
the classes with the Auto classes). The tokenizer is the source's plain one, but `AutoTokenizer` reads `config.json`
first, which names that code: without the flag it asks whether to run it.

```python
from transformers import AutoTokenizer, $auto_class, pipeline

tokenizer = AutoTokenizer.from_pretrained("$repo_id", trust_remote_code=True)
model = $auto_class.from_pretrained("$repo_id", trust_remote_code=True)
outputs = model(**tokenizer("$example_text", return_tensors="pt"))

pipe = pipeline("$pipeline_tag", model="$repo_id", trust_remote_code=True)
```

## NPRF settings

| field | value |
|---|---|
$settings

## How it was made

NPRF models keep every tensor of the source softmax checkpoint under the same name and shape
(copied bit for bit) and add only the relative position bias table(s) and the random projections. The
recipe below rebuilds this model's NPRF settings; the bias table starts at zeros (`--rpe-init zeros`) or from
the source's own attention (`--rpe-init calibrated --calibration-text FILE`) and is then trained.

$training

```bash
$recipe
```

## Limits

- The attention is a random-feature estimate of a *normalized* softmax kernel with a learned relative bias,
  not the source model's softmax attention: a converted checkpoint must be fine-tuned (or further pre-trained)
  before use. The conversion copies every source tensor, but the attention function changes.
- $length_limit$untrained_head
- `output_attentions=True` and 4D attention masks that are not padding masks use the dense n x n weights
  (O(n^2) memory); both raise beyond `output_attentions_max_length` = $output_attentions_max_length tokens.
- Attention dropout (`attention_probs_dropout_prob`) is not applied; flash / flex attention are not supported
  (`sdpa` and `eager` masks are); decoder cross-attention, if any, is HF's softmax attention.
- The random projection is stored with the weights (`feature_redraw_interval` = $feature_redraw_interval,
  0 = fixed), so a reloaded model gives identical outputs.

## Citation

```bibtex
@inproceedings{luo2021stable,
  title     = {Stable, Fast and Accurate: Kernelized Attention with Relative Positional Encoding},
  author    = {Luo, Shengjie and Li, Shanda and Cai, Tianle and He, Di and Peng, Dinglan and Zheng, Shuxin and
               Ke, Guolin and Wang, Liwei and Liu, Tie-Yan},
  booktitle = {Advances in Neural Information Processing Systems},
  year      = {2021}
}
```
"""

def _setting_fields():
    """The card's settings table: every NPRF field, plus the position table's size."""
    from .configuration_nprf import NPRF_FIELDS

    return (*(field.name for field in NPRF_FIELDS), "max_position_embeddings")


def _convert_options():
    """The NPRF fields that `nprf-hf convert` sets, for the card's recipe."""
    from .configuration_nprf import NPRF_FIELDS

    return tuple(field.name for field in NPRF_FIELDS if field.convert_option)


# ----------------------------------------------------------------------------------------------
# Reading what the card describes
# ----------------------------------------------------------------------------------------------


def read_nprf_config(model_dir):
    """config.json of an NPRF checkpoint as a dict; a ValueError for anything else."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{model_dir} has no config.json: pass the directory of a saved NPRF model")
    with open(path) as f:
        config = json.load(f)
    if config.get("model_type") not in NPRF_FAMILIES:
        raise ValueError(
            f"{path} has model_type={config.get('model_type')!r}, not an NPRF model ({', '.join(NPRF_FAMILIES)}); "
            "convert it first with `nprf-hf convert`"
        )
    return config


def pipeline_for(config):
    """(architecture, pipeline_tag, Auto class) from config['architectures'] (default: the base model)."""
    family = family_of(config["model_type"])
    architecture = (config.get("architectures") or [family.class_name("model")])[0]
    head = next((h for h in family.heads if family.class_name(h) == architecture), None)
    if head is None:
        raise ValueError(
            f"architecture {architecture!r} is not an NPRF class; expected one of "
            f"{', '.join(family.class_name(h) for h in family.heads)}"
        )
    return architecture, HEADS[head].pipeline_tag or "feature-extraction", HEADS[head].auto_class


def load_eval_results(eval_results):
    """A dict from a path to a JSON file (e.g. eval_results.json of the GLUE scripts) or a dict."""
    if isinstance(eval_results, dict):
        return dict(eval_results)
    if not os.path.isfile(eval_results):
        raise ValueError(f"eval_results file {eval_results} does not exist")
    with open(eval_results) as f:
        results = json.load(f)
    if not isinstance(results, dict):
        raise ValueError(f"{eval_results} must hold a JSON object of metrics, got {type(results).__name__}")
    return results


def metrics_from_results(results):
    """[(metric, split suffix, value)] from trainer-style results: 'eval_accuracy' -> ('accuracy', '', v),
    'eval_accuracy_mm' (MNLI mismatched) -> ('accuracy', '_mm', v), 'perplexity' -> ('perplexity', '', v).
    Losses, runtimes, sample counts and train_/predict_ keys are left out."""
    metrics = []
    for key, value in results.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if key.startswith("eval_"):
            name = key[len("eval_") :]
        elif key in ("perplexity", "perplexity_mm"):
            name = key
        else:
            continue
        suffix = "_mm" if name.endswith("_mm") else ""
        name = name[: len(name) - len(suffix)]
        if name not in NON_METRICS:
            metrics.append((name, suffix, float(value)))
    return metrics


def _glue_task(task_name):
    from .glue import GLUE_TASKS

    name = (task_name or "").lower().replace("-", "").replace("_", "")
    return name if name in GLUE_TASKS else None


def build_eval_results(results, pipeline_tag, task_name, dataset, eval_split=None):
    """huggingface_hub EvalResult list (the card's model-index) from a results dict. The split is
    `eval_split` (default "validation"); MNLI's are validation_matched / validation_mismatched."""
    from huggingface_hub import EvalResult

    glue_task = _glue_task(task_name)
    entries = []
    for metric, suffix, value in metrics_from_results(results):
        split = eval_split or "validation"
        if glue_task == "mnli":
            split = {"": "validation_matched", "_mm": "validation_mismatched"}[suffix]
        elif suffix:
            split += suffix
        if glue_task is not None:
            dataset_name, config = f"GLUE {glue_task.upper()}", glue_task
        else:
            dataset_name, config = task_name or dataset, task_name
        entries.append(
            EvalResult(
                task_type=pipeline_tag,
                task_name=pipeline_tag.replace("-", " ").title(),
                dataset_type=dataset,
                dataset_name=dataset_name,
                dataset_config=config,
                dataset_split=split,
                metric_type=METRIC_TYPES.get(metric, metric),
                metric_name=METRIC_NAMES.get(metric, metric.replace("_", " ").title()),
                metric_value=value,
            )
        )
    return entries


# ----------------------------------------------------------------------------------------------
# The card
# ----------------------------------------------------------------------------------------------


def _as_list(value):
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def _results_table(eval_results):
    if not eval_results:
        return "No evaluation results were given (`nprf-hf card MODEL_DIR --eval-results eval_results.json`)."
    rows = ["| dataset | config | split | metric | value |", "|---|---|---|---|---|"]
    for r in eval_results:
        rows.append(
            f"| {r.dataset_type} | {r.dataset_config or ''} | {r.dataset_split} | {r.metric_name} | {r.metric_value:.4f} |"
        )
    return "\n".join(rows)


def _conversion_record(model_dir):
    """`conversion_report.json` of `model_dir` as a dict; a GLUE run saves only `attention_transfer.json`, which
    then stands in as the record's transfer. None when neither exists."""
    from .checkpoint_files import ATTENTION_TRANSFER_REPORT, read_conversion_report

    report = read_conversion_report(model_dir)
    path = os.path.join(model_dir, ATTENTION_TRANSFER_REPORT)
    if report is None and os.path.isfile(path):
        with open(path, encoding="utf-8") as handle:
            report = {"transfer": json.load(handle)}
    return report


def _training(report, fine_tuned):
    """What trained the converted attention, from `_conversion_record` (a dict, or None), and whether the card
    has evaluation results of a fine-tuned model."""
    tuned = "- Fine-tuned on the task of the evaluation below." if fine_tuned else ""
    if report is None:
        return tuned or "No conversion report was saved with this model: what trained it after conversion is not recorded."
    lines = []
    transfer = report.get("transfer")
    if transfer:
        line = f"- Attention transfer: {transfer['steps']} steps on {transfer['num_texts']} texts"
        if transfer.get("cosine_after") is not None:
            where = "held-out" if transfer.get("eval_held_out") else "training"
            line += (
                f"; cosine of mean-pooled embeddings to the source on {transfer['num_eval_texts']} {where} texts "
                f"{transfer['cosine_before']:.3f} -> {transfer['cosine_after']:.3f} (`attention_transfer.json`)"
            )
        lines.append(line + ".")
    if report.get("long_context"):
        lines.append(f"- Long-context recipe: {report['long_context']['steps']} steps (`conversion_report.json`).")
    if tuned:
        lines.append(tuned)
    if not lines:
        return (
            "**No attention transfer or other training ran after conversion**: the attention changed, so until this "
            "model is trained its outputs are not its source's."
        )
    return "\n".join(lines)


def _recipe(config, base_model, glue_task, report=None):
    source = base_model or "SOURCE_BERT_OR_ROBERTA"
    options = []
    for field in _convert_options():
        if field in config:
            value = config[field]
            value = str(value).lower() if isinstance(value, bool) else value
            options.append(f"--{field.replace('_', '-')} {value}")
    if report and report.get("transfer"):
        options.append(f"--attention-transfer-text TEXT --attention-transfer-steps {report['transfer']['steps']}")
    if report and report.get("long_context"):
        options.append(f"--long-context-text LONG_TEXT --long-context-steps {report['long_context']['steps']}")
    lines = [f"nprf-hf convert {source} nprf-model \\", *(f"    {o} \\" for o in options)]
    lines[-1] = lines[-1][: -len(" \\")]
    if glue_task is not None:
        lines += [
            "# then fine-tune, e.g.",
            f"python examples/run_glue.py --model_name_or_path nprf-model --task_name {glue_task} \\",
            "    --do_train --do_eval --output_dir out",
        ]
    return "\n".join(lines)


def _length_limit(config):
    if config.get("position_embedding_type", "absolute") == "none":
        return "No absolute position table (`position_embedding_type: none`): inputs of any length are accepted."
    limit = config.get("max_position_embeddings")
    if family_of(config["model_type"]).position_offset == "padding_idx" and limit is not None:
        offset = position_offset(config)
        limit = f"{limit - offset} (max_position_embeddings {limit} minus padding_idx + 1)"
    return (
        f"Inputs are limited to {limit} tokens (the absolute position table); longer inputs raise a ValueError. "
        "`nprf-hf convert --max-position-embeddings N` extends the table by tiling the learned rows (untrained "
        "beyond the source length: fine-tune on long inputs), or convert with `--position-embedding-type none`."
    )


def _untrained_head_limit(model_dir):
    """A limits line when the conversion initialised head tensors that the source lacked (conversion_report.json)."""
    from .checkpoint_files import read_conversion_report

    report = read_conversion_report(model_dir)
    if not report or not report.get("untrained_head"):
        return ""
    names = ", ".join(f"`{name}`" for name in report["untrained_head"])
    return (
        f"\n- **Untrained head:** the source ({report['source_architecture']}) had no weights for the "
        f"{report['target_class']} head; {names} were randomly initialised at conversion. Its outputs are noise "
        "until the head is trained."
    )


def _results_and_task(model_dir, config, eval_results, task_name):
    """(the evaluation results, the task name) of a card: `eval_results` (None: the folder's eval_results.json if
    there is one; False: none), and the task given, else the results', else the config's finetuning_task."""
    if eval_results is None:
        default = os.path.join(model_dir, "eval_results.json")
        eval_results = default if os.path.isfile(default) else False
    results = load_eval_results(eval_results) if eval_results is not False else {}
    if task_name is None:
        task_name = results.get("task_name") if isinstance(results.get("task_name"), str) else None
    if task_name is None:
        task_name = config.get("finetuning_task")
    return results, task_name


def build_model_card(
    model_dir,
    eval_results=None,
    base_model=None,
    datasets=None,
    task_name=None,
    model_name=None,
    repo_id=None,
    license=None,
    language=None,
    tags=None,
    eval_split=None,
    notes=None,
):
    """The huggingface_hub.ModelCard of the NPRF checkpoint in `model_dir` (see `write_model_card`)."""
    from huggingface_hub import ModelCard, ModelCardData

    config = read_nprf_config(model_dir)
    conversion_report = _conversion_record(model_dir)
    architecture, pipeline_tag, auto_class = pipeline_for(config)
    if base_model is not None and not HUB_ID.fullmatch(base_model):
        raise ValueError(f"base_model must be a Hub model id such as 'google-bert/bert-base-uncased', got {base_model!r}")
    results, task_name = _results_and_task(model_dir, config, eval_results, task_name)
    glue_task = _glue_task(task_name)
    datasets = _as_list(datasets) or ([GLUE_DATASET] if glue_task is not None else [])
    model_name = model_name or os.path.basename(os.path.normpath(model_dir))
    repo_id = repo_id or model_name

    entries = []
    if metrics_from_results(results):
        if not datasets:
            raise ValueError(
                "eval_results hold metrics but the dataset is unknown: pass datasets= (--dataset) or task_name= "
                "(--task-name, e.g. sst2)"
            )
        entries = build_eval_results(results, pipeline_tag, task_name, datasets[0], eval_split)
    family = family_of(config["model_type"]).display_name
    card_tags = [*BASE_TAGS, family.lower(), *(["glue", glue_task] if glue_task else []), *_as_list(tags)]
    data = ModelCardData(
        model_name=model_name,
        library_name="transformers",
        pipeline_tag=pipeline_tag,
        tags=list(dict.fromkeys(card_tags)),
        datasets=datasets or None,
        metrics=list(dict.fromkeys(e.metric_type for e in entries)) or None,
        base_model=base_model,
        license=license,
        language=language,
        eval_results=entries or None,
    )
    if base_model is not None:
        provenance = f"Converted from [`{base_model}`](https://huggingface.co/{base_model}) with `nprf-hf convert`."
    else:
        provenance = f"Converted from a {family} checkpoint with `nprf-hf convert`."
    settings = "\n".join(f"| `{field}` | `{config[field]}` |" for field in _setting_fields() if field in config)
    body = string.Template(CARD_TEMPLATE).substitute(
        model_name=model_name,
        family_name=f"{family} (`{architecture}`)",
        num_random_features=config.get("num_random_features"),
        feature_map=config.get("feature_map"),
        provenance=provenance,
        architecture=architecture,
        model_type=config["model_type"],
        pipeline_tag=pipeline_tag,
        task_line=f"- Task: `{task_name}`" + (f" (`{datasets[0]}`)" if datasets else "") if task_name else "",
        results=_results_table(entries) + (f"\n\n{notes.strip()}" if notes else ""),
        auto_class=auto_class,
        repo_id=repo_id,
        example_text="NPRF attention scales to long inputs.",
        settings=settings,
        recipe=_recipe(config, base_model, glue_task, conversion_report),
        training=_training(conversion_report, fine_tuned=bool(entries)),
        length_limit=_length_limit(config),
        untrained_head=_untrained_head_limit(model_dir),
        output_attentions_max_length=config.get("output_attentions_max_length"),
        feature_redraw_interval=config.get("feature_redraw_interval"),
    )
    return ModelCard(f"---\n{data.to_yaml()}\n---\n{body}")


def write_model_card(model_dir, eval_results=None, output_path=None, **kwargs):
    """Write the Hub README.md of the NPRF checkpoint in `model_dir`; returns its path.

    Args:
        model_dir: a saved NPRF model (config.json with model_type nprf_bert / nprf_roberta).
        eval_results: path to a JSON of metrics (the GLUE / MLM scripts' eval_results.json: "eval_accuracy",
            "eval_f1", "eval_matthews_correlation", "perplexity", ...) or a dict; None = MODEL_DIR/eval_results.json
            if it exists; False = none.
        output_path: default MODEL_DIR/README.md.
        kwargs: base_model (Hub id), datasets (Hub ids), task_name (GLUE task or free text; default: the
            results' "task_name" or config.finetuning_task), eval_split (default "validation"), notes
            (markdown under the results: how they were measured), model_name, repo_id (for the usage
            snippet), license, language, tags.
    """
    card = build_model_card(model_dir, eval_results=eval_results, **kwargs)
    output_path = output_path or os.path.join(model_dir, "README.md")
    card.save(output_path)
    return output_path


# ----------------------------------------------------------------------------------------------
# Hub
# ----------------------------------------------------------------------------------------------


def write_nprf_card(model_dir, model, task_name, source, main_process=True):
    """Write the NPRF model card (README.md: NPRF, `trust_remote_code=True`, settings, limits, results from
    eval_results.json) for a fine-tuned NPRF model in `model_dir`, in place of the Trainer's generic one.
    `source`: the checkpoint the run started from (recorded as `base_model` when it is a Hub id, not a local
    path). Returns False for a softmax model (the caller keeps HF's card), True otherwise."""
    if not model.config.model_type.startswith("nprf_"):
        return False
    if main_process:
        path = write_model_card(model_dir, **script_card_kwargs(model_dir, task_name, source))
        logger.info("Wrote the NPRF model card %s", path)
    return True


def script_card_kwargs(model_dir, task_name, source):
    """`write_model_card` arguments for a script's run saved in `model_dir`: the task, `source` (the checkpoint the
    run started from; None: from scratch) as `base_model` when it is a Hub id, and eval_results.json for a GLUE task only (other
    metrics name no dataset: the card then leaves them out rather than guess one)."""
    hub_id = source is not None and HUB_ID.fullmatch(source) and not looks_like_path(source)
    base_model = source if hub_id and not os.path.isdir(source) else None
    results = os.path.join(model_dir, "eval_results.json")
    eval_results = results if os.path.isfile(results) and _glue_task_or_none(task_name) else False
    return {"eval_results": eval_results, "task_name": task_name, "base_model": base_model}


def _glue_task_or_none(task_name):
    from .glue import UsageError, normalize_task_name

    try:
        return normalize_task_name(task_name) if task_name is not None else None
    except UsageError:
        return None


def push_nprf_to_hub(
    model,
    repo_id,
    tokenizer=None,
    card_kwargs=None,
    private=None,
    token=None,
    revision=None,
    create_pr=False,
    commit_message="Upload NPRF model",
):
    """Upload an NPRF model with weights, config, remote code, tokenizer and model card in one commit.

    Args:
        model: an NPRF PreTrainedModel, or the directory of a saved one (its top-level files are
            uploaded; sub-directories such as checkpoint-*/ are not). A directory is completed in place
            first (the tokenizer, if given, and the model card, README.md, replacing any other), so that
            what fails to go up stays saved: `nprf-hf push MODEL_DIR REPO_ID` pushes it later.
        tokenizer: saved next to the model when given.
        card_kwargs: `write_model_card` arguments (eval_results, base_model, datasets, task_name, ...);
            `repo_id` defaults to the target repo.
    Returns:
        huggingface_hub CommitInfo of the upload (one commit, as `model.push_to_hub` makes).
    Raises:
        `hub.PushError` (an OSError) when the Hub is unreachable, offline or refuses the credentials: one
        line saying what failed and the command that pushes the saved folder later.
    """

    def write_card(folder, full_id):
        kwargs = {"repo_id": full_id, "model_name": full_id.split("/")[-1], **(card_kwargs or {})}
        write_model_card(folder, **kwargs)

    def rewrite_card(folder):  # the Hub may complete the id (`name` -> `user/name`): the usage snippet names it
        return lambda full_id: full_id != repo_id and write_card(folder, full_id)

    hub_kwargs = dict(token=token, private=private, revision=revision, create_pr=create_pr,
                      commit_message=commit_message)
    if isinstance(model, (str, os.PathLike)):
        folder = os.fspath(model)
        read_nprf_config(folder)  # another model is refused before anything is written
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        write_card(folder, repo_id)  # first, with the id as given: the card is saved whatever the Hub answers
        return push_folder(folder, repo_id, on_repo=rewrite_card(folder), **hub_kwargs)
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        write_card(folder, repo_id)
        try:
            return push_folder(folder, repo_id, on_repo=rewrite_card(folder), **hub_kwargs)
        except PushError as error:  # the folder it names is gone with this function
            raise PushError(
                f"could not push the model to {repo_id}: {error.reason}; nothing was saved: save it with "
                f"model.save_pretrained(DIR), then run nprf-hf push DIR {repo_id}", error.reason
            ) from error.__cause__


def push_saved_model(model_dir, repo_id, card_kwargs=None, **hub_kwargs):
    """What a script's `--push_to_hub` does last, once everything is saved in `model_dir`: an NPRF model goes up with
    its NPRF model card (`push_nprf_to_hub`, the card written into `model_dir` first), any other model with the files
    already there (its README.md included). hub_kwargs: token, private, revision, create_pr, commit_message.
    Raises `hub.PushError` (one line: what failed, and `nprf-hf push MODEL_DIR REPO_ID` to push later)."""
    if _is_nprf_folder(model_dir):
        return push_nprf_to_hub(model_dir, repo_id, card_kwargs=card_kwargs, **hub_kwargs)
    return push_folder(model_dir, repo_id, **hub_kwargs)


def _is_nprf_folder(model_dir):
    try:
        read_nprf_config(model_dir)
    except ValueError:
        return False
    return True


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------
