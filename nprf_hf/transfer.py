# Copyright 2025 The nprf-hf authors. Licensed under the Apache License, Version 2.0.
"""Attention transfer: teach a converted NPRF model's attention to reproduce its softmax source.

After conversion every tensor of the source is in the NPRF model, but the attention that reads
them is new: normalized random-feature kernels and a relative bias instead of exp(q.k / sqrt(d)).
Attention transfer (in the spirit of Hedgehog, Zhang et al. ICLR 2024, and LoLCATs' attention
transfer) trains only the attention's own parameters so that, layer by layer, the NPRF
self-attention output equals the softmax one:

    loss_l = sum_valid |W_o z_l^NPRF(h_l) - W_o z_l^softmax(h_l)|^2  /  sum_valid |W_o z_l^softmax(h_l)|^2

where h_l is the *teacher's* input to layer l (so errors do not compound from layer to layer),
W_o the layer's frozen output projection and the sums run over real (not padded) tokens. The
relative form makes layers of different output scale count alike; 1.0 is the error of an
attention that outputs nothing. The training loss is the mean over layers.

By default the query/key projections, the RPE table(s) and the logit scales (when the config has
`logit_scale_max`) train; values, output projections and everything else stay bit-identical. With
`projection_learning_rate` > 0 the feature map's projection W of phi(x) = exp(W x_hat - s / 2) / sqrt(m) trains
too: a learned feature map, as Hedgehog learns its own, in place of the random draw (the kernel stays positive
and every exact algorithm and the cache still apply; it is no longer an estimate of exp(s q_hat . k_hat)).
"""

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple, Union

import torch

from .nprf_terms import ATTENTION_TERMS
from .options import PROJECTED_VARIANTS, TRANSFER_DEFAULTS


Text = Union[str, Tuple[str, str]]

# The transfer trains the query/key projections and these parameters of each self-attention (and the
# shared RPE table); with train_value_output also the value and output projections.
# The RPE tables and logit scales are biases in logit units, far from where they must go (a zero table,
# s = 1): Adam moves a parameter by about its rate per step, so they get a rate of their own.
TABLE_PARAMETERS = ("rpe_table", *(term.parameter for term in ATTENTION_TERMS))
# The feature map's projection W [H, m, d], a persistent buffer of each self-attention (a draw, not a weight,
# unless the transfer learns it); its entries are O(1), the query/key weights' O(0.05): a rate of its own.
PROJECTION = "projection"


@dataclass
class TransferReport:
    """What `attention_transfer` did: per-layer relative output error and the cosine of mean-pooled embeddings
    to the source's, before/after, on the same evaluation texts (held out from training unless too few)."""

    steps: int
    seconds: float
    num_texts: int
    trainable: List[str]
    loss_before: List[float]
    loss_after: List[float]
    history: List[Tuple[int, float]] = field(default_factory=list)
    cosine_before: Optional[float] = None  # mean cosine, student vs source mean-pooled last hidden states
    cosine_after: Optional[float] = None
    num_eval_texts: int = 0
    eval_held_out: bool = False  # True: the evaluation texts were never trained on

    def format(self) -> str:
        lines = [
            f"Attention transfer: {self.steps} steps on {self.num_texts} texts in {self.seconds:.0f} s, "
            f"{len(self.trainable)} tensors trained",
            "layer  relative error before -> after",
        ]
        for index, (before, after) in enumerate(zip(self.loss_before, self.loss_after)):
            lines.append(f"{index:>5}  {before:.4f} -> {after:.4f}")
        mean_before = sum(self.loss_before) / len(self.loss_before)
        mean_after = sum(self.loss_after) / len(self.loss_after)
        lines.append(f" mean  {mean_before:.4f} -> {mean_after:.4f}")
        if self.cosine_before is not None:
            where = "held-out" if self.eval_held_out else "training"
            lines.append(
                f"cosine to the source (mean-pooled embeddings, {self.num_eval_texts} {where} texts): "
                f"{self.cosine_before:.3f} -> {self.cosine_after:.3f}"
            )
        return "\n".join(lines)

    def to_dict(self):
        return {
            "steps": self.steps,
            "seconds": self.seconds,
            "num_texts": self.num_texts,
            "trainable": self.trainable,
            "loss_before": self.loss_before,
            "loss_after": self.loss_after,
            "history": self.history,
            "cosine_before": self.cosine_before,
            "cosine_after": self.cosine_after,
            "num_eval_texts": self.num_eval_texts,
            "eval_held_out": self.eval_held_out,
        }


def read_transfer_texts(path: str, task_name: Optional[str] = None) -> List[Text]:
    """Texts for the transfer from `path`: a plain text file (one text per non-empty line; WikiText's
    `= Heading =` lines are skipped), or a GLUE task folder / glue_data root (its train.tsv sentences,
    sentence pairs for pair tasks; the task from `task_name` or the folder's name)."""
    import os

    if os.path.isdir(path):
        from . import glue

        if task_name is None:
            task_name = os.path.basename(os.path.normpath(path))
        task_name = glue.normalize_task_name(task_name)
        files = glue.glue_dir_files(path, task_name)
        if "train" not in files:
            raise ValueError(f"{path} has no train.tsv for task {task_name}")
        return glue.training_texts(glue.read_glue_tsv(files["train"], task_name), *glue.TASK_TO_KEYS[task_name])
    if not os.path.isfile(path):
        raise ValueError(f"no such file or directory: {path} (give a plain text file or a GLUE task folder)")
    with open(path, encoding="utf-8") as handle:
        texts = [line.strip() for line in handle]
    texts = [t for t in texts if t and not (t.startswith("=") and t.endswith("="))]
    if not texts:
        raise ValueError(f"{path} holds no text")
    return texts


def _layout(model):
    from .families import ATTENTION_LAYOUTS, family_of

    return ATTENTION_LAYOUTS[family_of(model.config.model_type).layout]


def _layers(model):
    """(layer stack module, its layers) of a model of any supported family."""
    layout = _layout(model)
    encoder = getattr(model.base_model, layout.encoder)
    return encoder, list(getattr(encoder, layout.layers))


def _trainable(student, train_value_output, train_projection=False):
    """(name, tensor) of what the transfer trains: the attention's own parameters (and, with `train_projection`,
    each self-attention's projection buffer)."""
    layout = _layout(student)
    wanted = (layout.query + ".", layout.key + ".", *TABLE_PARAMETERS)
    if train_value_output:
        wanted += (layout.value + ".",)
    chosen = []
    for name, param in student.base_model.named_parameters():
        if name == f"{layout.encoder}.rpe_table":
            chosen.append((name, param))
        elif train_value_output and f".{layout.output_projection}." in name:
            chosen.append((name, param))
        elif f".{layout.self_attention}." in name:
            local = name.split(f".{layout.self_attention}.", 1)[1]
            if local.startswith(wanted):
                chosen.append((name, param))
    if train_projection:
        chosen += [(name, buffer) for name, buffer in student.base_model.named_buffers()
                   if name.endswith(f".{layout.self_attention}.{PROJECTION}")]
    return chosen


class _TeacherRecorder:
    """Forward hooks on the teacher's layers: each layer's input and its attention's output projection."""

    def __init__(self, layers, layout=None):
        from .families import ATTENTION_LAYOUTS

        layout = layout or ATTENTION_LAYOUTS["bert"]
        self.inputs = [None] * len(layers)
        self.outputs = [None] * len(layers)
        self.handles = []
        for index, layer in enumerate(layers):
            attention = layer.get_submodule(layout.self_attention)
            self.handles.append(attention.register_forward_pre_hook(self._input_hook(index), with_kwargs=True))
            projection = layer.get_submodule(layout.output_projection)
            self.handles.append(projection.register_forward_hook(self._output_hook(index)))

    def _input_hook(self, index):
        def hook(module, args, kwargs):
            self.inputs[index] = args[0] if args else kwargs["hidden_states"]

        return hook

    def _output_hook(self, index):
        def hook(module, args, output):
            self.outputs[index] = output

        return hook

    def remove(self):
        for handle in self.handles:
            handle.remove()


def _encode(tokenizer, texts, max_length, device):
    if isinstance(texts[0], (tuple, list)):
        first, second = [t[0] for t in texts], [t[1] for t in texts]
        batch = tokenizer(first, second, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    else:
        batch = tokenizer(list(texts), padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    keep = ("input_ids", "attention_mask", "token_type_ids")
    return {k: v.to(device) for k, v in batch.items() if k in keep}


def _layer_errors(student_layers, student_encoder, recorder, mask, segment_ids=None, token_ids=None, layout=None):
    """[L] relative squared error of each student layer's attention output (teacher inputs), real tokens only."""
    from .families import ATTENTION_LAYOUTS

    layout = layout or ATTENTION_LAYOUTS["bert"]
    weight = mask.to(recorder.outputs[0].dtype)[..., None]
    shared_table = getattr(student_encoder, "rpe_table", None)
    errors = []
    for layer, hidden, target in zip(student_layers, recorder.inputs, recorder.outputs):
        output, _ = layer.get_submodule(layout.self_attention)(
            hidden, attention_mask=mask, rpe_table=shared_table, segment_ids=segment_ids, token_ids=token_ids
        )
        if layout.output is None:  # the layer, not the self-attention, applies the output projection
            output = layer.get_submodule(layout.output_projection)(output)
        numerator = ((output - target).square() * weight).sum()
        denominator = (target.square() * weight).sum().clamp_min(1e-12)
        errors.append(numerator / denominator)
    return torch.stack(errors)


def adam_with_cosine_decay(trainable, steps, learning_rate, table_learning_rate, projection_learning_rate=0.0):
    """(Adam, LambdaLR) for (name, parameter) pairs: `table_learning_rate` for the TABLE_PARAMETERS,
    `projection_learning_rate` for feature-map projections, `learning_rate` for the rest, all decayed to a tenth
    along a cosine over `steps`."""
    tables = [p for name, p in trainable if name.endswith(TABLE_PARAMETERS)]
    projections = [p for name, p in trainable if name.endswith("." + PROJECTION)]
    weights = [p for name, p in trainable if not name.endswith((*TABLE_PARAMETERS, "." + PROJECTION))]
    groups = [{"params": weights, "lr": learning_rate}, {"params": tables, "lr": table_learning_rate},
              {"params": projections, "lr": projection_learning_rate}]
    optimizer = torch.optim.Adam([g for g in groups if g["params"]])
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.1 + 0.45 * (1 + math.cos(math.pi * min(step / steps, 1.0)))
    )
    return optimizer, schedule


def shuffled_cycle(items, generator):
    """A function k -> the next k of `items` in a seeded random order, drawn afresh at every pass over them (the
    first order is drawn now, so the generator's draws happen where an inline loop would make them)."""
    state = {"order": torch.randperm(len(items), generator=generator).tolist(), "position": 0}

    def take(count):
        chosen = []
        while len(chosen) < count:
            if state["position"] == len(state["order"]):
                state["order"], state["position"] = torch.randperm(len(items), generator=generator).tolist(), 0
            chosen.append(items[state["order"][state["position"]]])
            state["position"] += 1
        return chosen

    return take


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, n, h] hidden states, [B, n] mask (1 = real token) -> [B, h] L2-normalized mean over real tokens."""
    weight = mask.to(hidden.dtype)[..., None]
    pooled = (hidden * weight).sum(1) / weight.sum(1).clamp_min(1.0)
    return torch.nn.functional.normalize(pooled, dim=-1)


def _check_pair(student, teacher):
    student_config, teacher_config = student.config, teacher.config
    if not student_config.model_type.startswith("nprf_"):
        raise ValueError(f"the student must be an NPRF model (convert_to_nprf), got model_type {student_config.model_type!r}")
    if teacher_config.model_type.startswith("nprf_"):
        raise ValueError("the teacher must be the softmax source model, not an NPRF model")
    for name in ("num_hidden_layers", "hidden_size", "num_attention_heads", "is_decoder"):
        if getattr(student_config, name, None) != getattr(teacher_config, name, None):
            raise ValueError(
                f"student and teacher differ in {name} ({getattr(student_config, name)} vs "
                f"{getattr(teacher_config, name)}): the student must be the teacher's conversion"
            )


@dataclass
class TransferArguments:
    """The options of `attention_transfer` (defaults: `options.TRANSFER_DEFAULTS`).

    steps, batch_size, max_length: optimisation steps, texts per step, tokens per text (truncated; padded per batch,
        padded tokens never count).
    learning_rate: Adam's rate of the projections, decayed to a tenth along a cosine.
    table_learning_rate: Adam's rate of the RPE table(s) and logit scales (same schedule).
    seed: the order of the texts (the run is deterministic for a seed on one device).
    projection_learning_rate: Adam's rate of each layer's feature-map projection (same schedule); > 0 learns the
        feature map (module docstring), 0 keeps the random draw bit-identical. Needs `feature_redraw_interval=0`
        (a redraw in training would discard what was learned).
    train_value_output: also train the value and output projections (off: they stay bit-identical).
    eval_texts: texts for the before/after report (default: the last `eval_batches` batches of `texts`, held out
        from training, or, with fewer than 5 such batches of texts, the first ones).
    """

    steps: int = TRANSFER_DEFAULTS["steps"]
    batch_size: int = TRANSFER_DEFAULTS["batch_size"]
    max_length: int = TRANSFER_DEFAULTS["max_length"]
    learning_rate: float = TRANSFER_DEFAULTS["learning_rate"]
    table_learning_rate: float = TRANSFER_DEFAULTS["table_learning_rate"]
    seed: int = TRANSFER_DEFAULTS["seed"]
    projection_learning_rate: float = TRANSFER_DEFAULTS["projection_learning_rate"]
    train_value_output: bool = False
    eval_texts: Optional[Sequence[Text]] = None
    eval_batches: int = 4
    show_progress: bool = True

    def check(self, student):
        """A ValueError naming what cannot run on `student`."""
        if (self.steps < 0 or self.batch_size < 1 or self.max_length < 2 or not self.learning_rate > 0
                or not self.table_learning_rate > 0 or not self.projection_learning_rate >= 0):
            raise ValueError(
                "need steps >= 0, batch_size >= 1, max_length >= 2, learning rates > 0 and projection_learning_rate "
                f">= 0; got steps={self.steps}, batch_size={self.batch_size}, max_length={self.max_length}, "
                f"learning_rate={self.learning_rate}, table_learning_rate={self.table_learning_rate}, "
                f"projection_learning_rate={self.projection_learning_rate}"
            )
        if not self.projection_learning_rate > 0:
            return
        variant = getattr(student.config, "attention_variant", "nprf")
        if variant not in PROJECTED_VARIANTS:
            raise ValueError(
                f"projection_learning_rate={self.projection_learning_rate} learns the feature map's projection, but "
                f"attention_variant={variant!r} has none (those with one: {', '.join(PROJECTED_VARIANTS)}): "
                "keep projection_learning_rate=0"
            )
        if getattr(student.config, "feature_redraw_interval", 0) > 0:
            raise ValueError(
                f"projection_learning_rate={self.projection_learning_rate} learns the feature map, but the student "
                f"redraws its projection every {student.config.feature_redraw_interval} training steps "
                "(feature_redraw_interval), which would discard it: convert with feature_redraw_interval=0 "
                "(--feature-redraw-interval 0), or keep projection_learning_rate=0"
            )

    def split_texts(self, texts):
        """(training texts, evaluation texts, whether those are held out from training)."""
        span = self.batch_size * self.eval_batches
        held_out = self.eval_texts is None and len(texts) >= 5 * span
        if self.eval_texts is not None:
            eval_pool = list(self.eval_texts)
        elif held_out:  # the faithfulness a user sees is on text the transfer never trained on
            eval_pool, texts = texts[-span:], texts[:-span]
        else:
            eval_pool = texts[:span]
        if not eval_pool:
            raise ValueError("eval_texts is empty: give texts for the before/after report, or leave it None")
        return texts, eval_pool, held_out


def _check_positions(config, max_length):
    """max_length within the source's absolute positions (less RoBERTa's offset)."""
    if getattr(config, "position_embedding_type", "absolute") == "absolute":
        from .families import position_offset

        offset = position_offset(config)
        if max_length > config.max_position_embeddings - offset:
            raise ValueError(
                f"max_length={max_length} exceeds the source's {config.max_position_embeddings - offset} positions: "
                "lower max_length"
            )


@contextlib.contextmanager
def training_only(student, trainable, teacher=None, device=None):
    """While active: `student` in eval mode (no dropout, no projection redraw) with only `trainable`'s
    (name, tensor) pairs requiring gradients, and `teacher` in eval mode on `device`; all restored after."""
    student_was_training = student.training
    if teacher is not None:
        teacher_was_training, teacher_device = teacher.training, next(teacher.parameters()).device
        teacher.to(device).eval()
    student.eval()
    flags = {tensor: tensor.requires_grad for tensor in (*student.parameters(), *student.buffers())}
    for param in student.parameters():
        param.requires_grad_(False)
    for _, param in trainable:
        param.requires_grad_(True)
    try:
        yield
    finally:
        for param, flag in flags.items():
            param.requires_grad_(flag)
        student.train(student_was_training)
        if teacher is not None:
            teacher.to(teacher_device).train(teacher_was_training)


class _LayerMatching:
    """The per-layer relative errors of `student`'s self-attention outputs against `teacher`'s softmax ones, on
    the teacher's own layer inputs (recorded by hooks on the teacher's layers until `remove`)."""

    def __init__(self, student, teacher, tokenizer, max_length, device):
        self.student, self.teacher_base = student, teacher.base_model
        self.tokenizer, self.max_length, self.device = tokenizer, max_length, device
        self.student_encoder, self.student_layers = _layers(student)
        self.student_layout = _layout(student)
        self.recorder = _TeacherRecorder(_layers(teacher)[1], _layout(teacher))

    def remove(self):
        self.recorder.remove()

    def encode(self, texts):
        return _encode(self.tokenizer, texts, self.max_length, self.device)

    def teacher_pass(self, batch):
        """(mask [B, L] bool, the teacher's last hidden states [B, L, hidden]); records its layer inputs."""
        with torch.no_grad():
            teacher_output = self.teacher_base(**batch)
        return batch["attention_mask"].bool(), teacher_output.last_hidden_state

    def errors(self, batch, mask):
        """[num_layers] relative errors of the batch the teacher last saw."""
        from .modeling_nprf import term_inputs

        inputs = term_inputs(self.student.config, batch["input_ids"], batch.get("token_type_ids"))
        return _layer_errors(self.student_layers, self.student_encoder, self.recorder, mask, **inputs,
                             layout=self.student_layout)

    def evaluate(self, eval_sets):
        """(per-layer mean errors, mean cosine of mean-pooled embeddings to the teacher's) over `eval_sets`."""
        total, cosine, count = None, 0.0, 0
        with torch.no_grad():
            for chunk in eval_sets:
                batch = self.encode(chunk)
                mask, teacher_hidden = self.teacher_pass(batch)
                errors = self.errors(batch, mask) * len(chunk)
                total = errors if total is None else total + errors
                student_hidden = self.student.base_model(**batch).last_hidden_state
                cosine += float((mean_pool(student_hidden, mask) * mean_pool(teacher_hidden, mask)).sum())
                count += len(chunk)
        return [float(e) for e in total / count], cosine / count

    def train(self, trainable, texts, arguments):
        """`arguments.steps` Adam steps on the mean layer error; returns the history [(step, loss)]."""
        history = []
        optimizer, schedule = adam_with_cosine_decay(
            trainable, arguments.steps, arguments.learning_rate, arguments.table_learning_rate,
            arguments.projection_learning_rate,
        )
        take = shuffled_cycle(texts, torch.Generator().manual_seed(arguments.seed))
        progress = _progress(arguments.steps, arguments.show_progress)
        for step in range(1, arguments.steps + 1):
            batch = self.encode(take(arguments.batch_size))
            mask, _ = self.teacher_pass(batch)
            loss = self.errors(batch, mask).mean()
            if not torch.isfinite(loss):
                raise ValueError(
                    f"attention transfer diverged at step {step} (loss {float(loss)}): lower the learning rates"
                )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            history.append((step, loss.item()))
            progress.set_postfix(loss=f"{history[-1][1]:.4f}")
            progress.update(1)
        progress.close()
        return history


def attention_transfer(
    student,
    teacher,
    tokenizer,
    texts: Sequence[Text],
    arguments: Optional[TransferArguments] = None,
    **options,
) -> TransferReport:
    """Train `student`'s attention so that each layer's NPRF self-attention reproduces `teacher`'s
    softmax self-attention on the teacher's own layer inputs (module docstring). In place.

    Args:
        student: an NPRF model (any head) converted from `teacher`.
        teacher: the softmax source (any supported family, any head); not changed.
        tokenizer: the source's tokenizer.
        texts: unlabeled texts, strings or (first, second) pairs (pairs are encoded as one input with
            token types, as a cross-encoder sees them). Cycled in a seeded random order.
        arguments: a `TransferArguments` (None: its defaults); `options`, its fields by name (`steps=100`, ...),
            override it.
    Returns:
        A `TransferReport` (per-layer relative errors and cosine of mean-pooled embeddings to the source's,
        before and after; loss history; time).
    """
    arguments = dataclasses.replace(arguments or TransferArguments(), **options)
    arguments.check(student)
    texts = list(texts)
    if not texts:
        raise ValueError("attention transfer needs at least one text")
    _check_pair(student, teacher)
    texts, eval_pool, held_out = arguments.split_texts(texts)
    _check_positions(teacher.config, arguments.max_length)
    device = next(student.parameters()).device
    trainable = _trainable(student, arguments.train_value_output, arguments.projection_learning_rate > 0)
    batch_size = arguments.batch_size
    eval_sets = [eval_pool[i : i + batch_size] for i in range(0, len(eval_pool), batch_size)]
    history = []
    with training_only(student, trainable, teacher.base_model, device):
        matching = _LayerMatching(student, teacher, tokenizer, arguments.max_length, device)
        start = time.perf_counter()
        try:
            loss_before, cosine_before = matching.evaluate(eval_sets)
            if arguments.steps > 0:
                history = matching.train(trainable, texts, arguments)
            loss_after, cosine_after = matching.evaluate(eval_sets)
        finally:
            matching.remove()
    return TransferReport(
        steps=arguments.steps,
        seconds=time.perf_counter() - start,
        num_texts=len(texts),
        trainable=[name for name, _ in trainable],
        loss_before=loss_before,
        loss_after=loss_after,
        history=history,
        cosine_before=cosine_before,
        cosine_after=cosine_after,
        num_eval_texts=len(eval_pool),
        eval_held_out=held_out,
    )


def _progress(total, enabled, desc="attention transfer"):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is an optional dependency; no bar then

        class _Silent:
            def set_postfix(self, **kwargs):
                pass

            def update(self, n):
                pass

            def close(self):
                pass

        return _Silent()
    return tqdm(total=total, desc=desc, disable=not enabled, leave=False)


__all__ = ["TRANSFER_DEFAULTS", "TransferArguments", "TransferReport", "attention_transfer", "read_transfer_texts"]
