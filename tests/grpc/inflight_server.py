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
        Also counts every call with py-grpc-prometheus' server interceptor, as
        go-grpc-prometheus does (grpc_server_started_total when the call reaches the
        server, grpc_server_handled_total{grpc_code} when it is answered; handled is
        registered first, so a page renders it before started, as Go's client does by
        sorting) and serves them with prometheus_client on 127.0.0.1. Prints
        "metrics N" too.
        Each time the page renders, between the two families, the count of calls
        inside the handler at that instant is copied to offset 4 of FILE (a u32) and
        the renders are counted at offset 8 (a u64): the truth at the scrape's instant.

    inflight_server.py serve-http --state FILE [--service-ms 20]
        The same handler behind HTTP/1.1 with keep-alive (a thread per connection):
        every GET sleeps and answers 200; the count in FILE covers a request from its
        parsed head until its response is written. Prints "port N".

    inflight_server.py serve-otel --state FILE [--service-ms 20]
        The same HTTP/1.1 server, its handler a WSGI application wrapped in
        OpenTelemetry's WSGI middleware (opentelemetry-instrumentation-wsgi), which
        keeps http.server.active_requests; the SDK's Prometheus exporter
        (opentelemetry-exporter-prometheus) serves it as http_server_active_requests
        on 127.0.0.1. The count in FILE covers the application's call, as the
        middleware's does. Prints "metrics N", then "port N"; offsets 4 and 8 of FILE
        hold the truth at each render and the renders, as with serve --metrics.

    inflight_server.py load-http --target 127.0.0.1:N --channels C
                                 [--think-ms 5] [--duration 30]
        C keep-alive HTTP/1.1 connections, each making GET after GET with an
        exponentially distributed pause of mean --think-ms between them. Prints
        "ready" once every connection has had its first answer.

Both loads take --steps F1,F2,... [--step-ms 400]: from "ready" on, the callers step
through these fractions of their number (rounded up, at least one), each held
--step-ms, in turn, so that the true count varies within a run; a caller waits its
turn between calls. The callers join and leave spread over the connections (caller k
of connection c is the (k*C + c)-th to join). Without --steps every caller runs
throughout.

All run until killed (or --duration seconds for the loads).
"""

import argparse
import math
import mmap
import os
import random
import struct
import sys
import threading
import time

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


class Steps:
    """Which callers may call now: `fractions` of `callers` (rounded up, at least one),
    each held `step_ms`, in turn, from `start()` on. At most 16 steps."""

    def __init__(self, fractions, step_ms, callers):
        values = [float(f) for f in fractions.split(",")] if fractions else [1.0]
        if not 1 <= len(values) <= 16 or any(not 0.0 < f <= 1.0 for f in values):
            sys.exit(f"--steps: 1 to 16 fractions in (0, 1], got {fractions!r}")
        if step_ms <= 0:
            sys.exit(f"--step-ms: must be positive, got {step_ms}")
        self.levels = [max(1, math.ceil(f * callers - 1e-9)) for f in values]
        self.step = step_ms / 1000.0
        self.t0 = time.monotonic()

    def start(self):
        self.t0 = time.monotonic()

    def wait_turn(self, rank, stop):
        """Returns True once caller `rank` may call, False when the load's time is up."""
        while True:
            now = time.monotonic()
            if now >= stop:
                return False
            i = int((now - self.t0) / self.step)
            if rank < self.levels[i % len(self.levels)]:
                return True
            time.sleep(min(self.t0 + (i + 1) * self.step - now, stop - now) + 0.0005)


def serve(args):
    import generic_service

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


def http_server(port, handle):
    """A threading HTTP/1.1 server with keep-alive on 127.0.0.1:`port`: every GET is
    `handle(handler)`, which writes the whole response."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # The head and the body go out in two writes: with Nagle's algorithm the body
        # would wait for the peer's delayed ACK (40 ms), long after the handler left.
        disable_nagle_algorithm = True

        def do_GET(self):
            handle(self)

        def log_message(self, *a):
            pass

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 256

        def handle_error(self, request, client_address):
            # A load generator killed between rows resets its connections: not news.
            pass

    return Server(("127.0.0.1", port), Handler)


def serve_http(args):
    lock, add, _ = true_count(args.state)
    rng = random.Random(args.seed)

    def handle(h):
        # Owed from the parsed request until the whole response is written: what a
        # proxy in front sees as the server's part of the request.
        add(1)
        try:
            with lock:
                delay = rng.expovariate(1000.0 / args.service_ms)
            time.sleep(delay)
            body = b"ok\n"
            h.send_response(200)
            h.send_header("Content-Length", str(len(body)))
            h.end_headers()
            h.wfile.write(body)
        finally:
            add(-1)

    httpd = http_server(args.port, handle)
    print(f"port {httpd.server_address[1]}", flush=True)
    httpd.serve_forever()


def serve_otel(args):
    import socket

    import prometheus_client as prom
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from opentelemetry.instrumentation.wsgi import OpenTelemetryMiddleware
    from opentelemetry.sdk.metrics import MeterProvider

    lock, add, note_render = true_count(args.state)
    rng = random.Random(args.seed)

    def work(environ, start_response):
        # Counted for the application's call, as the middleware counts it.
        add(1)
        try:
            with lock:
                delay = rng.expovariate(1000.0 / args.service_ms)
            time.sleep(delay)
            body = b"ok\n"
            start_response("200 OK", [("Content-Length", str(len(body)))])
            return [body]
        finally:
            add(-1)

    # The reader registers its collector with prometheus_client's registry; the
    # collector registered after it notes the truth right after the SDK's snapshot.
    provider = MeterProvider(metric_readers=[PrometheusMetricReader()])

    class Rendering:
        def collect(self):
            note_render()
            return []

        def describe(self):
            return []

    prom.REGISTRY.register(Rendering())
    app = OpenTelemetryMiddleware(work, meter_provider=provider)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        metrics_port = s.getsockname()[1]
    prom.start_http_server(metrics_port, addr="127.0.0.1")
    print(f"metrics {metrics_port}", flush=True)

    def handle(h):
        host, port = h.server.server_address[:2]
        environ = {
            "REQUEST_METHOD": h.command,
            "SCRIPT_NAME": "",
            "PATH_INFO": h.path.split("?", 1)[0],
            "QUERY_STRING": h.path.split("?", 1)[1] if "?" in h.path else "",
            "SERVER_NAME": host,
            "SERVER_PORT": str(port),
            "SERVER_PROTOCOL": h.request_version,
            "REMOTE_ADDR": h.client_address[0],
            "wsgi.version": (1, 0),
            "wsgi.url_scheme": "http",
            "wsgi.input": h.rfile,
            "wsgi.errors": sys.stderr,
            "wsgi.multithread": True,
            "wsgi.multiprocess": False,
            "wsgi.run_once": False,
        }
        for k, v in h.headers.items():
            environ["HTTP_" + k.upper().replace("-", "_")] = v
        response = []

        def start_response(status, headers, exc_info=None):
            response[:] = [status, headers]

        body = b"".join(app(environ, start_response))
        status, headers = response
        h.send_response(int(status.split()[0]))
        for k, v in headers:
            h.send_header(k, v)
        h.end_headers()
        h.wfile.write(body)

    httpd = http_server(args.port, handle)
    print(f"port {httpd.server_address[1]}", flush=True)
    httpd.serve_forever()


def load_http(args):
    import http.client

    stop = time.monotonic() + args.duration
    host, port = args.target.rsplit(":", 1)
    conns = [http.client.HTTPConnection(host, int(port), timeout=30) for _ in range(args.channels)]

    failed = []

    def first(c):
        try:
            c.request("GET", "/")
            c.getresponse().read()
        except (OSError, http.client.HTTPException) as e:
            failed.append(e)

    # Every connection's first request at once: one after another, 48 of them would
    # take 48 service times before the load starts.
    openers = [threading.Thread(target=first, args=(c,), daemon=True) for c in conns]
    for t in openers:
        t.start()
    for t in openers:
        t.join()
    if failed:
        sys.exit(f"{len(failed)} of {len(conns)} connections had no first answer: {failed[0]}")
    steps = Steps(args.steps, args.step_ms, args.channels)
    print("ready", flush=True)
    steps.start()

    def caller(c, rank):
        rng = random.Random(rank)
        while steps.wait_turn(rank, stop):
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
    import grpc

    import generic_service

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
    steps = Steps(args.steps, args.step_ms, args.channels * args.callers)
    print("ready", flush=True)
    steps.start()

    def caller(ch, rank, seed):
        rng = random.Random(seed)
        call = ch.unary_unary(
            METHOD, request_serializer=generic_service.identity, response_deserializer=generic_service.identity
        )
        payload = b"x" * args.payload
        while steps.wait_turn(rank, stop):
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
            rank = k * args.channels + c
            t = threading.Thread(target=caller, args=(ch, rank, c * 1000 + k), daemon=True)
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
    for mode in ("serve-http", "serve-otel"):
        h = sub.add_parser(mode)
        h.add_argument("--state", required=True)
        h.add_argument("--port", type=int, default=0)
        h.add_argument("--service-ms", type=float, default=20.0)
        h.add_argument("--seed", type=int, default=1)
    lh = sub.add_parser("load-http")
    lh.add_argument("--target", required=True)
    lh.add_argument("--channels", type=int, default=1)
    lo = sub.add_parser("load")
    lo.add_argument("--target", required=True)
    lo.add_argument("--channels", type=int, default=1)
    lo.add_argument("--callers", type=int, default=1)
    lo.add_argument("--payload", type=int, default=64)
    for ld in (lh, lo):
        ld.add_argument("--think-ms", type=float, default=5.0)
        ld.add_argument("--duration", type=float, default=30.0)
        ld.add_argument("--steps", default="")
        ld.add_argument("--step-ms", type=float, default=400.0)
    args = p.parse_args()
    if args.mode == "serve":
        serve(args)
    elif args.mode == "serve-http":
        serve_http(args)
    elif args.mode == "serve-otel":
        serve_otel(args)
    elif args.mode == "load-http":
        load_http(args)
    else:
        load(args)


if __name__ == "__main__":
    main()
