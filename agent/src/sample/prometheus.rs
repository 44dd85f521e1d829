//! In-flight requests as a gauge scraped from the service's Prometheus endpoint.
//!
//! More precise than counting connections (it counts requests, and works behind
//! connection pools), at the cost of the service exporting such a gauge.
//!
//! The scrape is a plain blocking HTTP/1.0 GET on a `std` socket: the endpoint is
//! local, the agent must stay small, and HTTP/1.0 means the reply is never chunked (a
//! chunked reply is still decoded, for servers that ignore the version).

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use super::{InflightSource, SampleError};

/// How long connecting, and then receiving the whole response, may each take. Short,
/// because a scrape that hangs delays the load report, and the endpoint is local.
pub const TIMEOUT: Duration = Duration::from_secs(1);

/// The largest body accepted. A metrics page is kilobytes; anything near this is a
/// misconfigured URL, and the agent must not buffer it.
pub(crate) const MAX_BODY: usize = 4 << 20;

/// Room for the status line and headers on top of the body.
const MAX_HEADERS: usize = 64 << 10;

/// An `http://host[:port]/path` URL. Only what the scraper needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpUrl {
    /// Host name or address; IPv6 without brackets.
    pub host: String,
    /// Port, 80 when the URL has none.
    pub port: u16,
    /// Path and query, starting with `/`.
    pub path: String,
}

impl HttpUrl {
    /// Parses a URL. `https` is refused: a local scrape needs no TLS, and carrying a TLS
    /// client for it would double the agent's size.
    pub fn parse(url: &str) -> Result<Self, SampleError> {
        let invalid = |why: &str| SampleError::InvalidSpec(format!("url {url:?}: {why}"));
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| invalid("only http:// URLs are supported"))?;
        let (authority, path) = match rest.find(['/', '?']) {
            Some(i) if rest[i..].starts_with('/') => (&rest[..i], rest[i..].to_string()),
            Some(i) => (&rest[..i], format!("/{}", &rest[i..])),
            None => (rest, "/".to_string()),
        };
        if authority.contains('@') {
            return Err(invalid("credentials in the URL are not supported"));
        }
        let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
            let (host, after) = v6.split_once(']').ok_or_else(|| invalid("unclosed `[`"))?;
            match after {
                "" => (host, None),
                p => (
                    host,
                    Some(p.strip_prefix(':').ok_or_else(|| invalid("bad port"))?),
                ),
            }
        } else {
            match authority.rsplit_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (authority, None),
            }
        };
        if host.is_empty() {
            return Err(invalid("no host"));
        }
        let port = match port {
            Some(p) => p
                .parse::<u16>()
                .ok()
                .filter(|p| *p > 0)
                .ok_or_else(|| invalid("bad port"))?,
            None => 80,
        };
        if path.chars().any(|c| c.is_ascii_control() || c == ' ') {
            return Err(invalid("the path must be URL-encoded"));
        }
        Ok(HttpUrl {
            host: host.to_string(),
            port,
            path,
        })
    }

    /// The `Host` header value.
    fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

/// Whether `name` is a classic Prometheus metric name, `[a-zA-Z_:][a-zA-Z0-9_:]*`.
pub(crate) fn is_valid_metric_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

/// Sums every sample of `metric` in Prometheus text-format `text`, whatever its labels.
///
/// Summing makes a gauge split by handler or worker (`inflight{handler="/a"}`) count as
/// the service total. `# ` comment lines are skipped. Values are anything Rust's float
/// parser takes, which covers the format's `1.5e3`, `+Inf` and `NaN`.
///
/// Errors rather than returning a number that would look like an idle node:
/// - a `NaN`, infinite or negative sample: the exporter is broken (an in-flight gauge
///   decremented more than incremented), and its count means nothing;
/// - a metric that is neither sampled nor declared: a typo in the name would otherwise
///   read as zero load forever. A metric declared by `# TYPE` or `# HELP` with no
///   samples (a labelled gauge before its first request, in some client libraries) is 0.
pub fn parse_gauge(text: &str, metric: &str) -> Result<f64, SampleError> {
    let what = || format!("metric {metric}");
    let mut sum = 0.0f64;
    let mut seen = false;
    let mut declared = false;
    for (i, line) in text.lines().enumerate() {
        let line = line.trim_start();
        if let Some(comment) = line.strip_prefix('#') {
            let mut words = comment.split_whitespace();
            if matches!(words.next(), Some("TYPE" | "HELP")) && words.next() == Some(metric) {
                declared = true;
            }
            continue;
        }
        let Some(after_name) = line.strip_prefix(metric) else {
            continue;
        };
        // `metric` is a prefix of `metric_total` too: only `{` or a blank ends the name.
        let rest = if let Some(labels) = after_name.strip_prefix('{') {
            let end = label_set_end(labels).ok_or_else(|| {
                SampleError::parse(what(), format!("line {}: unterminated labels", i + 1))
            })?;
            &labels[end..]
        } else if after_name.starts_with([' ', '\t']) {
            after_name
        } else {
            continue;
        };
        let value = rest.split_whitespace().next().ok_or_else(|| {
            SampleError::parse(what(), format!("line {}: no value: {line:?}", i + 1))
        })?;
        let v: f64 = value.parse().map_err(|_| {
            SampleError::parse(what(), format!("line {}: bad value {value:?}", i + 1))
        })?;
        if !v.is_finite() || v < 0.0 {
            return Err(SampleError::parse(
                what(),
                format!("line {}: value {value} is not a usable count", i + 1),
            ));
        }
        sum += v;
        seen = true;
    }
    if seen || declared {
        Ok(sum)
    } else {
        Err(SampleError::NotFound(format!(
            "metric {metric} is not in the scraped page"
        )))
    }
}

/// The offset just past the `}` closing a label set that starts after `{`, skipping
/// `}` inside quoted label values (which may contain escaped quotes).
fn label_set_end(labels: &str) -> Option<usize> {
    let mut in_quotes = false;
    let mut escaped = false;
    for (i, c) in labels.char_indices() {
        match (in_quotes, escaped, c) {
            (true, true, _) => escaped = false,
            (true, false, '\\') => escaped = true,
            (true, false, '"') => in_quotes = false,
            (false, _, '"') => in_quotes = true,
            (false, _, '}') => return Some(i + 1),
            _ => {}
        }
    }
    None
}

/// Extracts the body from a raw HTTP/1.x response: checks the status is 2xx, honours
/// `Content-Length`, decodes `Transfer-Encoding: chunked`, and refuses compressed
/// bodies (never asked for) and bodies over [`MAX_BODY`]. `url` names it in errors.
pub(crate) fn parse_http_response(raw: &[u8], url: &str) -> Result<Vec<u8>, SampleError> {
    let err = |why: String| SampleError::Http(format!("GET {url}: {why}"));
    let (head_len, sep_len) = match find(raw, b"\r\n\r\n") {
        Some(i) => (i, 4),
        None => find(raw, b"\n\n")
            .map(|i| (i, 2))
            .ok_or_else(|| err("response ends inside the headers".into()))?,
    };
    let head = String::from_utf8_lossy(&raw[..head_len]);
    let mut lines = head.lines();
    let status_line = lines.next().unwrap_or("");
    let mut parts = status_line.split_whitespace();
    let status = match (parts.next(), parts.next()) {
        (Some(v), Some(code)) if v.starts_with("HTTP/") => code
            .parse::<u16>()
            .map_err(|_| err(format!("bad status line {status_line:?}")))?,
        _ => return Err(err(format!("bad status line {status_line:?}"))),
    };
    if !(200..300).contains(&status) {
        return Err(err(format!("status {}", status_line.trim())));
    }
    let mut content_length = None;
    let mut chunked = false;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        match name.trim().to_ascii_lowercase().as_str() {
            "content-length" => {
                content_length = Some(
                    value
                        .parse::<usize>()
                        .map_err(|_| err(format!("bad Content-Length {value:?}")))?,
                )
            }
            "transfer-encoding" => {
                chunked = value.to_ascii_lowercase().contains("chunked");
            }
            "content-encoding" if !value.eq_ignore_ascii_case("identity") => {
                return Err(err(format!("unsupported Content-Encoding {value:?}")));
            }
            _ => {}
        }
    }
    let body = &raw[head_len + sep_len..];
    let body = if chunked {
        decode_chunked(body).map_err(err)?
    } else if let Some(len) = content_length {
        body.get(..len)
            .ok_or_else(|| err(format!("body is {} bytes, expected {len}", body.len())))?
            .to_vec()
    } else {
        body.to_vec()
    };
    if body.len() > MAX_BODY {
        return Err(err(format!("body larger than {MAX_BODY} bytes")));
    }
    Ok(body)
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn decode_chunked(mut data: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    loop {
        let line_end = find(data, b"\r\n").ok_or("chunk size line not terminated")?;
        let size_line = String::from_utf8_lossy(&data[..line_end]);
        // Chunk extensions follow a `;` and mean nothing to us.
        let size_hex = size_line.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_hex, 16)
            .map_err(|_| format!("bad chunk size {size_hex:?}"))?;
        data = &data[line_end + 2..];
        if size == 0 {
            return Ok(out);
        }
        if out.len().saturating_add(size) > MAX_BODY {
            return Err(format!("body larger than {MAX_BODY} bytes"));
        }
        let chunk = data.get(..size).ok_or("truncated chunk")?;
        out.extend_from_slice(chunk);
        data = data
            .get(size..)
            .and_then(|d| d.strip_prefix(b"\r\n"))
            .ok_or("chunk not followed by CRLF")?;
    }
}

/// Performs one GET and returns the body.
pub fn http_get(url: &HttpUrl, original: &str) -> Result<Vec<u8>, SampleError> {
    let err = |why: String| SampleError::Http(format!("GET {original}: {why}"));
    // Resolution has no timeout of its own; endpoints are local addresses or names in
    // /etc/hosts in practice.
    let addrs = (url.host.as_str(), url.port)
        .to_socket_addrs()
        .map_err(|e| err(format!("resolving {}: {e}", url.host)))?;
    let mut last = None;
    let mut stream = None;
    for addr in addrs {
        match TcpStream::connect_timeout(&addr, TIMEOUT) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last = Some(format!("connecting to {addr}: {e}")),
        }
    }
    let mut stream = stream
        .ok_or_else(|| err(last.unwrap_or_else(|| format!("{} has no address", url.host))))?;
    let deadline = Instant::now() + TIMEOUT;
    let io = |e: std::io::Error| {
        if matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ) {
            err(format!("no complete response within {TIMEOUT:?}"))
        } else {
            err(e.to_string())
        }
    };
    stream.set_write_timeout(Some(TIMEOUT)).map_err(io)?;
    let _ = stream.set_nodelay(true);
    let request = format!(
        "GET {} HTTP/1.0\r\nHost: {}\r\nUser-Agent: ballast-agent\r\n\
         Accept: text/plain;version=0.0.4\r\nConnection: close\r\n\r\n",
        url.path,
        url.authority()
    );
    stream.write_all(request.as_bytes()).map_err(io)?;
    // A per-read timeout alone would let a server trickling a byte a second hold the
    // report loop forever, so every read gets only what is left of one overall budget.
    let limit = MAX_BODY + MAX_HEADERS;
    let mut raw = Vec::with_capacity(16 << 10);
    let mut buf = [0u8; 16 << 10];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(err(format!("no complete response within {TIMEOUT:?}")));
        }
        stream.set_read_timeout(Some(left)).map_err(io)?;
        let n = match stream.read(&mut buf) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(io(e)),
        };
        if n == 0 {
            break;
        }
        if raw.len() + n > limit {
            return Err(err(format!("response larger than {limit} bytes")));
        }
        raw.extend_from_slice(&buf[..n]);
    }
    parse_http_response(&raw, original)
}

/// A gauge scraped from a Prometheus endpoint, summed over label sets and rounded.
#[derive(Debug)]
pub(crate) struct PrometheusInflight {
    original: String,
    url: HttpUrl,
    metric: String,
}

impl PrometheusInflight {
    /// Validates the URL and metric name. Does not scrape: the service may start after
    /// the agent, and the first sample reports the problem if it is still there.
    pub(crate) fn new(url: &str, metric: &str) -> Result<Self, SampleError> {
        if !is_valid_metric_name(metric) {
            return Err(SampleError::InvalidSpec(format!(
                "metric {metric:?}: must match [a-zA-Z_:][a-zA-Z0-9_:]*"
            )));
        }
        Ok(PrometheusInflight {
            original: url.to_string(),
            url: HttpUrl::parse(url)?,
            metric: metric.to_string(),
        })
    }
}

impl InflightSource for PrometheusInflight {
    fn sample(&mut self) -> Result<u32, SampleError> {
        let body = http_get(&self.url, &self.original)?;
        let text = String::from_utf8(body)
            .map_err(|_| SampleError::parse(self.original.clone(), "body is not UTF-8"))?;
        let sum = parse_gauge(&text, &self.metric)?;
        // Rounds a fractional gauge; `as` saturates values beyond u32.
        Ok(sum.round() as u32)
    }

    fn describe(&self) -> String {
        format!("prometheus {}#{}", self.original, self.metric)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    const PAGE: &str = r#"# HELP http_inflight Requests in flight.
# TYPE http_inflight gauge
http_inflight{handler="/a"} 3
http_inflight{handler="/b",note="has } brace and \"quote\""} 1.5e1
http_inflight 2 1712345678000
http_inflight_total 1000
http_inflight_max{x="y"} 50
other_metric 7
  # indented comment http_inflight 99
"#;

    #[test]
    fn sums_all_label_sets_of_the_metric_only() {
        assert_eq!(parse_gauge(PAGE, "http_inflight").unwrap(), 20.0);
        assert_eq!(parse_gauge(PAGE, "http_inflight_total").unwrap(), 1000.0);
        assert_eq!(parse_gauge(PAGE, "other_metric").unwrap(), 7.0);
    }

    #[test]
    fn declared_but_empty_is_zero_and_absent_is_an_error() {
        let page = "# HELP inflight In flight.\n# TYPE inflight gauge\nfoo 1\n";
        assert_eq!(parse_gauge(page, "inflight").unwrap(), 0.0);
        let err = parse_gauge(page, "inflite").unwrap_err();
        assert!(matches!(err, SampleError::NotFound(_)));
        assert!(err.to_string().contains("inflite"), "{err}");
    }

    #[test]
    fn unusable_values_are_errors_not_zero() {
        for page in [
            "m NaN\n",
            "m +Inf\n",
            "m -1\n",
            "m{a=\"b\"} 1\nm{a=\"c\"} -3\n",
            "m\n",
            "m{a=\"b\" 1\n",
            "m twelve\n",
        ] {
            assert!(parse_gauge(page, "m").is_err(), "{page:?}");
        }
        assert_eq!(parse_gauge("m 1.5e3\nm 0.25\n", "m").unwrap(), 1500.25);
    }

    #[test]
    fn urls() {
        let u = HttpUrl::parse("http://127.0.0.1:9100/metrics").unwrap();
        assert_eq!(
            (u.host.as_str(), u.port, u.path.as_str()),
            ("127.0.0.1", 9100, "/metrics")
        );
        let u = HttpUrl::parse("http://localhost").unwrap();
        assert_eq!(
            (u.host.as_str(), u.port, u.path.as_str()),
            ("localhost", 80, "/")
        );
        let u = HttpUrl::parse("http://[::1]:9100/m?x=1").unwrap();
        assert_eq!(
            (u.host.as_str(), u.port, u.path.as_str()),
            ("::1", 9100, "/m?x=1")
        );
        assert_eq!(u.authority(), "[::1]:9100");
        let u = HttpUrl::parse("http://h:81?x").unwrap();
        assert_eq!(u.path, "/?x");
        for bad in [
            "https://h/m",
            "h:80/m",
            "http://",
            "http://:80/",
            "http://h:0/",
            "http://h:99999/",
            "http://h:x/",
            "http://[::1/",
            "http://u:p@h/",
            "http://h/a b",
        ] {
            assert!(HttpUrl::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn http_responses() {
        let ok = b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nm 1\n";
        assert_eq!(parse_http_response(ok, "u").unwrap(), b"m 1\n");
        let sized = b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nm 1\nTRAILING";
        assert_eq!(parse_http_response(sized, "u").unwrap(), b"m 1\n");
        let chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n\
                        3\r\nm 1\r\n4;ext=1\r\n2\nm \r\n1\r\n3\r\n0\r\n\r\n";
        assert_eq!(parse_http_response(chunked, "u").unwrap(), b"m 12\nm 3");

        let err = parse_http_response(b"HTTP/1.1 503 Unavailable\r\n\r\n", "http://x/m")
            .unwrap_err()
            .to_string();
        assert!(err.contains("503") && err.contains("http://x/m"), "{err}");
        for bad in [
            &b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort"[..],
            b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\n\r\n\x1f\x8b",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n",
            b"garbage\r\n\r\n",
            b"HTTP/1.1 301 Moved\r\nLocation: /x\r\n\r\n",
        ] {
            assert!(parse_http_response(bad, "u").is_err(), "{bad:?}");
        }
        let mut huge = b"HTTP/1.0 200 OK\r\n\r\n".to_vec();
        huge.resize(huge.len() + MAX_BODY + 1, b'#');
        assert!(parse_http_response(&huge, "u").is_err());
    }

    /// Serves `reply` to one connection after reading the request, on a real socket.
    fn serve_once(reply: Vec<u8>, delay: Duration) -> (String, std::thread::JoinHandle<String>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/metrics", listener.local_addr().unwrap());
        let handle = std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            let mut req = Vec::new();
            let mut buf = [0u8; 1024];
            while !req.ends_with(b"\r\n\r\n") {
                let n = conn.read(&mut buf).unwrap();
                if n == 0 {
                    break;
                }
                req.extend_from_slice(&buf[..n]);
            }
            std::thread::sleep(delay);
            let _ = conn.write_all(&reply);
            String::from_utf8_lossy(&req).into_owned()
        });
        (url, handle)
    }

    #[test]
    fn scrapes_a_real_local_endpoint() {
        let reply =
            format!("HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n\r\n{PAGE}");
        let (url, server) = serve_once(reply.into_bytes(), Duration::ZERO);
        let mut src = PrometheusInflight::new(&url, "http_inflight").unwrap();
        assert_eq!(src.sample().unwrap(), 20);
        let request = server.join().unwrap();
        assert!(
            request.starts_with("GET /metrics HTTP/1.0\r\n"),
            "{request}"
        );
        assert!(request.contains("\r\nHost: 127.0.0.1:"), "{request}");
        assert!(src.describe().contains("http_inflight"));
    }

    #[test]
    fn a_slow_endpoint_times_out() {
        let reply = b"HTTP/1.0 200 OK\r\n\r\nm 1\n".to_vec();
        let (url, server) = serve_once(reply, Duration::from_millis(2500));
        let mut src = PrometheusInflight::new(&url, "m").unwrap();
        let started = Instant::now();
        let err = src.sample().unwrap_err();
        assert!(started.elapsed() < Duration::from_millis(2000));
        assert!(matches!(err, SampleError::Http(_)));
        assert!(err.to_string().contains(&url), "{err}");
        let _ = server.join();
    }

    #[test]
    fn a_closed_port_is_an_error() {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let url = format!("http://127.0.0.1:{port}/metrics");
        let mut src = PrometheusInflight::new(&url, "m").unwrap();
        let err = src.sample().unwrap_err();
        assert!(matches!(err, SampleError::Http(_)), "{err}");
        assert!(PrometheusInflight::new(&url, "bad-name").is_err());
    }
}
