"""Conversations per CPU-second: the service against transformers' apply_chat_template in-process (issue 31).

    python -m bench.chat [--corpus FILE.jsonl] [--conversations N] [--rounds R] [--passes P] [--model DIR]
                         [--template FILE]

What a training script does today, per conversation, in-process (the baseline):
    tok.apply_chat_template(conversation, chat_template=T, tokenize=True, return_dict=True,
                            return_assistant_tokens_mask=True)
and the same conversations through the service: 2 workers, 256 conversations a request, 2 requests in flight,
binary answers (ids and loss masks). CPU seconds: the baseline's own process; the service's whole process tree
(server and workers) and, besides, the client's. The same conversations, the same cores, alternating rounds
(the median ratio of the rounds is reported); in each round the service encodes them --passes times over (CPU
times come in clock ticks of 10 ms a process, and one pass of the service is a few tenths of a CPU-second). T
is the template in use: a stock template of TRL's catalogue renders with its training version (as TRL's SFT
trainer does with assistant_only_loss=True), so both sides render the same text. Ids and masks are compared
conversation by conversation before timing.

Conversations are built from the shared multilingual corpus (10 languages): a system prompt in a third of
them, 1 to 4 user/assistant turns of its paragraphs. Without --model a 32k byte-level BPE tokenizer.json with
chat control tokens is trained on the corpus once (bench/results/).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil

from bench.inputs import RESULTS, default_corpus, read_text, write_byte_level_bpe
from tokenizer_client import TokenizerClient
from tokenizer_service.core import chat
from tokenizer_service.tools.launcher import ServerProcess

BATCH = 256
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def bench_model(corpus: Path, vocab_size: int = 32000) -> Path:
    """A byte-level BPE tokenizer.json (cl100k/Llama 3 split pattern) with <|im_start|>/<|im_end|>, trained once."""
    directory = RESULTS / f"chat-bpe-{vocab_size // 1000}k-{corpus.stem}"
    if (directory / "tokenizer.json").exists():
        return directory
    print(f"training a {vocab_size // 1000}k byte-level BPE on {corpus.name} (once) ...", flush=True)
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    return write_byte_level_bpe(directory, read_text(corpus).split("\n\n"), vocab_size, CONTROL, config)


def build_conversations(corpus: Path, count: int) -> list[list[dict[str, str]]]:
    paragraphs = [p.strip() for p in read_text(corpus).split("\n\n") if len(p.strip()) > 40]
    out, cursor = [], 0

    def take(limit: int) -> str:
        nonlocal cursor
        cursor += 1
        return paragraphs[cursor % len(paragraphs)][:limit]

    for index in range(count):
        messages = [{"role": "system", "content": take(300)}] if index % 3 == 0 else []
        for _ in range(1 + index % 4):
            messages.append({"role": "user", "content": take(500)})
            messages.append({"role": "assistant", "content": take(900)})
        out.append(messages)
    return out


def tree_cpu(process: psutil.Process) -> float:
    total = 0.0
    for member in [process, *process.children(recursive=True)]:
        try:
            times = member.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def own_cpu() -> float:
    return time.process_time()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=default_corpus(), help=".txt or .jsonl (default: multilingual)")
    parser.add_argument("--conversations", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", type=Path, help="a tokenizer.json or a snapshot directory (default: train one)")
    parser.add_argument(
        "--template", type=Path, default=chat.CATALOGUE / "qwen2_5.jinja", help="chat template (default: Qwen 2.5's)"
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--passes", type=int, default=4, help="service passes over the conversations a round")
    args = parser.parse_args()
    if args.conversations < 1 or args.rounds < 1 or args.passes < 1:
        parser.error("--conversations, --rounds and --passes must be at least 1")

    import transformers

    model = args.model or bench_model(args.corpus)
    snapshot = model if model.is_dir() else model.parent
    config = (
        json.loads((snapshot / "tokenizer_config.json").read_text())
        if (snapshot / "tokenizer_config.json").exists()
        else {}
    )
    eos = config.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    stock = args.template.read_text(encoding="utf-8")
    from tokenizer_service.core.models import TemplateFile

    used = chat.resolve(TemplateFile(stock, "flag", args.template, b""))
    if used.loss_mask is None:
        parser.error(f"{args.template} has no {{% generation %}} marks and is not in TRL's catalogue")
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(snapshot / "tokenizer.json"), eos_token=eos, pad_token=config.get("pad_token")
    )
    conversations = build_conversations(args.corpus, args.conversations)
    turns = sum(len(c) for c in conversations) / len(conversations)
    print(
        f"{len(conversations):,} conversations from {args.corpus.name} ({turns:.1f} messages on average); "
        f"model {snapshot.name}; template {args.template.name} (loss mask: {used.loss_mask}); "
        f"{psutil.cpu_count()} cores",
        flush=True,
    )

    def baseline() -> list[tuple[list[int], list[int]]]:
        out = []
        for conversation in conversations:
            encoded = tokenizer.apply_chat_template(
                conversation,
                chat_template=used.text,
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=True,
            )
            out.append((list(encoded["input_ids"]), list(encoded["assistant_masks"])))
        return out

    # The fast encoder's gate settled first (its verdict cached), so the server encodes with the encoder it will
    # keep from the first request and no background scan's CPU counts in the server's process tree.
    subprocess.run([sys.executable, "-m", "tokenizer_service.core.gatescan", str(snapshot)], check=True)
    server = ServerProcess(
        [
            "--workers",
            str(args.workers),
            "--model",
            f"bench={snapshot}",
            "--chat-template",
            f"bench={args.template}",
            "--log-level",
            "warning",
        ]
    ).start(timeout=600)
    assert server.process is not None
    tree = psutil.Process(server.process.pid)
    batches = [conversations[i : i + BATCH] for i in range(0, len(conversations), BATCH)]
    try:
        with TokenizerClient(server.url, timeout=600) as client:
            encoder = next(m for m in client.models()["models"] if m["name"] == "bench")["encoder"]

            def service() -> list[tuple[Any, Any]]:
                with ThreadPoolExecutor(2) as pool:
                    answers = pool.map(lambda batch: client.tokenize_conversations(batch, model="bench"), batches)
                    return [pair for answer in answers for pair in answer]

            want = baseline()
            got = service()
            differ = sum(
                ids.tolist() != w_ids or mask.tolist() != w_mask
                for (ids, mask), (w_ids, w_mask) in zip(got, want, strict=True)
            )
            tokens = sum(len(ids) for ids, _ in want)
            trained = sum(sum(mask) for _, mask in want)
            print(
                f"ids and masks compared on all {len(want):,} conversations: {differ} differ; {tokens:,} tokens, "
                f"trainable share {trained / tokens:.1%}; service encoder {encoder}",
                flush=True,
            )
            ratios, rows = [], []
            for round_ in range(1, args.rounds + 1):
                started = own_cpu()
                baseline()
                base_cpu = own_cpu() - started
                server_before, client_before = tree_cpu(tree), own_cpu()
                wall = time.perf_counter()
                for _ in range(args.passes):
                    service()
                wall = (time.perf_counter() - wall) / args.passes
                server_cpu = (tree_cpu(tree) - server_before) / args.passes
                client_cpu = (own_cpu() - client_before) / args.passes
                ratio = base_cpu / server_cpu
                ratios.append(ratio)
                rows.append(
                    f"| {round_} | {len(conversations) / base_cpu:,.0f} | {len(conversations) / server_cpu:,.0f} | "
                    f"{len(conversations) / (server_cpu + client_cpu):,.0f} | {len(conversations) / wall:,.0f} | "
                    f"{ratio:.2f}x | {base_cpu / (server_cpu + client_cpu):.2f}x |"
                )
    finally:
        server.stop()
    print(
        "| round | transformers conv/CPU-s | service conv/CPU-s (server+workers) | with the client's CPU | "
        "service conv/s wall | ratio | ratio with client |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows))
    print(f"median ratio (service CPU vs transformers in-process): {statistics.median(ratios):.2f}x (target >= 5x)")


if __name__ == "__main__":
    main()
