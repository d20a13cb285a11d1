"""`tokenizer-pretokenize ... --ray ADDRESS --world-size W`: the W ranks as tasks of a Ray cluster, then the merge.

One Ray task per rank (`num_cpus` = `--workers`, retried by Ray when its worker dies: a retried rank
resumes from its last complete shard), each running the same code as a rank of any other job system
(tokenizer_service.tools.pretokenize.run with rank R of W). When all are done the ranks are merged.
`--ray local` starts a Ray on this machine bound to 127.0.0.1 only, without a dashboard: by default Ray
would listen on and advertise the machine's non-loopback address. (Ray Data with actors hung on 2 CPUs when tried: plain
tasks, one a rank, are all this needs.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from tokenizer_service.core.environment import usable_cpus
from tokenizer_service.tools.pretokenize.ranks import merge
from tokenizer_service.tools.pretokenize.run import Options
from tokenizer_service.tools.pretokenize.sources import InputError

TASK_RETRIES = 3


def _rank(options: Options, rank: int, world_size: int) -> dict[str, Any]:
    """One rank, inside a Ray worker; the summary as plain data."""
    from tokenizer_service.tools.pretokenize.run import run

    summary = run(dataclasses.replace(options, rank=rank, world_size=world_size), report_bad=lambda message: None)
    return {"rank": rank, "documents": summary.documents, "tokens": summary.tokens, "seconds": summary.seconds}


def run_on_ray(
    options: Options, address: str, world_size: int, *, report: Callable[[str], None] = print
) -> dict[str, Any]:
    """Run every rank as a Ray task, report each as it finishes, merge; the merged metadata."""
    try:
        import ray
    except ImportError:
        raise InputError("--ray needs Ray: pip install 'tokenizer-service[ray]'") from None
    started_here = not ray.is_initialized()
    if started_here:
        if address == "local":
            ray.init(
                num_cpus=max(usable_cpus(), options.workers),  # a rank that asks for more would never start
                include_dashboard=False,
                _node_ip_address="127.0.0.1",
                log_to_driver=False,
            )
        else:
            ray.init(address=address, log_to_driver=False)
    try:
        task = ray.remote(num_cpus=options.workers, max_retries=TASK_RETRIES)(_rank)
        pending = {task.remote(options, rank, world_size): rank for rank in range(world_size)}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            for reference in done:
                rank = pending.pop(reference)
                result = ray.get(reference)
                report(
                    f"rank {rank} of {world_size} done: {result['documents']:,} documents, {result['tokens']:,} tokens "
                    f"in {result['seconds']:.1f} s ({world_size - len(pending)}/{world_size})"
                )
        return merge(options.output)
    finally:
        if started_here:
            ray.shutdown()
