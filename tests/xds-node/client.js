'use strict';
/*
 * A proxyless gRPC client for Ballast's xDS tests, on @grpc/grpc-js-xds: the Node
 * counterpart of tests/xds/client.py (Python grpcio), driven the same way.
 *
 * Usage: GRPC_XDS_BOOTSTRAP=bootstrap.json node client.js [--tls-sidecar] xds:///SERVICE
 *
 * The channel resolves the target through the aggregator's ADS server (Listener, then
 * RouteConfiguration, Cluster, ClusterLoadAssignment) and balances with the policy the
 * Cluster names. Commands arrive one per line on standard input:
 *
 *     round N SECONDS [fast]   send at most N unary calls, for at most SECONDS, one at
 *                              a time; waiting for the channel to be ready unless
 *                              "fast" (then a call fails at once, with the reason)
 *
 * and each is answered with one JSON line on standard output:
 *
 *     {"sent": N, "counts": {"backend": calls, ...}, "errors": {"CODE": calls},
 *      "details": {"CODE": "first message"}, "seconds": S}
 *
 * The backends answer with their names, so the counts are per backend. The client
 * ends when its standard input closes.
 *
 * --tls-sidecar: @grpc/grpc-js-xds 1.14 accepts only the channel_creds types
 * "google_default" and "insecure" in its bootstrap, so it cannot reach an xDS server
 * over TLS with a CA of one's own (the "tls" type that grpcio and grpc-go take). With
 * this flag the script does what a TLS-originating sidecar would: it reads the "tls"
 * entry of the bootstrap named by GRPC_XDS_BOOTSTRAP, listens on a loopback port,
 * forwards every connection to the bootstrap's server_uri over TLS with that entry's
 * CA (and client certificate, if any), checking the server's certificate, and hands
 * grpc-js-xds the same bootstrap pointing at the loopback port with "insecure"
 * credentials (GRPC_XDS_BOOTSTRAP_CONFIG). Without the flag the bootstrap is used as
 * written.
 */

const fs = require('fs');
const net = require('net');
const tls = require('tls');
const readline = require('readline');

/** Splits `host:port` or `[v6]:port`. */
function splitHostPort(uri) {
  const m = /^\[([^\]]+)\]:(\d+)$/.exec(uri) || /^([^:]+):(\d+)$/.exec(uri);
  if (!m) {
    throw new Error(`server_uri is not host:port: ${uri}`);
  }
  return { host: m[1], port: Number(m[2]) };
}

/**
 * Starts the TLS sidecar for the bootstrap in GRPC_XDS_BOOTSTRAP and points
 * grpc-js-xds at it. Resolves once the loopback port listens.
 */
function startTlsSidecar() {
  const path = process.env.GRPC_XDS_BOOTSTRAP;
  if (!path) {
    throw new Error('--tls-sidecar needs GRPC_XDS_BOOTSTRAP');
  }
  const bootstrap = JSON.parse(fs.readFileSync(path, 'utf8'));
  const server = bootstrap.xds_servers[0];
  const creds = server.channel_creds.find((c) => c.type === 'tls');
  if (!creds) {
    throw new Error('--tls-sidecar: the bootstrap has no channel_creds of type "tls"');
  }
  const config = creds.config || {};
  const upstream = splitHostPort(server.server_uri);
  const options = {
    host: upstream.host,
    port: upstream.port,
    ca: fs.readFileSync(config.ca_certificate_file),
    ALPNProtocols: ['h2'],
    rejectUnauthorized: true,
  };
  if (config.certificate_file) {
    options.cert = fs.readFileSync(config.certificate_file);
    options.key = fs.readFileSync(config.private_key_file);
  }
  if (!net.isIP(upstream.host)) {
    options.servername = upstream.host;
  }
  const sidecar = net.createServer((local) => {
    const remote = tls.connect(options);
    const close = (err) => {
      if (err) {
        process.stderr.write(`tls sidecar: ${err.message}\n`);
      }
      local.destroy();
      remote.destroy();
    };
    local.on('error', close);
    remote.on('error', close);
    local.on('close', () => remote.destroy());
    remote.on('close', () => local.destroy());
    local.pipe(remote);
    remote.pipe(local);
  });
  return new Promise((resolve, reject) => {
    sidecar.on('error', reject);
    sidecar.listen(0, '127.0.0.1', () => {
      sidecar.unref();
      const port = sidecar.address().port;
      server.server_uri = `127.0.0.1:${port}`;
      server.channel_creds = [{ type: 'insecure' }];
      process.env.GRPC_XDS_BOOTSTRAP_CONFIG = JSON.stringify(bootstrap);
      delete process.env.GRPC_XDS_BOOTSTRAP;
      process.stderr.write(`tls sidecar: 127.0.0.1:${port} -> ${upstream.host}:${upstream.port}\n`);
      resolve();
    });
  });
}

function main() {
  const args = process.argv.slice(2);
  const sidecar = args[0] === '--tls-sidecar';
  if (sidecar) {
    args.shift();
  }
  if (args.length !== 1) {
    process.stderr.write('usage: client.js [--tls-sidecar] xds:///SERVICE\n');
    process.exit(2);
  }
  const start = sidecar ? startTlsSidecar() : Promise.resolve();
  start.then(() => serve(args[0])).catch((e) => {
    process.stderr.write(`client.js: ${e.stack || e}\n`);
    process.exit(1);
  });
}

async function serve(target) {
  // Loaded after the sidecar has set the bootstrap: grpc-js-xds reads it when the
  // first xds: channel resolves.
  const grpc = require('@grpc/grpc-js');
  require('@grpc/grpc-js-xds').register();
  const statusName = {};
  for (const [name, code] of Object.entries(grpc.status)) {
    statusName[code] = name;
  }
  const client = new grpc.Client(target, grpc.credentials.createInsecure());
  const identity = (b) => b;
  const empty = Buffer.alloc(0);

  function call(timeoutSeconds, waitForReady) {
    return new Promise((resolve) => {
      // waitForReady: the first calls queue while the xDS resources arrive and the
      // subchannels connect, instead of failing fast.
      const metadata = new grpc.Metadata({ waitForReady });
      const deadline = new Date(Date.now() + timeoutSeconds * 1000);
      client.makeUnaryRequest('/ballast.test.Echo/Who', identity, identity, empty, metadata,
        { deadline }, (err, reply) => resolve(err ? { err } : { name: reply.toString() }));
    });
  }

  async function round(n, budget, waitForReady) {
    const counts = {};
    const errors = {};
    const details = {};
    const startMs = Date.now();
    const deadline = startMs + budget * 1000;
    let sent = 0;
    while (sent < n) {
      const left = (deadline - Date.now()) / 1000;
      if (left <= 0) {
        break;
      }
      sent += 1;
      const r = await call(Math.min(5, left), waitForReady);
      if (r.err) {
        const code = statusName[r.err.code] || String(r.err.code);
        errors[code] = (errors[code] || 0) + 1;
        if (!(code in details)) {
          details[code] = r.err.details || r.err.message;
        }
      } else {
        counts[r.name] = (counts[r.name] || 0) + 1;
      }
    }
    return {
      sent,
      counts,
      errors,
      details,
      seconds: Math.round(Date.now() - startMs) / 1000,
    };
  }

  const rl = readline.createInterface({ input: process.stdin, terminal: false });
  for await (const line of rl) {
    const words = line.trim().split(/\s+/).filter((w) => w);
    if (words.length === 0) {
      continue;
    }
    let out;
    if (words[0] === 'round' && (words.length === 3 || (words.length === 4 && words[3] === 'fast'))) {
      out = await round(Number(words[1]), Number(words[2]), words.length === 3);
    } else {
      out = { error: `unknown command: ${line.trim()}` };
    }
    process.stdout.write(JSON.stringify(out) + '\n');
  }
  client.close();
  process.exit(0);
}

main();
