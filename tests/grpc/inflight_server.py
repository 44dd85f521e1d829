#!/usr/bin/env python3
"""A gRPC server that knows its true in-flight count, and a load generator for it.

Used to measure how well the agent's TCP in-flight count (connections owed a response,
from tcp_info) follows the real number of outstanding calls when HTTP/2 multiplexes
several calls on one connection. No protoc: the method is registered with a generic
handler and carries raw bytes.

    inflight_server.py serve --state FILE [--port 0] [--service-ms 20]
        Serves /ballast.Inflight/Work. Each call sleeps an exponentially distributed
        time of mean --service-ms and answers. The number of calls inside the handler
        is kept, as a little-endian u32, at offset 0 of FILE (an mmap, so a reader sees
        it change without any call to this process). Prints "port N" once listening.

    inflight_server.py load --target 127.0.0.1:N --channels C --callers K
                            [--think-ms 5] [--duration 30]
        C channels, each its own TCP connection, with K callers each making blocking
        unary calls in a loop with an exponentially distributed pause of mean
        --think-ms between calls. Prints "ready" once every channel is connected.

Both run until killed (or --duration seconds for load).
"""

import argparse
import mmap
import os
import random
import struct
import sys
import threading
import time

import grpc

import generic_service

METHOD = "/ballast.Inflight/Work"


def serve(args):
    fd = os.open(args.state, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    os.ftruncate(fd, 8)
    state = mmap.mmap(fd, 8)
    lock = threading.Lock()
    inflight = [0]
    rng = random.Random(args.seed)

    def add(delta):
        with lock:
            inflight[0] += delta
            struct.pack_into("<I", state, 0, inflight[0])

    def work(request, context):
        add(1)
        try:
            with lock:
                delay = rng.expovariate(1000.0 / args.service_ms)
            time.sleep(delay)
            return request
        finally:
            add(-1)

    server, port = generic_service.start("ballast.Inflight", work, args.workers, args.port)
    if port == 0:
        sys.exit(f"cannot bind 127.0.0.1:{args.port}")
    print(f"port {port}", flush=True)
    server.wait_for_termination()


def load(args):
    stop = time.monotonic() + args.duration
    channels = []
    for i in range(args.channels):
        # A local subchannel pool: without it, channels to one target share one
        # connection, which would make every configuration a single connection.
        ch = grpc.insecure_channel(
            args.target,
            options=[("grpc.use_local_subchannel_pool", 1), ("grpc.channel_id", i)],
        )
        grpc.channel_ready_future(ch).result(timeout=10)
        channels.append(ch)
    print("ready", flush=True)

    def caller(ch, seed):
        rng = random.Random(seed)
        call = ch.unary_unary(
            METHOD, request_serializer=generic_service.identity, response_deserializer=generic_service.identity
        )
        payload = b"x" * args.payload
        while time.monotonic() < stop:
            try:
                call(payload, timeout=30)
            except grpc.RpcError as e:
                print(f"call failed: {e}", file=sys.stderr, flush=True)
                time.sleep(0.1)
            if args.think_ms > 0:
                time.sleep(rng.expovariate(1000.0 / args.think_ms))

    threads = []
    for c, ch in enumerate(channels):
        for k in range(args.callers):
            t = threading.Thread(target=caller, args=(ch, c * 1000 + k), daemon=True)
            t.start()
            threads.append(t)
    for t in threads:
        t.join()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--state", required=True)
    s.add_argument("--port", type=int, default=0)
    s.add_argument("--service-ms", type=float, default=20.0)
    s.add_argument("--workers", type=int, default=256)
    s.add_argument("--seed", type=int, default=1)
    lo = sub.add_parser("load")
    lo.add_argument("--target", required=True)
    lo.add_argument("--channels", type=int, default=1)
    lo.add_argument("--callers", type=int, default=1)
    lo.add_argument("--think-ms", type=float, default=5.0)
    lo.add_argument("--duration", type=float, default=30.0)
    lo.add_argument("--payload", type=int, default=64)
    args = p.parse_args()
    if args.mode == "serve":
        serve(args)
    else:
        load(args)


if __name__ == "__main__":
    main()
