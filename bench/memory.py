"""Peak memory of the server's process tree under maximum-size requests.

    python -m bench.memory [--clients 8] [--body-mib 32] [--text-kib 8] [--emoji] [--seconds 15] [--workers 2]
                           [server flags...]

Starts a server (default flags unless given after the options) on a free loopback port, then keeps
`--clients` clients each posting bodies of `--body-mib` MiB (1-2 KB documents; `--emoji` puts one
astral character in each text, which makes Python hold the whole text at 4 bytes a character) for
`--seconds`, sampling the resident memory of the server and all its workers every 20 ms. Prints the
peak, the statuses, and the memory left once the load is gone.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import psutil

from bench.inputs import load_documents, python_docs_corpus
from tests.conftest import start_server, stop_server
from tests.test_memory import body_of, peak_under_load, tree_rss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--body-mib", type=float, default=32)
    parser.add_argument("--emoji", action="store_true")
    parser.add_argument("--text-kib", type=float, default=8, help="size of each text (default 8: 4,096 a 32 MiB body)")
    parser.add_argument("--seconds", type=float, default=15)
    parser.add_argument("--workers", type=int, default=2)
    args, server_flags = parser.parse_known_args()

    docs = load_documents(python_docs_corpus(), 4000)
    body = body_of(docs, int(args.body_mib * 2**20), args.emoji, int(args.text_kib * 1024))
    log = Path("/tmp") / "tokenizer-memory-bench.log"
    url, process = start_server(["--workers", str(args.workers), "--log-level", "warning", *server_flags], log)
    server = psutil.Process(process.pid)
    idle = tree_rss(server)
    try:
        peak, statuses, _ = peak_under_load(url, server, body, args.clients, args.seconds)
        if process.poll() is not None:
            raise SystemExit(f"the server died (exit {process.returncode}); see {log}")
        time.sleep(2)
        after = tree_rss(server)
        each = [f"{member.pid}:{member.memory_info().rss / 2**20:.0f}" for member in [server, *server.children()]]
    finally:
        stop_server(process)
    print(
        f"{args.clients} clients x {len(body) / 2**20:.1f} MiB bodies{' (emoji)' if args.emoji else ''}, "
        f"{args.workers} workers, {args.seconds:.0f} s: peak RSS of the server tree {peak / 2**20:,.0f} MiB "
        f"(idle before {idle / 2**20:,.0f} MiB, 2 s after {after / 2**20:,.0f} MiB: {' '.join(each)} MiB by process); "
        f"statuses {dict(statuses)}"
    )


if __name__ == "__main__":
    main()
