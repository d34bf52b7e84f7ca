# Copyright 2025 The nprf-hf authors. Licensed under the Apache License, Version 2.0.
"""Long documents in one pass: the chunk-and-pool baseline, and the long-context recipe that teaches a
converted NPRF encoder to embed a whole document as well as its softmax source embeds it window by window.

Embeddings are the sentence-transformers ones of the BERT-family embedders (all-MiniLM, ...): the mean of
the last hidden states over real tokens, L2-normalized.

* **chunk-and-pool** (`chunk_and_pool`): what a long-document user of a softmax embedder runs today. The
  document's tokens are cut into windows of `window` tokens (each wrapped in the model's special tokens,
  consecutive windows sharing `overlap` tokens); each window is embedded; the document embedding is the
  mean of the window embeddings weighted by their token counts, L2-normalized.
* **whole document** (`embed_documents`): one forward pass over the whole document.
* **the long-context recipe** (`long_context_distillation`): trains the NPRF student so that

      loss = mean(1 - cos(student(document), teacher chunk-and-pool(document)))      # long: the whole document
           + mean(1 - cos(student(passage), teacher(passage)))                        # short: stays faithful
           + mean(1 - cos(student(text), teacher(text)))                              # short texts
           + contrastive_weight * InfoNCE(student(passage) -> student(document))     # passage/document pairs
           + token_weight * mean_t(1 - cos(student_t(document), teacher_t(its window)))  # every token's state

  on random spans of unlabeled long text (documents of `document_length` tokens, `passages_per_document`
  passages of `passage_length` tokens cut out of each); the InfoNCE term uses the other documents of the
  batch as negatives (temperature `temperature`) and, with `negatives` > 0, a memory of that many more: the
  student's own embeddings of the documents of earlier steps, detached (cross-batch memory, Wang et al., CVPR
  2020; filled at the start with disjoint spans of the text), each left out of a passage's candidates while it
  overlaps that passage's document. A batch of 2-4 long documents alone gives each passage one to three easy
  negatives; negatives in the teacher's space instead (its chunk-and-pool embeddings) let the student win the
  term by leaving that space. Only the parameters of `train` change (`LONG_CONTEXT_TRAIN`):
  "attention" = what attention transfer trains (query/key projections, RPE tables, logit scales);
  "encoder" = every parameter of the layer stack (embeddings and heads stay bit-identical).
  The token term compares each token's last hidden state in the whole document with the teacher's state of the
  same token inside its chunk-and-pool window (`chunk_token_states`): one target per token instead of one per
  document, the signal attention transfer uses, here at the length the student will run at.
"""

import dataclasses
import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch
from torch.nn import functional as F

from .options import LONG_CONTEXT_DEFAULTS, LONG_CONTEXT_TRAIN
from .transfer import mean_pool  # the pooling the transfer's faithfulness report uses too


# ---------------------------------------------------------------------------------------------
# Embedding: whole document and chunk-and-pool
# ---------------------------------------------------------------------------------------------


def _special_tokens(tokenizer):
    """(prefix, suffix) ids the tokenizer wraps one sequence in ([CLS] ... [SEP], <s> ... </s>)."""
    content = tokenizer("hello", add_special_tokens=False)["input_ids"]
    wrapped = tokenizer("hello", add_special_tokens=True)["input_ids"]
    for at in range(len(wrapped) - len(content) + 1):
        if wrapped[at : at + len(content)] == content:
            return wrapped[:at], wrapped[at + len(content) :]
    raise ValueError(f"cannot find how {type(tokenizer).__name__} adds its special tokens")


def content_length(tokenizer, max_length: int) -> int:
    """How many content tokens fit in `max_length` positions with the special tokens."""
    prefix, suffix = _special_tokens(tokenizer)
    return max_length - len(prefix) - len(suffix)


def _batch(tokenizer, sequences: Sequence[Sequence[int]], device):
    """Content token ids per sequence -> (input_ids, attention_mask) [B, n] with special tokens, right-padded."""
    prefix, suffix = _special_tokens(tokenizer)
    rows = [prefix + list(ids) + suffix for ids in sequences]
    width = max(len(row) for row in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        input_ids[index, : len(row)] = torch.tensor(row, dtype=torch.long)
        attention_mask[index, : len(row)] = 1
    return input_ids.to(device), attention_mask.to(device)


def _hidden_states(model, tokenizer, sequences: Sequence[Sequence[int]]):
    """Content token id sequences -> (last hidden states [B, n, h], attention_mask [B, n]), special tokens
    added, one padded batch through `model.base_model`, under the caller's grad mode."""
    input_ids, attention_mask = _batch(tokenizer, sequences, next(model.parameters()).device)
    # no mask when nothing is padded (one document, equal windows): attention then skips every mask pass
    mask = None if bool(attention_mask.all()) else attention_mask
    return model.base_model(input_ids=input_ids, attention_mask=mask).last_hidden_state, attention_mask


def encode_token_ids(model, tokenizer, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
    """[B, h] normalized mean-pooled embeddings of content token id sequences (special tokens added), one
    padded batch through `model.base_model`. Runs under the caller's grad mode."""
    return mean_pool(*_hidden_states(model, tokenizer, sequences))


def windows(ids: Sequence[int], window: int, overlap: int = 0) -> List[List[int]]:
    """Consecutive windows of at most `window` tokens, each starting `window - overlap` after the last; the
    last window ends at the document's end (a document of <= `window` tokens is one window)."""
    if window < 1 or not 0 <= overlap < window:
        raise ValueError(f"need window >= 1 and 0 <= overlap < window; got window={window}, overlap={overlap}")
    ids = list(ids)
    if len(ids) <= window:
        return [ids]
    stride = window - overlap
    starts = list(range(0, len(ids) - overlap, stride))
    return [ids[start : start + window] for start in starts if start < len(ids)]


MAX_WINDOWS_PER_BATCH = 16  # windows per padded forward: bounds the batch's memory at long documents


def _chunk_pass(model, tokenizer, ids: Sequence[int], window: int, overlap: int, max_windows_per_batch: int,
                token_states: bool):
    """One pass over a document's windows -> ([h] chunk-and-pool embedding, [n, h] content token states or None)."""
    parts = windows(ids, window, overlap)
    prefix = len(_special_tokens(tokenizer)[0])
    vectors, states, farthest, start = [], None, None, 0
    for first in range(0, len(parts), max_windows_per_batch):
        batch = parts[first : first + max_windows_per_batch]
        hidden, attention_mask = _hidden_states(model, tokenizer, batch)
        vectors.append(mean_pool(hidden, attention_mask))
        if not token_states:
            continue
        if states is None:
            states = hidden.new_zeros(len(ids), hidden.shape[-1])
            farthest = torch.full((len(ids),), -1, dtype=torch.long, device=hidden.device)
        for index, part in enumerate(batch):
            position = torch.arange(start, start + len(part), device=hidden.device)
            local = position - start
            margin = torch.minimum(local, len(part) - 1 - local)
            take = margin > farthest[position]
            states[position[take]] = hidden[index, prefix : prefix + len(part)][take]
            farthest[position[take]] = margin[take]
            start += len(part) - overlap
    vectors = torch.cat(vectors)
    counts = torch.tensor([len(p) for p in parts], dtype=vectors.dtype, device=vectors.device)
    return F.normalize((vectors * counts[:, None]).sum(0), dim=-1), states


def chunk_and_pool(model, tokenizer, documents: Sequence[Sequence[int]], window: int, overlap: int = 0,
                   max_windows_per_batch: int = MAX_WINDOWS_PER_BATCH) -> torch.Tensor:
    """[D, h] chunk-and-pool embeddings of `documents` (content token ids): windows of `window` content
    tokens (`overlap` shared), embedded in batches, averaged weighted by token count, normalized."""
    return torch.stack([_chunk_pass(model, tokenizer, ids, window, overlap, max_windows_per_batch, False)[0]
                        for ids in documents])


def chunk_token_states(model, tokenizer, ids: Sequence[int], window: int, overlap: int = 0,
                       max_windows_per_batch: int = MAX_WINDOWS_PER_BATCH) -> torch.Tensor:
    """[n, h] last hidden state of each content token of one document as `model` sees it inside its
    chunk-and-pool window; with overlap, from the window where the token lies farthest from an edge."""
    return _chunk_pass(model, tokenizer, ids, window, overlap, max_windows_per_batch, True)[1]


def document_states(model, tokenizer, ids: Sequence[int]):
    """One whole-document forward pass -> ([h] embedding as `embed_documents`, [n, h] content token states)."""
    hidden, attention_mask = _hidden_states(model, tokenizer, [ids])
    prefix = len(_special_tokens(tokenizer)[0])
    return mean_pool(hidden, attention_mask)[0], hidden[0, prefix : prefix + len(ids)]


def embed_documents(model, tokenizer, documents: Sequence[Sequence[int]]) -> torch.Tensor:
    """[D, h] whole-document embeddings, one document per forward pass (no padding work)."""
    return torch.cat([encode_token_ids(model, tokenizer, [ids]) for ids in documents])


# ---------------------------------------------------------------------------------------------
# Unlabeled long text
# ---------------------------------------------------------------------------------------------


def read_long_text(path: str) -> List[str]:
    """Documents of a plain text file: a WikiText file splits at its article headings (` = Title = `);
    any other file is one document per block of lines separated by blank lines."""
    import os
    import re

    if not os.path.isfile(path):
        raise ValueError(f"no such file: {path} (give a plain text file of long documents, e.g. WikiText)")
    with open(path, encoding="utf-8") as handle:
        lines = handle.read().splitlines()
    title = re.compile(r"^ ?= [^=].* = ?$")
    documents, current = [], []
    if any(title.match(line) for line in lines):
        for line in lines:
            if title.match(line) and current:
                documents.append(current)
                current = []
            elif line.strip() and not line.strip().startswith("="):
                current.append(line.strip())
    else:
        for line in lines + [""]:
            if line.strip():
                current.append(line.strip())
            elif current:
                documents.append(current)
                current = []
    if current:
        documents.append(current)
    documents = [" ".join(doc) for doc in documents if doc]
    if not documents:
        raise ValueError(f"{path} holds no text")
    return documents


def token_stream(tokenizer, documents: Sequence[str]) -> List[int]:
    """All documents' content tokens, one after another (no special tokens)."""
    stream = []
    for text in documents:
        stream.extend(tokenizer(text, add_special_tokens=False, truncation=False)["input_ids"])
    return stream


def _span_starts(stream: Sequence[int], count: int, length: int, generator: torch.Generator) -> List[int]:
    if len(stream) < length:
        raise ValueError(f"the long text has {len(stream)} tokens, fewer than document_length={length}: give more text")
    return torch.randint(0, len(stream) - length + 1, (count,), generator=generator).tolist()


def sample_documents(stream: Sequence[int], count: int, length: int, generator: torch.Generator) -> List[List[int]]:
    """`count` random spans of `length` tokens of `stream` (spans may cross document boundaries, as long
    inputs made of concatenated articles do)."""
    return [list(stream[s : s + length]) for s in _span_starts(stream, count, length, generator)]


def disjoint_span_starts(stream_length: int, count: int, length: int, generator: torch.Generator) -> List[int]:
    """Starts of up to `count` disjoint spans of `length` tokens tiling the stream (a random choice of the
    tiles when there are more), sorted: the documents that first fill the contrastive term's memory."""
    tiles = list(range(0, stream_length - length + 1, length))
    chosen = torch.randperm(len(tiles), generator=generator)[:count].sort().values.tolist()
    return [tiles[i] for i in chosen]


def sample_passages(documents: Sequence[Sequence[int]], per_document: int, length: int,
                    generator: torch.Generator) -> List[List[int]]:
    """`per_document` random spans of `length` tokens from each document, document by document."""
    passages = []
    for ids in documents:
        top = max(len(ids) - length, 0)
        for start in torch.randint(0, top + 1, (per_document,), generator=generator).tolist():
            passages.append(list(ids[start : start + length]))
    return passages


def contrastive_logits(passages: torch.Tensor, documents: torch.Tensor, temperature: float,
                       memory: Optional[torch.Tensor] = None, memory_starts: Sequence[int] = (),
                       document_starts: Sequence[int] = (), length: int = 0) -> torch.Tensor:
    """InfoNCE logits [P, D (+ K)] of passages [P, h] (P = D x passages per document, document by document)
    against the batch's documents [D, h], then the memory's documents [K, h]: a memory span of `length` tokens
    starting at `memory_starts[k]` is no negative of a passage whose document (`document_starts`, spans of the
    same stream and length) it overlaps, so its logit is -inf there."""
    logits = passages @ documents.T / temperature
    if memory is None:
        return logits
    per_document = passages.shape[0] // documents.shape[0]
    starts = torch.tensor(document_starts, device=passages.device).repeat_interleave(per_document)
    overlaps = (torch.tensor(memory_starts, device=passages.device)[None, :] - starts[:, None]).abs() < length
    return torch.cat([logits, (passages @ memory.T / temperature).masked_fill(overlaps, float("-inf"))], dim=1)


def push_memory(memory: torch.Tensor, memory_starts: Sequence[int], documents: torch.Tensor,
                document_starts: Sequence[int]):
    """First in, first out: ([K, h] memory, its K span starts) with the step's documents [D, h] (detached)
    and their starts appended and the D oldest dropped."""
    size = len(memory_starts)
    return (torch.cat([memory, documents.detach()])[-size:],
            (list(memory_starts) + list(document_starts))[-size:])


# ---------------------------------------------------------------------------------------------
# The recipe
# ---------------------------------------------------------------------------------------------


@dataclass
class LongContextReport:
    """What `long_context_distillation` did: cosines to the teacher before/after on held-out spans."""

    steps: int
    seconds: float
    trainable: List[str]
    before: dict
    after: dict
    history: List[dict] = field(default_factory=list)

    def format(self) -> str:
        lines = [f"Long-context recipe: {self.steps} steps in {self.seconds:.0f} s, {len(self.trainable)} tensors trained",
                 "held-out cosine to the teacher   before -> after"]
        for key in self.before:
            lines.append(f"  {key:<30} {self.before[key]:.4f} -> {self.after[key]:.4f}")
        return "\n".join(lines)

    def to_dict(self):
        return {"steps": self.steps, "seconds": self.seconds, "trainable": self.trainable, "before": self.before,
                "after": self.after, "history": self.history}


def long_context_trainable(student, train: str):
    """(name, parameter) pairs the recipe trains for `train` (one of `LONG_CONTEXT_TRAIN`)."""
    from .transfer import _layers, _trainable

    if train not in LONG_CONTEXT_TRAIN:
        raise ValueError(f"train='{train}' is not supported; allowed: {', '.join(LONG_CONTEXT_TRAIN)}")
    if train == "attention":
        return _trainable(student, train_value_output=False)
    encoder, _ = _layers(student)
    prefix = next(name for name, module in student.base_model.named_modules() if module is encoder)
    return [(name, p) for name, p in student.base_model.named_parameters() if name.startswith(prefix + ".")]


def teacher_window(teacher, tokenizer) -> int:
    """The longest chunk-and-pool window of `teacher`: its position limit less the special tokens."""
    from .families import position_offset

    return content_length(tokenizer, teacher.config.max_position_embeddings - position_offset(teacher.config))


def _check_lengths(student, teacher, tokenizer, document_length, window):
    from .families import position_offset

    if teacher_window(teacher, tokenizer) < window:
        raise ValueError(
            f"window={window} content tokens do not fit the teacher's positions with its special tokens: use "
            f"window <= {teacher_window(teacher, tokenizer)}"
        )
    config = student.config
    if getattr(config, "position_embedding_type", "absolute") == "absolute":
        limit = content_length(tokenizer, config.max_position_embeddings - position_offset(config))
        if document_length > limit:
            raise ValueError(
                f"document_length={document_length} exceeds the student's {limit} content positions: convert with "
                f"--max-position-embeddings >= {document_length + 2} (or position_embedding_type='none')"
            )


@dataclass
class LongContextArguments:
    """The options of `long_context_distillation` (defaults: `options.LONG_CONTEXT_DEFAULTS`).

    short_texts: short texts kept faithful (default: the documents' sentences, cut at 128 tokens).
    steps, batch_size: optimisation steps, documents per step.
    document_length, passage_length, passages_per_document: tokens per document and passage.
    short_batch_size: short texts per step (0 = none).
    window, overlap: the teacher's chunk-and-pool windows (content tokens; window None = all the teacher's
        positions, 510 for BERT and RoBERTa).
    contrastive_weight, temperature: weight and temperature of the passage -> document InfoNCE term.
    negatives: size of the contrastive term's memory of earlier documents (0 = the batch's only).
    token_weight: weight of the per-token term (0 = off; the teacher then runs only its pooled windows).
    learning_rate: Adam's rate of the weights; table_learning_rate: of the RPE tables and logit scales
        (both decayed to a tenth along a cosine).
    train: which parameters train, one of `LONG_CONTEXT_TRAIN`; everything else stays bit-identical.
    seed: the spans, passages and text order (deterministic for a seed on one device).
    eval_documents: held-out spans (drawn first, with their own generator) for the before/after report.
    """

    short_texts: Optional[Sequence[str]] = None
    steps: int = LONG_CONTEXT_DEFAULTS["steps"]
    batch_size: int = LONG_CONTEXT_DEFAULTS["batch_size"]
    document_length: int = LONG_CONTEXT_DEFAULTS["document_length"]
    passage_length: int = LONG_CONTEXT_DEFAULTS["passage_length"]
    passages_per_document: int = LONG_CONTEXT_DEFAULTS["passages_per_document"]
    short_batch_size: int = LONG_CONTEXT_DEFAULTS["short_batch_size"]
    window: Optional[int] = LONG_CONTEXT_DEFAULTS["window"]
    overlap: int = LONG_CONTEXT_DEFAULTS["overlap"]
    contrastive_weight: float = LONG_CONTEXT_DEFAULTS["contrastive_weight"]
    token_weight: float = LONG_CONTEXT_DEFAULTS["token_weight"]
    temperature: float = LONG_CONTEXT_DEFAULTS["temperature"]
    negatives: int = LONG_CONTEXT_DEFAULTS["negatives"]
    learning_rate: float = LONG_CONTEXT_DEFAULTS["learning_rate"]
    table_learning_rate: float = LONG_CONTEXT_DEFAULTS["table_learning_rate"]
    train: str = LONG_CONTEXT_DEFAULTS["train"]
    seed: int = LONG_CONTEXT_DEFAULTS["seed"]
    eval_documents: int = 4
    show_progress: bool = True

    def check(self):
        """A ValueError naming the first option out of range."""
        if self.train not in LONG_CONTEXT_TRAIN:
            raise ValueError(f"train='{self.train}' is not supported; allowed: {', '.join(LONG_CONTEXT_TRAIN)}")
        if (self.steps < 0 or self.batch_size < 1 or self.passage_length < 1 or self.passages_per_document < 1
                or self.short_batch_size < 0 or self.negatives < 0):
            raise ValueError("need steps >= 0, batch_size >= 1, passage_length >= 1, passages_per_document >= 1, "
                             "short_batch_size >= 0, negatives >= 0")
        if self.document_length <= self.passage_length:
            raise ValueError(
                f"document_length={self.document_length} must exceed passage_length={self.passage_length}"
            )
        if not (self.learning_rate > 0 and self.table_learning_rate > 0 and self.temperature > 0
                and self.contrastive_weight >= 0 and self.token_weight >= 0):
            raise ValueError("learning rates and temperature must be > 0, contrastive_weight and token_weight >= 0")

    @property
    def contrastive(self):
        """Whether the passage -> document term has negatives to contrast with."""
        return self.contrastive_weight > 0 and (self.batch_size > 1 or self.negatives > 0)


def _token_cosine(student_tokens, teacher_tokens):
    """[documents] mean cosine of each document's token states to the teacher's."""
    return torch.stack([F.cosine_similarity(s, t, dim=-1).mean() for s, t in zip(student_tokens, teacher_tokens)])


class _DocumentMatching:
    """The recipe's terms: the student's whole-document embeddings against the teacher's chunk-and-pool (and,
    with `token_weight`, its tokens' states against the teacher's windows'), its passage and short-text embeddings
    against the teacher's, and the passage -> document contrastive term with its memory of negatives."""

    def __init__(self, student, teacher, tokenizer, stream, window, arguments):
        self.student, self.teacher, self.tokenizer = student, teacher, tokenizer
        self.stream, self.window, self.arguments = stream, window, arguments
        self.device = next(student.parameters()).device
        self.max_short = min(126, window)  # content tokens of a short text: at most a sentence, within the teacher's reach
        self.memory, self.memory_starts = None, ()  # the contrastive term's extra negatives, if any

    def short_ids(self, texts):
        return [self.tokenizer(t, add_special_tokens=False, truncation=True, max_length=self.max_short)["input_ids"]
                for t in texts]

    def teacher_targets(self, docs, passages, shorts, tokens=False):
        """(pooled documents [N, hidden], passages, short texts or None, each document's token states or None)."""
        teacher, tokenizer = self.teacher, self.tokenizer
        with torch.no_grad():
            # one pass over each document's windows gives both its pooled target and its tokens' targets
            pooled, states = zip(*[_chunk_pass(teacher, tokenizer, ids, self.window, self.arguments.overlap,
                                               MAX_WINDOWS_PER_BATCH, tokens) for ids in docs])
            return (torch.stack(pooled),
                    encode_token_ids(teacher, tokenizer, passages),
                    encode_token_ids(teacher, tokenizer, shorts) if shorts else None,
                    list(states) if tokens else None)

    def fill_memory(self):
        """The contrastive term's memory: `negatives` disjoint document spans, embedded by the student."""
        length = self.arguments.document_length
        # its own generator: the training spans stay those of a run without the memory
        generator = torch.Generator().manual_seed(self.arguments.seed + 2_000_003)
        self.memory_starts = disjoint_span_starts(len(self.stream), self.arguments.negatives, length, generator)
        with torch.no_grad():
            spans = [self.stream[s : s + length] for s in self.memory_starts]
            self.memory = embed_documents(self.student, self.tokenizer, spans)

    def evaluate(self, docs, passages, short_texts):
        """{what: mean cosine to the teacher} on held-out documents, passages and short texts."""
        student, tokenizer = self.student, self.tokenizer
        shorts = self.short_ids(short_texts) if short_texts else []
        target_docs, target_passages, target_short, target_tokens = self.teacher_targets(
            docs, passages, shorts, tokens=True)
        with torch.no_grad():
            student_docs, student_tokens = zip(*[document_states(student, tokenizer, ids) for ids in docs])
            result = {
                "document vs chunk-and-pool": float((torch.stack(student_docs) * target_docs).sum(-1).mean()),
                "token vs its window": float(_token_cosine(student_tokens, target_tokens).mean()),
                "passage": float((encode_token_ids(student, tokenizer, passages) * target_passages).sum(-1).mean()),
            }
            if shorts:
                result["short text"] = float((encode_token_ids(student, tokenizer, shorts) * target_short).sum(-1).mean())
        return result

    def losses(self, doc_starts, docs, passages, shorts):
        """({term: loss}, the student's document embeddings [N, hidden]) of one step's batch."""
        arguments, student, tokenizer = self.arguments, self.student, self.tokenizer
        target_docs, target_passages, target_short, target_tokens = self.teacher_targets(
            docs, passages, shorts, tokens=arguments.token_weight > 0)
        student_docs, student_tokens = zip(*[document_states(student, tokenizer, ids) for ids in docs])
        student_docs = torch.stack(student_docs)
        student_passages = encode_token_ids(student, tokenizer, passages)
        parts = {
            "document": (1 - (student_docs * target_docs).sum(-1)).mean(),
            "passage": (1 - (student_passages * target_passages).sum(-1)).mean(),
        }
        if shorts:
            parts["short"] = (1 - (encode_token_ids(student, tokenizer, shorts) * target_short).sum(-1)).mean()
        if arguments.token_weight > 0:
            parts["token"] = arguments.token_weight * (1 - _token_cosine(student_tokens, target_tokens)).mean()
        if arguments.contrastive:
            logits = contrastive_logits(student_passages, student_docs, arguments.temperature, self.memory,
                                        self.memory_starts, doc_starts, arguments.document_length)
            labels = torch.arange(arguments.batch_size, device=self.device)
            labels = labels.repeat_interleave(arguments.passages_per_document)
            parts["contrastive"] = arguments.contrastive_weight * F.cross_entropy(logits, labels)
        return parts, student_docs

    def train(self, trainable, short_texts, generator):
        """`arguments.steps` Adam steps on the sum of the terms; returns the history [{step, loss, terms}]."""
        from .transfer import _progress, adam_with_cosine_decay, shuffled_cycle

        arguments, history = self.arguments, []
        optimizer, schedule = adam_with_cosine_decay(
            trainable, arguments.steps, arguments.learning_rate, arguments.table_learning_rate
        )
        take_short = shuffled_cycle(short_texts, generator)
        progress = _progress(arguments.steps, arguments.show_progress, "long-context recipe")
        for step in range(1, arguments.steps + 1):
            doc_starts = _span_starts(self.stream, arguments.batch_size, arguments.document_length, generator)
            docs = [list(self.stream[s : s + arguments.document_length]) for s in doc_starts]
            passages = sample_passages(docs, arguments.passages_per_document, arguments.passage_length, generator)
            shorts = self.short_ids(take_short(arguments.short_batch_size))
            parts, student_docs = self.losses(doc_starts, docs, passages, shorts)
            loss = sum(parts.values())
            if not torch.isfinite(loss):
                raise ValueError(f"the long-context recipe diverged at step {step} (loss {float(loss)}): "
                                 "lower the learning rates")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            if self.memory is not None:
                self.memory, self.memory_starts = push_memory(self.memory, self.memory_starts, student_docs,
                                                              doc_starts)
            history.append({"step": step, "loss": loss.item(), **{k: v.item() for k, v in parts.items()}})
            progress.set_postfix(loss=f"{history[-1]['loss']:.4f}")
            progress.update(1)
        progress.close()
        return history


def _held_out_set(stream, short_texts, arguments):
    """(documents, passages, short texts) of the before/after report, drawn with a generator of their own."""
    generator = torch.Generator().manual_seed(arguments.seed + 1_000_003)
    docs = sample_documents(stream, arguments.eval_documents, arguments.document_length, generator)
    passages = sample_passages(docs, 2, arguments.passage_length, generator)
    shorts = [short_texts[i] for i in torch.randperm(len(short_texts), generator=generator)[:32].tolist()]
    return docs, passages, shorts


def long_context_distillation(
    student,
    teacher,
    tokenizer,
    documents: Sequence[str],
    arguments: Optional[LongContextArguments] = None,
    **options,
) -> LongContextReport:
    """Teach `student` (an NPRF conversion of `teacher`) to embed whole documents like `teacher`'s
    chunk-and-pool, and passages / short texts like `teacher` (module docstring). In place.

    Args:
        student: an NPRF model (any head; its base model is trained) converted from `teacher`, with
            positions for `document_length` tokens (`max_position_embeddings`, or position_embedding_type='none').
        teacher: the softmax source (any head); not changed.
        tokenizer: the source's tokenizer.
        documents: unlabeled long texts (e.g. `read_long_text(path)`); random spans of their token stream
            are the training documents.
        arguments: a `LongContextArguments` (None: its defaults); `options`, its fields by name (`steps=100`, ...),
            override it.
    Returns:
        A `LongContextReport`.
    """
    from .transfer import _check_pair, training_only

    arguments = dataclasses.replace(arguments or LongContextArguments(), **options)
    arguments.check()
    _check_pair(student, teacher)
    window = teacher_window(teacher, tokenizer) if arguments.window is None else arguments.window
    _check_lengths(student, teacher, tokenizer, arguments.document_length, window)
    if arguments.passage_length > window:
        raise ValueError(f"passage_length={arguments.passage_length} exceeds the teacher's window={window}: lower it")
    documents = [d for d in documents if d.strip()]
    if not documents:
        raise ValueError("the long-context recipe needs at least one document of text")
    stream = token_stream(tokenizer, documents)
    short_texts = arguments.short_texts
    if short_texts is None:
        short_texts = [s.strip() + " ." for d in documents for s in d.split(" . ") if len(s.split()) >= 5]
    short_texts = list(short_texts)
    if arguments.short_batch_size and not short_texts:
        raise ValueError("short_texts is empty: give short texts, or short_batch_size=0")

    trainable = long_context_trainable(student, arguments.train)
    held_out = _held_out_set(stream, short_texts, arguments)
    history = []
    # no dropout, no projection redraw: the loss compares deterministic embeddings
    with training_only(student, trainable, teacher, next(student.parameters()).device):
        matching = _DocumentMatching(student, teacher, tokenizer, stream, window, arguments)
        start = time.perf_counter()
        if arguments.contrastive and arguments.negatives > 0:
            matching.fill_memory()
        before = matching.evaluate(*held_out)
        if arguments.steps > 0:
            history = matching.train(trainable, short_texts, torch.Generator().manual_seed(arguments.seed))
        after = matching.evaluate(*held_out)
    return LongContextReport(
        steps=arguments.steps, seconds=time.perf_counter() - start, trainable=[name for name, _ in trainable],
        before=before, after=after, history=history,
    )


__all__ = [
    "LongContextArguments",
    "LongContextReport",
    "chunk_and_pool",
    "chunk_token_states",
    "contrastive_logits",
    "disjoint_span_starts",
    "document_states",
    "embed_documents",
    "encode_token_ids",
    "long_context_distillation",
    "long_context_trainable",
    "mean_pool",
    "push_memory",
    "read_long_text",
    "teacher_window",
    "windows",
]
