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

    inflight_server.py serve ... --metrics
        Also counts every call in a server interceptor as go-grpc-prometheus does
        (grpc_server_started_total when the call reaches the server,
        grpc_server_handled_total{grpc_code} when it is answered; handled is registered
        first, so a page renders it before started, as Go's client does by sorting)
        and serves them with prometheus_client on 127.0.0.1. Prints "metrics N" too.
        Each time the page renders, between the two families, the count of calls
        inside the handler at that instant is copied to offset 4 of FILE (a u32) and
        the renders are counted at offset 8 (a u64): the truth at the scrape's instant.

    inflight_server.py serve-http --state FILE [--service-ms 20]
        The same handler behind HTTP/1.1 with keep-alive (a thread per connection):
        every GET sleeps and answers 200; the count in FILE covers a request from its
        parsed head until its response is written. Prints "port N".

    inflight_server.py load-http --target 127.0.0.1:N --channels C
                                 [--think-ms 5] [--duration 30]
        C keep-alive HTTP/1.1 connections, each making GET after GET with an
        exponentially distributed pause of mean --think-ms between them. Prints
        "ready" once every connection has had its first answer.

All run until killed (or --duration seconds for the loads).
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


def true_count(path):
    """The in-flight count kept in the mmap'd file at `path`: returns a lock (also for
    the caller's own shared state), `add(delta)` and `note_render()`, which copies the
    count to offset 4 and counts the copies at offset 8 (a u64): the metrics page calls
    it while it renders, so that the truth at the instant of a scrape is known."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    os.ftruncate(fd, 16)
    state = mmap.mmap(fd, 16)
    lock = threading.Lock()
    inflight = [0]
    renders = [0]

    def add(delta):
        with lock:
            inflight[0] += delta
            struct.pack_into("<I", state, 0, inflight[0])

    def note_render():
        with lock:
            renders[0] += 1
            struct.pack_into("<I", state, 4, inflight[0])
            struct.pack_into("<Q", state, 8, renders[0])

    return lock, add, note_render


def serve(args):
    lock, add, note_render = true_count(args.state)
    rng = random.Random(args.seed)

    def work(request, context):
        add(1)
        try:
            with lock:
                delay = rng.expovariate(1000.0 / args.service_ms)
            time.sleep(delay)
            return request
        finally:
            add(-1)

    interceptors = []
    if args.metrics:
        interceptor, metrics_port = generic_service.metrics_interceptor(note_render)
        print(f"metrics {metrics_port}", flush=True)
        interceptors.append(interceptor)
    server, port = generic_service.start(
        "ballast.Inflight", work, args.workers, args.port, interceptors
    )
    if port == 0:
        sys.exit(f"cannot bind 127.0.0.1:{args.port}")
    print(f"port {port}", flush=True)
    server.wait_for_termination()


def serve_http(args):
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    lock, add, _ = true_count(args.state)
    rng = random.Random(args.seed)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # The head and the body go out in two writes: with Nagle's algorithm the body
        # would wait for the peer's delayed ACK (40 ms), long after the handler left.
        disable_nagle_algorithm = True

        def do_GET(self):
            # Owed from the parsed request until the whole response is written: what a
            # proxy in front sees as the server's part of the request.
            add(1)
            try:
                with lock:
                    delay = rng.expovariate(1000.0 / args.service_ms)
                time.sleep(delay)
                body = b"ok\n"
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            finally:
                add(-1)

        def log_message(self, *a):
            pass

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 256

        def handle_error(self, request, client_address):
            # A load generator killed between rows resets its connections: not news.
            pass

    httpd = Server(("127.0.0.1", args.port), Handler)
    print(f"port {httpd.server_address[1]}", flush=True)
    httpd.serve_forever()


def load_http(args):
    import http.client

    stop = time.monotonic() + args.duration
    host, port = args.target.rsplit(":", 1)
    conns = []
    for _ in range(args.channels):
        c = http.client.HTTPConnection(host, int(port), timeout=30)
        c.request("GET", "/")
        c.getresponse().read()
        conns.append(c)
    print("ready", flush=True)

    def caller(c, seed):
        rng = random.Random(seed)
        while time.monotonic() < stop:
            try:
                c.request("GET", "/")
                c.getresponse().read()
            except (OSError, http.client.HTTPException) as e:
                print(f"request failed: {e}", file=sys.stderr, flush=True)
                c.close()
                time.sleep(0.1)
            if args.think_ms > 0:
                time.sleep(rng.expovariate(1000.0 / args.think_ms))

    threads = [
        threading.Thread(target=caller, args=(c, i), daemon=True) for i, c in enumerate(conns)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


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
    s.add_argument("--metrics", action="store_true")
    h = sub.add_parser("serve-http")
    h.add_argument("--state", required=True)
    h.add_argument("--port", type=int, default=0)
    h.add_argument("--service-ms", type=float, default=20.0)
    h.add_argument("--seed", type=int, default=1)
    lh = sub.add_parser("load-http")
    lh.add_argument("--target", required=True)
    lh.add_argument("--channels", type=int, default=1)
    lh.add_argument("--think-ms", type=float, default=5.0)
    lh.add_argument("--duration", type=float, default=30.0)
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
    elif args.mode == "serve-http":
        serve_http(args)
    elif args.mode == "load-http":
        load_http(args)
    else:
        load(args)


if __name__ == "__main__":
    main()
