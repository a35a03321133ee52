"""What the front door costs a search: bearer-token auth + admission control + TLS, as a
ratio to the same search on a plain gateway, measured in one run.

    .venv/bin/python -m bench.front_door [--rounds 6] [--seconds 4] [--concurrency 8]
        [--docs 5000]

One real stack: a redis-server, one index shard process (IVF-PQ trained on the SciFact
document embeddings of ``../shared/data``, the documents ingested through the change
log), and two gateway processes on that same shard and Redis, with the in-process
encoder (all-MiniLM-L6-v2), differing only in their front door:

- plain: ``--no-auth``, no ``--max-in-flight``, plaintext;
- front door: ``--read-tokens-file``/``--write-tokens-file`` (every call carries a
  bearer token, checked against both sets), ``--max-in-flight 256`` (admission counted
  on every call), and TLS on its port (``--tls-cert``/``--tls-key``; the client trusts
  the throwaway CA of ``services/stack/certs.py``).

The client (this process, grpc.aio, ``--concurrency`` calls in flight, one channel per
gateway, as a real client keeps) sends the same SciFact queries to both, in rounds that
alternate plain / front door (the order flips every pair) so both see the same machine
(``--together`` drives both at once instead). Two figures:

- ``search``: Search, k=10 (encode + shard + document fetch): the goal, ≥ 0.9;
- ``get``: Get of one document (one Redis read, no encoder): where a front-door cost
  would show most plainly.

Per figure: calls/s and p50/p99 latency of each gateway (medians over the rounds) and
``ratio``: the median over the rounds of front-door calls/s ÷ plain calls/s in the
same round (``pair_ratios``; ``ratio_of_medians`` beside it). The gateway → shard hop
is plaintext in both (the front door is what is measured; mTLS between our services is
not part of this figure). Prints one JSON line last. The stack and the rounds are
bench/gateway_pair.py's, shared with bench.generation_cost.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from bench import gateway_pair as pair

TOKEN = "bench-front-door-token"


async def _measure(
    plain: str, front: str, certs: Any, data: pair.SciFact, args: Any
) -> dict[str, Any]:
    import grpc

    from services.rpc.auth import bearer_metadata
    from services.rpc.tls import ClientTLS, aio_channel

    metadata = bearer_metadata(TOKEN)
    async with (
        grpc.aio.insecure_channel(plain) as plain_ch,
        aio_channel(front, ClientTLS(certs.ca)) as front_ch,
    ):
        targets = {"plain": (plain_ch, ()), "front_door": (front_ch, metadata)}
        result: dict[str, Any] = {}
        for name, make, over in (
            ("search", pair.search_call, data.queries),
            ("get", pair.get_call, data.ids),
        ):
            calls = {k: make(ch, over, md) for k, (ch, md) in targets.items()}
            # the two rounds of a pair ran at the same time (--together) or back to back:
            # the load of a shared machine drifts between pairs more than within one
            rounds = await pair.alternating_rounds(calls, args, together=args.together)
            compared = pair.compare(rounds, "front_door", "plain")
            figures = {k: compared[k] for k in targets}
            ratio = compared["ratio"]
            result[name] = {
                **compared,
                "ratio_of_medians": round(
                    figures["front_door"]["per_s"] / figures["plain"]["per_s"], 3
                ),
            }
            print(
                f"{name:<7} plain {figures['plain']['per_s']:8.1f}/s "
                f"(p50 {figures['plain']['p50_ms']:.2f} ms, p99 {figures['plain']['p99_ms']:.2f})"
                f"   front door {figures['front_door']['per_s']:8.1f}/s "
                f"(p50 {figures['front_door']['p50_ms']:.2f} ms, "
                f"p99 {figures['front_door']['p99_ms']:.2f})   ratio {ratio:.3f}",
                flush=True,
            )
        return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    pair.add_round_flags(parser)
    parser.add_argument(
        "--together",
        action="store_true",
        help="Drive both gateways at the same time in each round (default: one after the "
        "other). Not a fair comparison on a loaded machine: the two processes do not get "
        "equal shares of the cores (one run gave a Get ratio of 4.5).",
    )
    args = parser.parse_args(argv)

    from services.rpc.tls import ClientTLS
    from services.stack.certs import make_certs
    from tests.support.processes import free_port

    pair.check_prerequisites()
    with pair.work_dir("bench-front-door-", args.keep) as work:
        data = pair.load_scifact(args.docs)
        index_dir = pair.train(data, work)
        certs = make_certs(work / "certs")
        tokens = work / "tokens"
        tokens.write_text(f"{TOKEN}\n", encoding="utf-8")
        with pair.one_shard(index_dir, data, work) as (store, shard_proc):
            plain = f"127.0.0.1:{free_port()}"
            front = f"localhost:{free_port()}"
            plain_argv = [*pair.gateway_argv(store.url, shard_proc.address, plain), "--no-auth"]
            front_argv = [
                *pair.gateway_argv(store.url, shard_proc.address, front),
                "--read-tokens-file",
                str(tokens),
                "--write-tokens-file",
                str(tokens),
                "--max-in-flight",
                "256",
                "--tls-cert",
                str(certs.server_cert),
                "--tls-key",
                str(certs.server_key),
            ]
            with (
                pair.process(plain_argv, work / "plain.log") as plain_proc,
                pair.process(front_argv, work / "front.log") as front_proc,
            ):
                pair.wait_healthy(plain, plain_proc, work / "plain.log", "plain gateway")
                pair.wait_healthy(
                    front,
                    front_proc,
                    work / "front.log",
                    "front-door gateway",
                    tls=ClientTLS(certs.ca),
                )
                result = asyncio.run(_measure(plain, front, certs, data, args))
    print(
        pair.json_line("front_door", result, args, len(data.docs), goal=0.9, together=args.together)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
