"""Context-parallel NPRF attention (`nprf_hf.nprf_context_parallel`): P = 2 and 3 CPU processes (gloo), each with
a contiguous shard of the sequence, give one process's outputs and, summed over the ranks, its gradients."""

import json
import os
import socket

import pytest
import torch

from nprf_hf.nprf_context_parallel import (
    communicated_bytes,
    context_parallel_attention,
    halo_index,
    ring_attention_bytes,
)
from nprf_hf.nprf_terms import AttentionTerms


TOLERANCE = 1e-4


def free_port():
    with socket.socket() as handle:
        handle.bind(("127.0.0.1", 0))
        return handle.getsockname()[1]


def spawn(worker, world_size, tmp_path, *args):
    """Run worker(rank, world_size, port, out_dir, *args) on `world_size` gloo processes; their JSON reports."""
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(world_size, free_port(), str(tmp_path), *args), nprocs=world_size, join=True)
    return [json.load(open(os.path.join(tmp_path, f"{rank}.json"))) for rank in range(world_size)]


def init(rank, world_size, port):
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def shard(length, world_size, rank):
    """[lo, hi) of `rank`: equal shards except the last."""
    size = -(-length // world_size)
    return rank * size, min(length, (rank + 1) * size)


def relative_error(got, want):
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


# (name, n, causal, dtype, logit scale, bias passed as the whole sequence's [H, 2n - 1], recompute in backward)
CASES = [
    ("long", 101, False, torch.float64, False, False, False),
    ("long_causal", 101, True, torch.float64, False, False, True),
    ("wide_band", 10, False, torch.float32, True, False, True),  # W - 1 = 5 > a shard of 4 (P = 3) or 5 (P = 2)
    ("wide_band_causal", 10, True, torch.float32, True, True, False),  # W - 1 = 11: the whole sequence
]


def attention_worker(rank, world_size, port, out_dir):
    import torch.distributed as dist

    from nprf_hf import nprf_context_parallel
    from nprf_hf.functional import draw_projection, nprf_attention, relative_position_bias, rpe_band_width

    init(rank, world_size, port)
    report = {}
    received, gather = [], nprf_context_parallel.all_gather

    def counting_gather(tensor, group=None):  # the bytes this rank receives: the other ranks' parts
        out = gather(tensor, group)
        received.append((out.shape[0] - 1) * tensor.numel() * tensor.element_size())
        return out

    nprf_context_parallel.all_gather = counting_gather
    batch, heads, d, m, buckets, distance = 2, 2, 8, 16, 8, 16
    for name, n, causal, dtype, scaled, whole_bias, recompute in CASES:
        generator = torch.Generator().manual_seed(n)  # the same inputs on every rank
        q, k, v = (torch.randn(batch, heads, n, d, generator=generator, dtype=dtype) for _ in range(3))
        table = torch.randn(heads, buckets, generator=generator, dtype=dtype)
        projection = draw_projection(m, d, generator=generator).to(dtype)
        grad_out = torch.randn(batch, heads, n, d, generator=generator, dtype=dtype)
        scale = torch.tensor([1.5, 3.0], dtype=dtype).requires_grad_(True) if scaled else None
        mask = torch.ones(batch, n, dtype=torch.bool)
        mask[1, n - n // 3 :] = False  # right padding
        width = rpe_band_width(buckets, distance, not causal)

        leaves = [t.clone().requires_grad_(True) for t in (q, k, v, table)]
        bias = relative_position_bias(leaves[3], n, not causal, buckets, distance)
        want = nprf_attention(*leaves[:3], bias, projection, mask, causal=causal, band_width=width, logit_scale=scale)
        want_grads = torch.autograd.grad(want, leaves + ([scale] if scaled else []), grad_out)

        lo, hi = shard(n, world_size, rank)
        mine = [t[:, :, lo:hi].clone().requires_grad_(True) for t in (q, k, v)] + [table.clone().requires_grad_(True)]
        bias = relative_position_bias(mine[3], n if whole_bias else width + 1, not causal, buckets, distance)
        terms = AttentionTerms.from_arguments(logit_scale=scale)
        received.clear()
        got = context_parallel_attention(*mine[:3], bias, projection, width, mask[:, lo:hi], causal=causal, terms=terms,
                                         recompute=recompute)
        sent = communicated_bytes(batch, heads, d, m, width, world_size, causal, torch.finfo(dtype).bits // 8)
        got_grads = list(torch.autograd.grad(got, mine + ([scale] if scaled else []), grad_out[:, :, lo:hi]))
        for index in range(3, len(got_grads)):  # the shared parameters: summed over the ranks, as DDP does
            dist.all_reduce(got_grads[index])
        report[name] = {
            "output": relative_error(got, want[:, :, lo:hi]),
            **{key: relative_error(got_grads[i], want_grads[i][:, :, lo:hi]) for i, key in enumerate("qkv")},
            "table": relative_error(got_grads[3], want_grads[3]),
            **({"logit_scale": relative_error(got_grads[4], want_grads[4])} if scaled else {}),
            "shard": [lo, hi],
            "bytes": [list(received), [sent]],
        }
    finish_worker(report, out_dir, rank)


@pytest.mark.parametrize("world_size", [2, 3])
def test_shards_equal_one_process(world_size, tmp_path):
    reports = spawn(attention_worker, world_size, tmp_path)
    for rank, report in enumerate(reports):
        assert set(report) == {case[0] for case in CASES}
        for case, errors in report.items():
            for what, error in errors.items():
                if what == "bytes":  # one all-gather per call, of the size `communicated_bytes` says
                    assert error[0] == error[1], f"rank {rank} {case}: received {error[0]} bytes, not {error[1]}"
                elif what != "shard":
                    assert error <= TOLERANCE, f"rank {rank} {case} {what}: relative error {error:.2e}"


def test_halo_reaches_past_a_short_neighbour():
    """Shards of 4, 4, 2 and a halo of 5: rank 2's left halo is rank 1's 4 keys and rank 0's last one."""
    bounds = [(0, 4), (4, 8), (8, 10)]
    assert halo_index(bounds, 2, 5, "left") == ([0, 1, 1, 1, 1], [4, 1, 2, 3, 4])
    assert halo_index(bounds, 0, 5, "right") == ([1, 1, 1, 1, 2], [0, 1, 2, 3, 0])
    assert halo_index(bounds, 1, 5, "right") == ([2, 2], [0, 1])  # clipped at the sequence's end


def test_unsupported_terms_are_named():
    q = torch.randn(1, 2, 4, 8)
    terms = AttentionTerms.from_arguments(segment_ids=torch.zeros(1, 4, dtype=torch.long), segment_bias=torch.zeros(2))
    with pytest.raises(NotImplementedError, match="segment_bias"):
        context_parallel_attention(q, q, q, torch.zeros(2, 7), torch.randn(16, 8), 3, terms=terms)
    with pytest.raises(NotImplementedError, match="softmax"):
        context_parallel_attention(q, q, q, torch.zeros(2, 7), torch.randn(16, 8), 3, variant="softmax")


def test_bytes_do_not_grow_with_length():
    """MiniLM's shape (12 heads of 64, m = 64, W = 91): a few percent of ring attention's bytes at 8k tokens and
    under 2% at 32k."""
    sent = communicated_bytes(1, 12, 64, 64, 91, 2)  # no length argument: the states and halos do not grow
    assert sent / ring_attention_bytes(1, 12, 64, 8192, 2) <= 0.08
    assert sent / ring_attention_bytes(1, 12, 64, 32768, 2) <= 0.02


def shard_errors(got, want, got_grads, want_grads, parameters, lo, hi):
    """A rank's relative errors against one process: its output shard [lo, hi), and the parameters' gradients summed
    over the ranks (as DDP / FSDP sum them; None counts as zero)."""
    import torch.distributed as dist

    def flat(grads):
        return torch.cat([(torch.zeros_like(p) if g is None else g).flatten() for g, p in zip(grads, parameters)])

    got_flat = flat(got_grads)
    dist.all_reduce(got_flat)
    return {"output": relative_error(got, want[:, lo:hi]), "gradients": relative_error(got_flat, flat(want_grads))}


def finish_worker(report, out_dir, rank):
    """The rank's report written for the parent, then the process group torn down."""
    import torch.distributed as dist

    with open(os.path.join(out_dir, f"{rank}.json"), "w") as handle:
        json.dump(report, handle)
    dist.barrier()  # no rank tears gloo down while another still talks to it
    dist.destroy_process_group()


# (name, family config, model class, decoder): each rank passes its shard of input_ids inside `context_parallel`
MODELS = [
    ("roberta_encoder", "NPRFRobertaConfig", "NPRFRobertaModel", False),
    ("roberta_decoder", "NPRFRobertaConfig", "NPRFRobertaForCausalLM", True),
    ("bert_encoder", "NPRFBertConfig", "NPRFBertModel", False),  # positions from 0, not from the real tokens
]


def model_worker(rank, world_size, port, out_dir):
    import nprf_hf
    from conftest import tiny_nprf_config

    init(rank, world_size, port)
    report = {}
    n, pad = 45, 1
    for name, config_name, model_name, decoder in MODELS:
        config = getattr(nprf_hf, config_name)(**tiny_nprf_config(pad_token_id=pad, is_decoder=decoder))
        torch.manual_seed(0)  # the same weights and inputs on every rank
        model = getattr(nprf_hf, model_name)(config).eval()
        input_ids = torch.randint(3, config.vocab_size, (2, n))
        attention_mask = torch.ones(2, n, dtype=torch.long)
        input_ids[1, 30:], attention_mask[1, 30:] = pad, 0  # right padding, across the shard boundary
        grad_out = None

        def run(ids, mask, **cache):
            out = model(input_ids=ids, attention_mask=mask, **cache)
            assert getattr(out, "past_key_values", None) is None
            return out.logits if decoder else out.last_hidden_state

        want = run(input_ids, attention_mask, use_cache=False)
        grad_out = torch.randn(want.shape)
        want_grads = torch.autograd.grad(want, list(model.parameters()), grad_out, allow_unused=True)
        lo, hi = shard(n, world_size, rank)
        with nprf_hf.context_parallel():  # no use_cache: a sharded decoder runs without a cache
            got = run(input_ids[:, lo:hi], attention_mask[:, lo:hi])
            got_grads = torch.autograd.grad(got, list(model.parameters()), grad_out[:, lo:hi], allow_unused=True)
        report[name] = shard_errors(got, want, got_grads, want_grads, list(model.parameters()), lo, hi)
    finish_worker(report, out_dir, rank)


def test_models_on_shards_equal_one_process(tmp_path):
    for rank, report in enumerate(spawn(model_worker, 2, tmp_path)):
        assert set(report) == {model[0] for model in MODELS}
        for name, errors in report.items():
            for what, error in errors.items():
                assert error <= TOLERANCE, f"rank {rank} {name} {what}: relative error {error:.2e}"


def minilm_worker(rank, world_size, port, out_dir, path):
    """The converted MiniLM (T5's default buckets: a band of 91), as an encoder and made a decoder, on its shard."""
    import nprf_hf

    init(rank, world_size, port)
    report = {}
    n = 300
    for decoder in (False, True):
        model = nprf_hf.convert_to_nprf(path, head="model", is_decoder=decoder).eval()
        generator = torch.Generator().manual_seed(0)
        input_ids = torch.randint(1000, 20000, (2, n), generator=generator)
        attention_mask = torch.ones(2, n, dtype=torch.long)
        attention_mask[1, 220:] = 0  # right padding
        parameters = [p for p in model.parameters() if p.requires_grad]
        want = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        grad_out = torch.randn(want.shape, generator=generator)
        want_grads = torch.autograd.grad(want, parameters, grad_out, allow_unused=True)
        lo, hi = shard(n, world_size, rank)
        with nprf_hf.context_parallel():
            got = model(input_ids=input_ids[:, lo:hi], attention_mask=attention_mask[:, lo:hi], use_cache=False)
        got = got.last_hidden_state
        got_grads = torch.autograd.grad(got, parameters, grad_out[:, lo:hi], allow_unused=True)
        report["decoder" if decoder else "encoder"] = shard_errors(got, want, got_grads, want_grads, parameters, lo, hi)
    finish_worker(report, out_dir, rank)


def test_converted_minilm_on_shards_equals_one_process(tmp_path):
    from conftest import minilm_path

    for rank, report in enumerate(spawn(minilm_worker, 2, tmp_path, minilm_path())):
        assert set(report) == {"encoder", "decoder"}
        for name, errors in report.items():
            for what, error in errors.items():
                assert error <= TOLERANCE, f"rank {rank} MiniLM {name} {what}: relative error {error:.2e}"


def test_decoder_cache_refused_inside_context_parallel():
    """An NPRFCache decodes one process's whole sequence: inside `context_parallel` a decoder asked for a cache
    (use_cache=True) says to drop it; called without use_cache, it runs without one
    (`test_models_on_shards_equal_one_process`)."""
    import nprf_hf
    from conftest import tiny_nprf_config
    from nprf_hf.attention_nprf import _GROUPS

    config = nprf_hf.NPRFRobertaConfig(**tiny_nprf_config(pad_token_id=1, is_decoder=True))
    model = nprf_hf.NPRFRobertaForCausalLM(config).eval()
    _GROUPS.append(object())  # active without a process group: the check comes before any collective
    try:  # (given position ids: the embeddings' own would gather the shards' lengths)
        with pytest.raises(ValueError, match="use_cache=False"):
            model(input_ids=torch.randint(3, 99, (1, 5)), position_ids=torch.arange(2, 7)[None], use_cache=True)
    finally:
        _GROUPS.pop()


def one_and_sharded(script, arguments, results_file, tmp_path):
    """Run examples/`script` with `arguments` on one process and on two (accelerate launch, CPU DDP config,
    --context_parallel): ({"one" | "sharded": the losses of train_log.jsonl}, {...: the results JSON})."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "examples", script)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    logs, results = {}, {}
    for name, launch in (("one", [sys.executable, path]), ("sharded", [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file",
        os.path.join(root, "examples", "accelerate", "cpu_ddp.yaml"), path, "--context_parallel",
    ])):
        result = subprocess.run(launch + arguments + ["--output_dir", str(tmp_path / name)], capture_output=True,
                                text=True, timeout=300, cwd=root, env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        logs[name] = [json.loads(line)["loss"] for line in open(tmp_path / name / "train_log.jsonl")]
        results[name] = json.load(open(tmp_path / name / results_file))
    return logs, results


def test_run_clm_context_parallel_matches_one_process(roberta_source, tmp_path):
    """examples/run_clm.py --context_parallel on 2 processes (accelerate launch, gloo): every block's tokens split over
    them, the same losses step by step as one process on the same blocks."""
    from conftest import shared_data

    with open(shared_data("wikitext-2", "valid.txt"), encoding="utf-8") as handle:
        (tmp_path / "train.txt").write_text("".join(next(handle) for _ in range(200)), encoding="utf-8")
    tiny = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64,
            "max_position_embeddings": 70, "num_random_features": 16, "rpe_num_buckets": 8, "rpe_max_distance": 16,
            "hidden_dropout_prob": 0.0}
    arguments = ["--model_type", "nprf_roberta", "--tokenizer_name", roberta_source, "--config_overrides",
                 json.dumps(tiny), "--train_file", str(tmp_path / "train.txt"), "--block_size", "64", "--max_steps", "3",
                 "--per_device_train_batch_size", "2", "--threads", "1", "--no_save_model"]
    logs, results = one_and_sharded("run_clm.py", arguments, "results.json", tmp_path)
    for name in logs:
        assert results[name]["context_parallel"] == (name == "sharded") and results[name]["batch_size"] == 2
        assert results[name]["processes"] == (2 if name == "sharded" else 1)
    assert len(logs["one"]) == len(logs["sharded"]) == 3
    for one, sharded in zip(logs["one"], logs["sharded"]):
        assert abs(one - sharded) <= 1e-4 * abs(one), logs


def test_run_long_retrieval_context_parallel_matches_one_process(tmp_path):
    """examples/run_long_retrieval.py --context_parallel on 2 processes: each document split over them, the same
    losses step by step as one process on the same batch, and the processes' weights stay equal."""
    import nprf_hf
    from conftest import minilm_path, shared_data
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    config = nprf_hf.NPRFBertConfig(**tiny_nprf_config_kwargs(len(tokenizer)))
    torch.manual_seed(0)
    nprf_hf.NPRFBertModel(config).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    with open(shared_data("wikitext-2", "valid.txt"), encoding="utf-8") as handle:
        (tmp_path / "train.txt").write_text("".join(next(handle) for _ in range(300)), encoding="utf-8")
    arguments = ["--model_name_or_path", str(tmp_path / "model"), "--train_file", str(tmp_path / "train.txt"),
                 "--document_length", "120", "--passage_length", "16", "--batch_size", "2", "--max_steps", "2",
                 "--learning_rate", "1e-3", "--threads", "1"]
    logs, results = one_and_sharded("run_long_retrieval.py", arguments, "train_results.json", tmp_path)
    for name in logs:
        assert results[name]["context_parallel"] == (name == "sharded") and results[name]["parameters_in_sync"]
    assert len(logs["one"]) == len(logs["sharded"]) == 2
    for one, sharded in zip(logs["one"], logs["sharded"]):
        assert abs(one - sharded) <= 1e-4 * abs(one), logs


def tiny_nprf_config_kwargs(vocab_size):
    """A tiny NPRF BERT with 300 positions (documents of 120 tokens) and a short band (W = 6)."""
    from conftest import tiny_nprf_config

    return tiny_nprf_config(vocab_size=vocab_size, max_position_embeddings=300, num_attention_heads=4,
                            intermediate_size=64)


def fsdp_worker(rank, world_size, port, out_dir):
    """FSDP2 (`fully_shard` per layer, then the model) of a tiny NPRF RoBERTa causal LM over gloo: a few steps on the
    same data as the one-process reference; the losses, the parameters' sharding and the trained weights reported."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from conftest import tiny_nprf_config
    from nprf_hf import NPRFRobertaConfig, NPRFRobertaForCausalLM

    if world_size > 1:
        init(rank, world_size, port)
    torch.manual_seed(0)
    model = NPRFRobertaForCausalLM(NPRFRobertaConfig(**tiny_nprf_config(), is_decoder=True))
    if world_size > 1:
        for layer in model.roberta.encoder.layer:
            fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(3, 99, (4, 24), generator=generator)] * 5  # one batch, learned over the steps
    losses = []
    for ids in batches:  # each rank takes its half of every batch; FSDP averages the gradients over ranks
        mine = ids.chunk(world_size)[rank]
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    sharded = any(type(p).__name__ == "DTensor" for p in model.parameters())
    weight = model.lm_head.dense.weight
    weight = weight.full_tensor() if hasattr(weight, "full_tensor") else weight
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as handle:
        json.dump({"losses": losses, "sharded": sharded, "weight": weight.detach().flatten()[:50].tolist()}, handle)
    if world_size > 1:
        dist.barrier()  # no rank tears gloo down while another still talks to it
        dist.destroy_process_group()


def test_fsdp2_on_cpu_processes_trains_like_one_process(tmp_path):
    """FSDP2 runs on CPU processes (gloo): the parameters are sharded, the loss goes down, and the weights after 5
    steps equal those of one process on the whole batches (FSDP averages the ranks' gradients of equal halves).
    (`accelerate launch` does not get here on a CPU: it turns an FSDP config into MULTI_CPU DDP.)"""
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    fsdp_worker(0, 1, None, str(tmp_path / "one"))
    reports = spawn(fsdp_worker, 2, tmp_path / "two")
    one = json.load(open(tmp_path / "one" / "0.json"))
    assert all(report["sharded"] for report in reports) and not one["sharded"]
    assert reports[0]["losses"][-1] < reports[0]["losses"][0]
    assert relative_error(torch.tensor(reports[0]["weight"]), torch.tensor(one["weight"])) < 1e-4
    assert reports[0]["weight"] == reports[1]["weight"]
