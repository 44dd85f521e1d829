"""A proxyless gRPC client for the xDS test.

Usage: GRPC_XDS_BOOTSTRAP=bootstrap.json client.py xds:///SERVICE

The channel resolves the target through the aggregator's ADS server (Listener, then
RouteConfiguration, Cluster, ClusterLoadAssignment) and balances with the policy the
Cluster names. Commands arrive one per line on standard input:

    round N SECONDS   send at most N unary calls, for at most SECONDS, one at a time

and each is answered with one JSON line on standard output:

    {"sent": N, "counts": {"backend": calls, ...}, "errors": {"CODE": calls}, "seconds": S}

The backends answer with their names, so the counts are per backend. The client ends
when its standard input closes.
"""

import collections
import json
import sys
import time

import grpc


def round_of(call, n, budget):
    counts = collections.Counter()
    errors = collections.Counter()
    start = time.monotonic()
    deadline = start + budget
    sent = 0
    while sent < n:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        sent += 1
        try:
            # wait_for_ready: the first calls queue while the xDS resources arrive
            # and the subchannels connect, instead of failing fast.
            name = call(b"", timeout=min(5.0, left), wait_for_ready=True)
            counts[name.decode()] += 1
        except grpc.RpcError as e:
            errors[str(e.code())] += 1
    return {
        "sent": sent,
        "counts": counts,
        "errors": errors,
        "seconds": round(time.monotonic() - start, 3),
    }


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: client.py xds:///SERVICE")
    channel = grpc.insecure_channel(sys.argv[1])
    call = channel.unary_unary("/ballast.test.Echo/Who")
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "round" and len(words) == 3:
            out = round_of(call, int(words[1]), float(words[2]))
        else:
            out = {"error": f"unknown command: {line.strip()}"}
        print(json.dumps(out), flush=True)
    channel.close()


if __name__ == "__main__":
    main()
