"""A simulated training loop: how long does it wait for tokenized data? Measured in one run.

    python -m bench.training_loop [--corpus FILE] [--docs N] [--batch B] [--steps S] [--load 0.7]
                                  [--torch [--layers 12 --width 768]]

Each step sleeps T ms (a GPU step leaves the CPU free) and consumes one batch: B texts, or one packed
batch of rows x seq_len tokens holding about as many tokens. With --torch the step is a real one on the
accelerator instead of a sleep: a decoder-only transformer (--layers, --width; GPT-2 small by default)
takes the batch as rows x seq_len token ids (a ragged batch's ids concatenated and cut to that shape),
copies them from pinned memory, runs forward and backward in bf16 autocast and an AdamW step, and
reads the loss (a sync, as a loop that logs does); T is then what that step takes, measured alone on
ids already on the device, and the load is what it asks of the service. Strategies:
  (a) inline loop     [sp.encode(text) for text in batch]              (what training scripts do today)
  (b) inline batched  sp.encode(batch, num_threads=cores)
  (c) prefetch        client.prefetch(texts, batch_size=B, depth=D)
  (d) prefetch, pack  client.prefetch(texts, batch_size=B, depth=D, pack=PackSpec(seq_len, rows))
Before (c) and before (d) the service's capacity is measured (a prefetcher drained with no step in
between, ragged, then packed); T is set so that the loop asks for `--load` (0.7) of it, and (a), (b)
run with the T of (c). Per strategy it prints steps/s against the ideal 1/T and the data-wait
fraction: time blocked on data / wall time, over S steps after a first batch fetched before the clock
starts (a cold start, reported apart). Target: prefetch's wait fraction <= 1%, where (a)'s is what
tokenization costs.
Starts its own server on a free loopback port; client and server share this machine's cores.
"""

from __future__ import annotations

import argparse
import itertools
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import sentencepiece as spm

from bench.inputs import describe_corpus, documents_and_model, python_docs_corpus, start_server
from tokenizer_client import PackSpec, PrefetchStats, TokenizerClient

TARGET_WAIT_FRACTION = 0.01


@dataclass
class LoopResult:
    name: str
    steps: int
    wall_s: float
    waits_s: np.ndarray
    ideal_steps_per_s: float
    first_s: float

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.wall_s

    @property
    def wait_fraction(self) -> float:
        return float(self.waits_s.sum()) / self.wall_s


def sleeping(step_s: float) -> Callable[[object], None]:
    """A step that leaves the CPU free for `step_s` seconds, whatever the batch."""
    return lambda batch: time.sleep(step_s)


class TorchStep:
    """A real training step on the accelerator: a causal transformer over [rows, seq_len] token ids.

    Every strategy's batch becomes the same tensor: a packed batch's input_ids as they are, a ragged
    batch's (or a list of id lists') ids concatenated and cut (or padded with 0) to rows x seq_len.
    """

    def __init__(self, vocab: int, rows: int, seq_len: int, layers: int, width: int) -> None:
        import torch

        self.torch = torch
        self.rows, self.seq_len = rows, seq_len
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        heads = max(1, width // 64)
        layer = torch.nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True, activation="gelu"
        )
        self.model = torch.nn.ModuleDict(
            {
                "embed": torch.nn.Embedding(vocab, width),
                "position": torch.nn.Embedding(seq_len, width),
                "blocks": torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False),
                "norm": torch.nn.LayerNorm(width),
                "head": torch.nn.Linear(width, vocab, bias=False),
            }
        ).to(self.device)
        self.mask = torch.nn.Transformer.generate_square_subsequent_mask(seq_len, device=self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=self.device.type == "cuda")
        self.pinned = torch.empty((rows, seq_len), dtype=torch.int32, pin_memory=self.device.type == "cuda")
        self.parameters = sum(p.numel() for p in self.model.parameters())
        self.losses: list[float] = []

    def rows_of(self, batch: object) -> np.ndarray:
        """The batch's ids as an int32 [rows, seq_len] array."""
        if hasattr(batch, "input_ids"):
            return np.asarray(batch.input_ids, dtype=np.int32)
        if hasattr(batch, "ids"):
            flat = np.asarray(batch.ids, dtype=np.int32)
        else:
            flat = np.concatenate([np.asarray(ids, dtype=np.int32) for ids in batch])  # type: ignore[attr-defined]
        size = self.rows * self.seq_len
        rows = np.zeros(size, dtype=np.int32)
        rows[: min(size, len(flat))] = flat[:size]
        return rows.reshape(self.rows, self.seq_len)

    def __call__(self, batch: object) -> None:
        torch = self.torch
        ids = self.rows_of(batch)
        self.pinned[: ids.shape[0]].copy_(torch.from_numpy(ids))
        self.step(self.pinned[: ids.shape[0]].to(self.device, non_blocking=True))

    def step(self, ids) -> None:  # ids: a torch tensor of [rows, seq_len] ids on the device
        torch = self.torch
        ids = ids.long()
        positions = torch.arange(ids.shape[1], device=self.device)
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            hidden = self.model["embed"](ids) + self.model["position"](positions)
            hidden = self.model["blocks"](hidden, mask=self.mask, is_causal=True)
            logits = self.model["head"](self.model["norm"](hidden))
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.losses.append(loss.item())  # a sync: the step is over when this returns

    def seconds(self, vocab: int, repeats: int = 10) -> float:
        """The median seconds of one step on random ids already on the device (after warm-up steps)."""
        torch = self.torch
        ids = torch.randint(0, vocab, (self.rows, self.seq_len), device=self.device, dtype=torch.int32)
        for _ in range(3):
            self.step(ids)
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            self.step(ids)
            times.append(time.perf_counter() - began)
        self.losses.clear()
        return float(np.median(times))


def training_loop(
    name: str, next_batch: Callable[[], object], steps: int, step: Callable[[object], None], step_s: float
) -> LoopResult:
    """`steps` steps of: wait for the next batch (timed), then `step` on it (a sleep, or a real step of
    about `step_s` seconds, which sets the ideal steps/s).

    The first batch is fetched before the clock starts (a cold start, reported apart): the table
    is about the steady state of a long run.
    """
    asked = time.perf_counter()
    batch = next_batch()
    first_s = time.perf_counter() - asked
    step(batch)
    waits = np.empty(steps)
    started = time.perf_counter()
    for index in range(steps):
        asked = time.perf_counter()
        batch = next_batch()
        waits[index] = time.perf_counter() - asked
        step(batch)
    return LoopResult(name, steps, time.perf_counter() - started, waits, 1 / step_s, first_s)


def texts_forever(docs: list[str]) -> Iterator[str]:
    return itertools.cycle(docs)


def capacity(client: TokenizerClient, docs: list[str], batch: int, depth: int, pack: PackSpec | None) -> tuple:
    """Texts/s and tokens/s the service delivers to one prefetcher that is drained as fast as it can be."""
    best = (0.0, 0.0)
    for _ in range(3):  # the first run warms connections and workers; the best of the others counts
        started = time.perf_counter()
        with client.prefetch(docs, batch_size=batch, depth=depth, model="bench", pack=pack) as prefetcher:
            for _ in prefetcher:
                pass
            stats = prefetcher.stats
        seconds = time.perf_counter() - started
        best = max(best, (stats.texts / seconds, stats.tokens / seconds))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=python_docs_corpus())
    parser.add_argument("--model", type=Path, help="a SentencePiece model (default: train one on the corpus)")
    parser.add_argument("--docs", type=int, default=20_000, help="documents (the loop cycles over them)")
    parser.add_argument("--batch", type=int, default=256, help="texts a step consumes (B)")
    parser.add_argument("--steps", type=int, default=300, help="steps per strategy")
    parser.add_argument("--load", type=float, default=0.7, help="demand as a fraction of the measured capacity")
    parser.add_argument("--depth", type=int, default=4, help="requests in flight")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--torch", action="store_true", help="a real training step on the accelerator, not a sleep")
    parser.add_argument("--layers", type=int, default=12, help="--torch: transformer layers")
    parser.add_argument("--width", type=int, default=768, help="--torch: model width (heads of 64)")
    args = parser.parse_args()

    cores = len(os.sched_getaffinity(0))
    docs, model = documents_and_model(args.corpus, args.docs, args.model)
    sp = spm.SentencePieceProcessor(model_file=str(model))
    tokens_per_doc = sum(len(ids) for ids in sp.encode(docs[:2000])) / 2000 + 1  # + EOS when packing
    rows = max(1, round(args.batch * tokens_per_doc / args.seq_len))
    spec = PackSpec(seq_len=args.seq_len, rows=rows)
    describe_corpus(
        args.corpus,
        docs,
        f"{tokens_per_doc - 1:.0f} tokens each on average",
        f"model {model.name} (vocab {sp.vocab_size()})",
        f"{cores} cores",
        f"B={args.batch} texts a step, packed: {rows} x {args.seq_len}",
        f"depth {args.depth}",
    )

    torch_step = None
    if args.torch:
        torch_step = TorchStep(sp.vocab_size(), rows, args.seq_len, args.layers, args.width)
        torch_s = torch_step.seconds(sp.vocab_size())
        print(
            f"torch step on {torch_step.device} ({_device_name(torch_step)}): {args.layers} layers x {args.width}, "
            f"{torch_step.parameters / 1e6:.0f} M parameters, {rows} x {args.seq_len} tokens, bf16 autocast, AdamW: "
            f"{torch_s * 1000:.1f} ms alone ({rows * args.seq_len / torch_s / 1e6:.2f} M tokens/s asked)",
            flush=True,
        )

    load_before = os.getloadavg()[0]
    url, server = start_server(model, cores)
    try:
        with TokenizerClient(url, timeout=120) as client:

            def stepping(seconds: float) -> tuple[Callable[[object], None], float]:
                """The step each strategy runs: the torch step (its own time), or a sleep of `seconds`."""
                if torch_step is not None:
                    return torch_step, torch_s
                return sleeping(seconds), seconds

            def prefetching(name: str, pack: PackSpec | None, seconds: float) -> LoopResult:
                with client.prefetch(
                    texts_forever(docs), batch_size=args.batch, depth=args.depth, model="bench", pack=pack
                ) as prefetcher:
                    result = training_loop(name, prefetcher.__next__, args.steps, *stepping(seconds))
                    prefetch_stats[name] = prefetcher.stats
                return result

            # Each prefetch run follows its own capacity measurement: the machine's other load drifts.
            texts_s, _ = capacity(client, docs, args.batch, args.depth, None)
            step_s = args.batch / (args.load * texts_s)
            if torch_step is None:
                print(
                    f"service capacity through one prefetcher: {texts_s:,.0f} texts/s; at load {args.load:.0%} "
                    f"a step of {args.batch} texts takes {step_s * 1000:.1f} ms",
                    flush=True,
                )
            else:
                print(
                    f"service capacity through one prefetcher: {texts_s:,.0f} texts/s; the torch step asks for "
                    f"{args.batch / torch_s:,.0f} texts/s, a load of {args.batch / torch_s / texts_s:.1%}",
                    flush=True,
                )
            prefetch_stats: dict[str, PrefetchStats] = {}
            ragged = prefetching(f"(c) client.prefetch, depth {args.depth}", None, step_s)
            stream = texts_forever(docs)
            inline = [
                training_loop(
                    "(a) inline sp.encode(text) loop",
                    lambda: [sp.encode(text) for text in itertools.islice(stream, args.batch)],
                    args.steps,
                    *stepping(step_s),
                ),
                training_loop(
                    f"(b) inline sp.encode(batch, num_threads={cores})",
                    lambda: sp.encode(list(itertools.islice(stream, args.batch)), num_threads=cores),
                    args.steps,
                    *stepping(step_s),
                ),
            ]
            _, tokens_s = capacity(client, docs, args.batch, args.depth, spec)
            packed_step_s = rows * args.seq_len / (args.load * tokens_s)
            if torch_step is None:
                print(
                    f"packed: {tokens_s / 1e6:.2f} M tokens/s; a step of {rows} x {args.seq_len} tokens takes "
                    f"{packed_step_s * 1000:.1f} ms",
                    flush=True,
                )
            else:
                print(
                    f"packed: {tokens_s / 1e6:.2f} M tokens/s; the torch step asks for "
                    f"{rows * args.seq_len / torch_s / 1e6:.2f} M, "
                    f"a load of {rows * args.seq_len / torch_s / tokens_s:.1%}",
                    flush=True,
                )
            packed = prefetching(f"(d) client.prefetch, pack {rows}x{args.seq_len}", spec, packed_step_s)
            results = [*inline, ragged, packed]
    finally:
        server.terminate()
        server.wait(timeout=30)

    print()
    print("| strategy | step ms | steps/s | ideal steps/s | data wait | wait p50 ms | wait p99 ms | first batch ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for result in results:
        print(
            f"| {result.name} | {1000 / result.ideal_steps_per_s:.1f} | {result.steps_per_s:.1f} | "
            f"{result.ideal_steps_per_s:.1f} | {result.wait_fraction:.1%} | "
            f"{np.percentile(result.waits_s, 50) * 1000:.2f} | {np.percentile(result.waits_s, 99) * 1000:.2f} | "
            f"{result.first_s * 1000:.1f} |"
        )
    print()
    for name, stats in prefetch_stats.items():
        print(
            f"{name}: prefetcher.stats (first batch included) wait_fraction {stats.wait_fraction:.2%}, request p50 "
            f"{stats.request_p50_s * 1000:.1f} ms p99 {stats.request_p99_s * 1000:.1f} ms, retries {stats.retries}"
        )
    print(
        f"machine load average (1 min) {load_before:.2f} before, {os.getloadavg()[0]:.2f} after "
        f"({cores} cores; other work on the machine makes the service slower than its measured capacity)"
    )
    if torch_step is not None and torch_step.losses:
        print(f"torch step: {len(torch_step.losses)} steps, last loss {torch_step.losses[-1]:.3f}")
    verdict = all(r.wait_fraction <= TARGET_WAIT_FRACTION for r in results[2:])
    print(f"target: prefetch data wait <= {TARGET_WAIT_FRACTION:.0%}: {'met' if verdict else 'NOT met'}")


def _device_name(step: TorchStep) -> str:
    if step.device.type == "cuda":
        return step.torch.cuda.get_device_name(step.device)
    return f"{os.cpu_count()} CPUs"


if __name__ == "__main__":
    main()
