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

use super::expr::{Expr, Selector};
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

/// Sums every sample of `metric` in `text`, whatever its labels: the expression of one
/// bare term ([`evaluate`] has the rules).
///
/// Summing makes a gauge split by handler or worker (`inflight{handler="/a"}`) count as
/// the service total.
pub fn parse_gauge(text: &str, metric: &str) -> Result<f64, SampleError> {
    let expr = Expr {
        terms: vec![(
            false,
            Selector {
                metric: metric.to_string(),
                matchers: Vec::new(),
            },
        )],
    };
    evaluate(text, &expr).map(|e| e.value)
}

/// What one term of an expression read from a page.
#[derive(Debug, Clone, PartialEq)]
pub struct TermValue {
    /// Subtracted rather than added.
    pub negated: bool,
    /// The term as written.
    pub selector: String,
    /// The family's `# TYPE`, when the page declares one.
    pub kind: Option<String>,
    /// The sum of the selected series.
    pub sum: f64,
    /// How many series were selected.
    pub count: usize,
    /// The first [`MAX_LISTED`] selected series, as `name{labels} value`.
    pub series: Vec<String>,
}

/// An expression's value and how it was derived.
#[derive(Debug, Clone, PartialEq)]
pub struct Evaluation {
    /// The signed sum of the terms: finite, and never below zero.
    pub value: f64,
    /// Each term's part.
    pub terms: Vec<TermValue>,
}

impl Evaluation {
    /// One line: `a{..} 120 (3 series) - b 117 (3 series) = 3`.
    pub fn derivation(&self) -> String {
        let mut out = String::new();
        for (i, t) in self.terms.iter().enumerate() {
            if i > 0 {
                out.push_str(if t.negated { " - " } else { " + " });
            }
            let kind = t
                .kind
                .as_deref()
                .map_or(String::new(), |k| format!("{k}, "));
            out.push_str(&format!(
                "{} {} ({kind}{} series)",
                t.selector,
                fmt_number(t.sum),
                t.count
            ));
        }
        out.push_str(&format!(" = {}", fmt_number(self.value)));
        out
    }
}

/// How many series of a term [`Evaluation`] keeps to show.
pub const MAX_LISTED: usize = 16;

/// A value as the page would print it: integers without a fraction.
fn fmt_number(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v:.0}")
    } else {
        format!("{v}")
    }
}

/// A sample line's metric name and what follows it, or `None` for a line that is not a
/// sample (blank).
fn split_name(line: &str) -> Option<(&str, &str)> {
    let end = line
        .find(|c: char| c == '{' || c.is_whitespace())
        .unwrap_or(line.len());
    (end > 0).then(|| (&line[..end], &line[end..]))
}

/// A series' labels, in the page's order.
type Labels = Vec<(String, String)>;

/// Parses the label set after `{`: `name="value"` pairs, comma separated (a trailing
/// comma allowed), values with `\"`, `\\` and `\n` escapes. Returns the labels and what
/// follows the closing `}`.
fn parse_labels(after_brace: &str) -> Result<(Labels, &str), String> {
    let mut labels = Vec::new();
    let mut rest = after_brace;
    loop {
        rest = rest.trim_start();
        if let Some(r) = rest.strip_prefix('}') {
            return Ok((labels, r));
        }
        let name_end = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .ok_or("unterminated labels")?;
        let name = &rest[..name_end];
        if name.is_empty() || name.starts_with(|c: char| c.is_ascii_digit()) {
            return Err(format!("bad label name at {:?}", truncate(rest)));
        }
        rest = rest[name_end..].trim_start();
        rest = rest
            .strip_prefix('=')
            .ok_or_else(|| format!("expected `=` after label {name}"))?
            .trim_start();
        rest = rest
            .strip_prefix('"')
            .ok_or_else(|| format!("expected a quoted value for label {name}"))?;
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let close = loop {
            match chars.next() {
                None => return Err("unterminated labels".into()),
                Some((i, '"')) => break i,
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, c)) => value.push(c),
                    None => return Err("unterminated labels".into()),
                },
                Some((_, c)) => value.push(c),
            }
        };
        labels.push((name.to_string(), value));
        rest = rest[close + 1..].trim_start();
        if let Some(r) = rest.strip_prefix(',') {
            rest = r;
        } else if !rest.starts_with('}') {
            return Err(format!("expected `,` or `}}` after label {name}"));
        }
    }
}

fn truncate(s: &str) -> &str {
    match s.char_indices().nth(24) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

/// Evaluates `expr` on a page in the Prometheus text format or OpenMetrics.
///
/// - A term reads the samples named as it is; for a family declared `# TYPE NAME
///   counter` (OpenMetrics' counters), a term naming the family reads its `NAME_total`
///   samples. `_created` and other suffixes are other names, never read.
/// - `# EOF` ends the page (OpenMetrics). Lines of metrics no term reads are skipped
///   unparsed, so that one exporter's odd line elsewhere does not break the source.
/// - A selected sample that is `NaN`, infinite or negative is an error: the exporter is
///   broken and its count means nothing. So is a sum that overflows.
/// - A term whose metric is neither sampled nor declared (`# TYPE`, `# HELP`) is an
///   error: a typo in the name would otherwise read as zero load forever. A declared
///   metric without samples, or whose samples the matchers all reject, is 0 (a labelled
///   counter before its first call, in most client libraries).
/// - A result below zero is an error ([`SampleError::Negative`]), never clamped: a
///   difference of counters below zero means they were not read together.
pub fn evaluate(text: &str, expr: &Expr) -> Result<Evaluation, SampleError> {
    let page = text.split("\n# EOF").next().unwrap_or(text);
    let page = if page.starts_with("# EOF") { "" } else { page };
    // The families' declarations, first: OpenMetrics names counters by family.
    let mut declared: Vec<(&str, Option<&str>)> = Vec::new();
    for line in page.lines() {
        let Some(comment) = line.trim_start().strip_prefix('#') else {
            continue;
        };
        let mut words = comment.split_whitespace();
        match (words.next(), words.next()) {
            (Some("TYPE"), Some(name)) => declared.push((name, words.next())),
            (Some("HELP"), Some(name)) => declared.push((name, None)),
            _ => {}
        }
    }
    let kind_of = |name: &str| {
        declared
            .iter()
            .filter(|(n, _)| *n == name)
            .find_map(|(_, k)| *k)
    };
    // For each term, the sample names it reads and its family's type.
    let reads: Vec<(Vec<String>, Option<String>, bool)> = expr
        .terms
        .iter()
        .map(|(_, sel)| {
            let m = sel.metric.as_str();
            let mut names = vec![m.to_string()];
            let mut kind = kind_of(m);
            if kind == Some("counter") {
                names.push(format!("{m}_total"));
            }
            let family = m.strip_suffix("_total");
            if kind.is_none() {
                kind = family.and_then(kind_of);
            }
            let known = declared.iter().any(|(n, _)| *n == m || Some(*n) == family);
            (names, kind.map(str::to_string), known)
        })
        .collect();
    let mut terms: Vec<TermValue> = expr
        .terms
        .iter()
        .zip(&reads)
        .map(|((negated, sel), (_, kind, _))| TermValue {
            negated: *negated,
            selector: sel.to_string(),
            kind: kind.clone(),
            sum: 0.0,
            count: 0,
            series: Vec::new(),
        })
        .collect();
    let mut sampled = vec![false; terms.len()];
    for (i, line) in page.lines().enumerate() {
        let line = line.trim_start();
        if line.starts_with('#') {
            continue;
        }
        let Some((name, after_name)) = split_name(line) else {
            continue;
        };
        if !reads
            .iter()
            .any(|(names, _, _)| names.iter().any(|n| n == name))
        {
            continue;
        }
        let at = |why: String| {
            SampleError::parse(format!("metric {name}"), format!("line {}: {why}", i + 1))
        };
        let (labels, rest) = match after_name.strip_prefix('{') {
            Some(l) => parse_labels(l).map_err(at)?,
            None => (Vec::new(), after_name),
        };
        let value = rest
            .split_whitespace()
            .next()
            .ok_or_else(|| at(format!("no value: {line:?}")))?;
        let v: f64 = value
            .parse()
            .map_err(|_| at(format!("bad value {value:?}")))?;
        if !v.is_finite() || v < 0.0 {
            return Err(at(format!("value {value} is not a usable count")));
        }
        for (t, ((names, _, _), (_, sel))) in reads.iter().zip(&expr.terms).enumerate() {
            if !names.iter().any(|n| n == name) {
                continue;
            }
            sampled[t] = true;
            if !sel.selects(&labels) {
                continue;
            }
            let term = &mut terms[t];
            term.sum += v;
            term.count += 1;
            if term.series.len() < MAX_LISTED {
                let labels: Vec<String> = labels
                    .iter()
                    .map(|(k, v)| format!("{k}=\"{}\"", super::expr::escape(v)))
                    .collect();
                let labels = if labels.is_empty() {
                    String::new()
                } else {
                    format!("{{{}}}", labels.join(","))
                };
                term.series.push(format!("{name}{labels} {value}"));
            }
        }
    }
    for (t, (_, _, known)) in reads.iter().enumerate() {
        if !sampled[t] && !known {
            return Err(SampleError::NotFound(format!(
                "metric {} is not in the scraped page",
                expr.terms[t].1.metric
            )));
        }
    }
    let value: f64 = terms
        .iter()
        .map(|t| if t.negated { -t.sum } else { t.sum })
        .sum();
    let eval = Evaluation { value, terms };
    if !value.is_finite() {
        return Err(SampleError::parse(
            "expression",
            format!("the sum overflows: {}", eval.derivation()),
        ));
    }
    if value < 0.0 {
        return Err(SampleError::Negative(eval.derivation()));
    }
    Ok(eval)
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

/// An expression over a Prometheus endpoint's series, evaluated on every scrape and
/// rounded.
#[derive(Debug)]
pub(crate) struct PrometheusInflight {
    original: String,
    url: HttpUrl,
    expr: Expr,
    /// What `describe` calls it: `prometheus URL#EXPR`, or the preset's name.
    label: String,
    last: Option<Evaluation>,
}

impl PrometheusInflight {
    /// Validates the URL and parses the expression. Does not scrape: the service may
    /// start after the agent, and the first sample reports the problem if it is still
    /// there.
    pub(crate) fn new(url: &str, expr: &str) -> Result<Self, SampleError> {
        let label = format!("prometheus {url}#{expr}");
        Self::with_label(url, expr, label)
    }

    /// The same, described as `label` (a preset's name and expansion).
    pub(crate) fn with_label(url: &str, expr: &str, label: String) -> Result<Self, SampleError> {
        Ok(PrometheusInflight {
            original: url.to_string(),
            url: HttpUrl::parse(url)?,
            expr: Expr::parse(expr)?,
            label,
            last: None,
        })
    }
}

impl InflightSource for PrometheusInflight {
    fn sample(&mut self) -> Result<u32, SampleError> {
        self.last = None;
        let body = http_get(&self.url, &self.original)?;
        let text = String::from_utf8(body)
            .map_err(|_| SampleError::parse(self.original.clone(), "body is not UTF-8"))?;
        let eval = evaluate(&text, &self.expr)?;
        // Rounds a fractional gauge; `as` saturates values beyond u32.
        let n = eval.value.round() as u32;
        self.last = Some(eval);
        Ok(n)
    }

    fn describe(&self) -> String {
        self.label.clone()
    }

    fn detail(&self) -> Option<String> {
        self.last.as_ref().map(Evaluation::derivation)
    }

    fn series(&self) -> Vec<String> {
        let Some(eval) = &self.last else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for t in &eval.terms {
            let sign = if t.negated { '-' } else { '+' };
            for s in &t.series {
                out.push(format!("{sign} {s}"));
            }
            if t.count > t.series.len() {
                out.push(format!(
                    "{sign} ... {} more series of {}",
                    t.count - t.series.len(),
                    t.selector
                ));
            }
        }
        out
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

    fn eval(page: &str, expr: &str) -> Result<Evaluation, SampleError> {
        evaluate(page, &Expr::parse(expr).unwrap())
    }

    /// go-grpc-prometheus' counters in the Prometheus text format (Go's client sorts the
    /// families by name, so `handled` is rendered before `started`).
    const GRPC: &str = r#"# HELP grpc_server_handled_total Total number of RPCs completed on the server.
# TYPE grpc_server_handled_total counter
grpc_server_handled_total{grpc_code="OK",grpc_method="Get",grpc_service="shop.Cart",grpc_type="unary"} 110
grpc_server_handled_total{grpc_code="Unavailable",grpc_method="Get",grpc_service="shop.Cart",grpc_type="unary"} 7
grpc_server_handled_total{grpc_code="OK",grpc_method="Check",grpc_service="grpc.health.v1.Health",grpc_type="unary"} 50
# HELP grpc_server_started_total Total number of RPCs started on the server.
# TYPE grpc_server_started_total counter
grpc_server_started_total{grpc_method="Get",grpc_service="shop.Cart",grpc_type="unary"} 120
grpc_server_started_total{grpc_method="Put",grpc_service="shop.Cart",grpc_type="unary"} 0
grpc_server_started_total{grpc_method="Check",grpc_service="grpc.health.v1.Health",grpc_type="unary"} 51
"#;

    #[test]
    fn a_difference_of_counters_with_matchers() {
        let cart = r#"grpc_server_started_total{grpc_service="shop.Cart"} - grpc_server_handled_total{grpc_service="shop.Cart"}"#;
        let e = eval(GRPC, cart).unwrap();
        assert_eq!(e.value, 3.0);
        assert_eq!((e.terms[0].count, e.terms[1].count), (2, 2));
        assert_eq!(e.terms[0].kind.as_deref(), Some("counter"));
        assert_eq!(
            e.derivation(),
            "grpc_server_started_total{grpc_service=\"shop.Cart\"} 120 (counter, 2 series) - \
             grpc_server_handled_total{grpc_service=\"shop.Cart\"} 117 (counter, 2 series) = 3"
        );
        assert!(e.terms[1].series[1].contains(r#"grpc_code="Unavailable""#));
        let all = eval(
            GRPC,
            "grpc_server_started_total - grpc_server_handled_total",
        )
        .unwrap();
        assert_eq!(all.value, 4.0);
        let health = r#"grpc_server_started_total{grpc_service=~"grpc\.health\..*"} - grpc_server_handled_total{grpc_service!="shop.Cart"}"#;
        assert_eq!(eval(GRPC, health).unwrap().value, 1.0);
        let sum = r#"grpc_server_started_total{grpc_method=~"Get|Put"} + grpc_server_started_total{grpc_method!~"Get|Put"}"#;
        assert_eq!(eval(GRPC, sum).unwrap().value, 171.0);
    }

    #[test]
    fn a_negative_difference_is_an_error_not_a_count() {
        let page = GRPC.replace("} 110", "} 115");
        let e = eval(
            &page,
            r#"grpc_server_started_total{grpc_service="shop.Cart"} - grpc_server_handled_total{grpc_service="shop.Cart"}"#,
        )
        .unwrap_err();
        assert!(matches!(e, SampleError::Negative(_)), "{e}");
        assert!(e.to_string().contains("= -2"), "{e}");
        // A term with no selected series is 0, which is what the difference then is.
        assert_eq!(
            eval(GRPC, r#"grpc_server_started_total{grpc_service="none"}"#)
                .unwrap()
                .value,
            0.0
        );
        // An unknown metric anywhere in the expression is an error.
        let e = eval(
            GRPC,
            "grpc_server_started_total - grpc_server_handeld_total",
        )
        .unwrap_err();
        assert!(matches!(e, SampleError::NotFound(_)), "{e}");
    }

    #[test]
    fn openmetrics_counters_and_eof() {
        // OpenMetrics: counters are declared by family name, sampled as `_total`, with
        // `_created` samples, exemplars and a closing `# EOF`.
        let page = r#"# TYPE grpc_server_started counter
# HELP grpc_server_started Total number of RPCs started on the server.
grpc_server_started_total{grpc_service="a"} 12.0 # {trace_id="x"} 1.0 1712345678.0
grpc_server_started_created{grpc_service="a"} 1.712345678e+09
# TYPE grpc_server_handled counter
grpc_server_handled_total{grpc_service="a",grpc_code="OK"} 9.0
grpc_server_handled_created{grpc_service="a",grpc_code="OK"} 1.712345678e+09
# TYPE http_server_active_requests gauge
http_server_active_requests{http_request_method="GET",} 2
# EOF
grpc_server_handled_total{grpc_service="a",grpc_code="OK"} 1000
"#;
        let by_sample = eval(
            page,
            "grpc_server_started_total - grpc_server_handled_total",
        )
        .unwrap();
        assert_eq!(by_sample.value, 3.0);
        assert_eq!(by_sample.terms[0].kind.as_deref(), Some("counter"));
        let by_family = eval(page, "grpc_server_started - grpc_server_handled").unwrap();
        assert_eq!(by_family.value, 3.0);
        assert_eq!(
            eval(page, "http_server_active_requests").unwrap().value,
            2.0
        );
        // Declared only: 0 before the first call.
        let empty =
            "# TYPE grpc_server_started counter\n# TYPE grpc_server_handled counter\n# EOF\n";
        assert_eq!(
            eval(
                empty,
                "grpc_server_started_total - grpc_server_handled_total"
            )
            .unwrap()
            .value,
            0.0
        );
        assert!(eval("# EOF\nm 1\n", "m").is_err());
    }

    #[test]
    fn label_values_are_unescaped_before_matching() {
        let page = "m{path=\"/a\\\"b\",x=\"1\"} 2\nm{path=\"/c}\" , x=\"2\" ,} 3\n";
        assert_eq!(eval(page, r#"m{path="/a\"b"}"#).unwrap().value, 2.0);
        assert_eq!(eval(page, r#"m{path="/c}"}"#).unwrap().value, 3.0);
        assert_eq!(eval(page, r#"m{x=~"1|2"}"#).unwrap().value, 5.0);
        for bad in [
            "m{path} 1\n",
            "m{1a=\"x\"} 1\n",
            "m{a=\"x\" b=\"y\"} 1\n",
            "m{a=x} 1\n",
        ] {
            assert!(eval(bad, "m").is_err(), "{bad:?}");
        }
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
        let mut src = PrometheusInflight::new(&url, "http_inflight - other_metric").unwrap();
        assert_eq!(src.sample().unwrap(), 13);
        assert_eq!(src.series().len(), 4, "{:?}", src.series());
        assert!(
            src.series()[3].starts_with("- other_metric 7"),
            "{:?}",
            src.series()
        );
        assert!(
            src.detail().unwrap().ends_with("= 13"),
            "{:?}",
            src.detail()
        );
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
        assert!(PrometheusInflight::new(&url, "1bad").is_err());
        assert!(PrometheusInflight::new(&url, "a - b{").is_err());
    }
}
