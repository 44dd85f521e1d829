#!/usr/bin/env python3
"""A CPU-bound gRPC service that knows its true in-flight count, and an open-loop
proxyless gRPC load generator for it.

Used by tests/tests/grpc_service.rs: a real agent with its shipped defaults measures
such a service (connections owed a response, CPU of the process) while a proxyless
gRPC client spreads calls by the weights the aggregator serves over xDS. No protoc: the
method is registered with a generic handler and carries raw bytes.

    cpu_service.py serve --state FILE --name NAME --burn-ms B [--sleep-ms S] [--metrics]
        Serves /ballast.Cpu/Work on a free port of 127.0.0.1. Each call burns B ms of
        its thread's CPU time (so a node that burns more per call is a slower node,
        whatever else runs on the machine), then sleeps S ms (a downstream call), and
        answers with NAME. FILE (an mmap, read without any call to this process) holds:
            offset  0  u32  calls inside the handler now (the true in-flight count)
            offset  8  f64  CPU seconds of the whole process (time.process_time())
            offset 16  u64  calls answered
            offset 24  u64  calls started (entered the handler)
        all little-endian. With --metrics it also counts every call with
        py-grpc-prometheus' server interceptor, as go-grpc-prometheus does
        (grpc_server_started_total, grpc_server_handled_total) and serves the counters
        with prometheus_client on a free loopback port. Prints
        "port N pid P" (and " metrics M" with --metrics) once listening, then serves
        until its standard input closes. A line "stall MS" on its standard input makes
        every call that starts from then on sleep MS ms instead of burning and sleeping
        (a node stalled on I/O: low CPU, piling-up calls); "stall 0" ends the stall.
        Each command is answered with a line "ok".

    cpu_service.py load --target xds:///SERVICE --rate R --channels C --duration D
        C channels, each with its own connections (a local subchannel pool), each
        driven by one thread that starts calls at exponentially distributed intervals
        of mean C/R seconds without waiting for the answers (an open loop: HTTP/2
        multiplexes the calls that overlap on a connection). Before the open loop, one
        call per channel waits for the xDS resources and the connections; then it
        prints "ready". After D seconds (or when its standard input closes) it waits
        up to 5 s for the calls still out and prints one JSON line: calls started,
        answered per backend name, failed per status code, shed (more than --max-out
        outstanding on a channel), latency percentiles, and seconds.
"""

import argparse
import collections
import json
import mmap
import os
import random
import struct
import sys
import threading
import time

import grpc

import generic_service

METHOD = "/ballast.Cpu/Work"
STATE_BYTES = 32


def exit_when_stdin_closes():
    """The test holds the pipe: when it goes, so does this process."""

    def watch():
        try:
            sys.stdin.read()
        finally:
            os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


def commands(stall):
    """Reads "stall MS" lines from standard input into `stall[0]` (seconds), answering
    each with "ok"; exits the process when standard input closes."""

    def read():
        try:
            for line in sys.stdin:
                words = line.split()
                if len(words) == 2 and words[0] == "stall":
                    stall[0] = float(words[1]) / 1000.0
                    print("ok", flush=True)
                else:
                    print(f"unknown command {line.strip()!r}", flush=True)
        finally:
            os._exit(0)

    threading.Thread(target=read, daemon=True).start()


def serve(args):
    fd = os.open(args.state, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    os.ftruncate(fd, STATE_BYTES)
    state = mmap.mmap(fd, STATE_BYTES)
    lock = threading.Lock()
    inflight = [0]
    answered = [0]
    started = [0]
    stall = [0.0]
    name = args.name.encode()
    burn = args.burn_ms / 1000.0
    sleep = args.sleep_ms / 1000.0

    def publish_cpu():
        struct.pack_into("<d", state, 8, time.process_time())

    def enter():
        with lock:
            inflight[0] += 1
            started[0] += 1
            struct.pack_into("<I", state, 0, inflight[0])
            struct.pack_into("<Q", state, 24, started[0])

    def leave():
        with lock:
            inflight[0] -= 1
            answered[0] += 1
            struct.pack_into("<I", state, 0, inflight[0])
            struct.pack_into("<Q", state, 16, answered[0])
            publish_cpu()

    def work(request, context):
        enter()
        try:
            stalled = stall[0]
            if stalled > 0:
                time.sleep(stalled)
                return name
            # Thread CPU time, not wall time: the call costs the same CPU however
            # many other calls (or other processes) share the core.
            end = time.thread_time() + burn
            x = 0
            while time.thread_time() < end:
                x += 1
            if sleep > 0:
                time.sleep(sleep)
            return name
        finally:
            leave()

    def cpu_clock():
        # The CPU figure stays current while no call ends (an idle node).
        while True:
            with lock:
                publish_cpu()
            time.sleep(0.01)

    interceptors = []
    metrics = ""
    if args.metrics:
        interceptor, metrics_port = generic_service.metrics_interceptor()
        interceptors.append(interceptor)
        metrics = f" metrics {metrics_port}"
    server, port = generic_service.start("ballast.Cpu", work, args.workers, 0, interceptors)
    if port == 0:
        sys.exit(f"{args.name}: cannot bind a port on 127.0.0.1")
    threading.Thread(target=cpu_clock, daemon=True).start()
    print(f"port {port} pid {os.getpid()}{metrics}", flush=True)
    commands(stall)
    server.wait_for_termination()


def load(args):
    exit_when_stdin_closes()
    channels = []
    for i in range(args.channels):
        # A local subchannel pool: without it, every channel to a backend shares one
        # connection, and all the calls would be multiplexed on it.
        channels.append(
            grpc.insecure_channel(
                args.target,
                options=[("grpc.use_local_subchannel_pool", 1), ("grpc.channel_id", i)],
            )
        )
    calls = [
        ch.unary_unary(METHOD, request_serializer=generic_service.identity, response_deserializer=generic_service.identity)
        for ch in channels
    ]
    payload = b"x" * args.payload
    for call in calls:
        # The first call of a channel waits for the xDS resources and the connection.
        call(payload, timeout=args.ready_timeout, wait_for_ready=True)
    print("ready", flush=True)

    lock = threading.Lock()
    counts = collections.Counter()
    errors = collections.Counter()
    latencies = []
    started = [0]
    shed = [0]
    outstanding = [0] * len(calls)
    t0 = time.monotonic()
    stop = t0 + args.duration

    def done(fut, i, t_start):
        elapsed = time.monotonic() - t_start
        with lock:
            outstanding[i] -= 1
            try:
                counts[fut.result().decode()] += 1
                latencies.append(elapsed)
            except grpc.RpcError as e:
                errors[str(e.code())] += 1
            except Exception as e:  # a cancelled future, say
                errors[type(e).__name__] += 1

    def driver(i, call):
        rng = random.Random(args.seed * 1000 + i)
        mean_gap = len(calls) / args.rate
        next_at = time.monotonic()
        while True:
            next_at += rng.expovariate(1.0 / mean_gap)
            if next_at >= stop:
                return
            wait = next_at - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            with lock:
                if outstanding[i] >= args.max_out:
                    shed[0] += 1
                    continue
                outstanding[i] += 1
                started[0] += 1
            t_start = time.monotonic()
            fut = call.future(payload, timeout=args.call_timeout)
            fut.add_done_callback(lambda f, i=i, t=t_start: done(f, i, t))

    threads = [
        threading.Thread(target=driver, args=(i, call), daemon=True)
        for i, call in enumerate(calls)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    drain_until = time.monotonic() + 5.0
    while time.monotonic() < drain_until:
        with lock:
            if sum(outstanding) == 0:
                break
        time.sleep(0.01)
    with lock:
        lat = sorted(latencies)

        def pct(q):
            return round(1000.0 * lat[min(len(lat) - 1, int(q * len(lat)))], 2) if lat else None

        out = {
            "sent": started[0],
            "counts": dict(counts),
            "errors": dict(errors),
            "shed": shed[0],
            "still_out": sum(outstanding),
            "p50_ms": pct(0.50),
            "p99_ms": pct(0.99),
            "seconds": round(time.monotonic() - t0, 3),
        }
    print(json.dumps(out), flush=True)
    for ch in channels:
        ch.close()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--state", required=True)
    s.add_argument("--name", required=True)
    s.add_argument("--burn-ms", type=float, required=True)
    s.add_argument("--sleep-ms", type=float, default=0.0)
    s.add_argument("--workers", type=int, default=64)
    s.add_argument("--metrics", action="store_true")
    lo = sub.add_parser("load")
    lo.add_argument("--target", required=True)
    lo.add_argument("--rate", type=float, required=True)
    lo.add_argument("--channels", type=int, default=4)
    lo.add_argument("--duration", type=float, required=True)
    lo.add_argument("--max-out", type=int, default=200)
    lo.add_argument("--payload", type=int, default=64)
    lo.add_argument("--call-timeout", type=float, default=5.0)
    lo.add_argument("--ready-timeout", type=float, default=20.0)
    lo.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    if args.mode == "serve":
        serve(args)
    else:
        load(args)


if __name__ == "__main__":
    main()
