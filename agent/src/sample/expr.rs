//! The Prometheus source's small expression language, and the named presets written in
//! it.
//!
//! An expression is one or more terms joined by `+` or `-`; a term is a metric name
//! with optional label matchers, and stands for the sum of every series of that metric
//! the matchers select:
//!
//! ```text
//! grpc_server_started_total{grpc_service="shop.Cart"} - grpc_server_handled_total{grpc_service="shop.Cart"}
//! haproxy_backend_current_sessions{proxy="app"} + haproxy_backend_current_queue{proxy="app"}
//! ```
//!
//! Matchers: `label="v"` (equal), `label!="v"` (not equal), `label=~"p"` (the whole value
//! matches the pattern), `label!~"p"` (it does not). Label values are quoted with `\"`,
//! `\\` and `\n` escapes, as in the exposition format. A pattern is a deliberately small
//! subset of a regular expression, always anchored at both ends: literal characters,
//! `.` (any one character), `.*` (any run of characters, also none), `.+` (at least
//! one), `\` before a character to take it literally (`\n` is a newline), and alternation `a|b|c` at the top
//! level. Anything else a regular expression would give a meaning to (`( ) [ ] { } ? +
//! * ^ $` elsewhere) is refused, with its column, rather than matched literally.
//!
//! A counter is read as its current value: `started - handled` is the number of calls
//! begun and not yet finished. A result below zero is an error, never a count: counters
//! that went backwards (a restart between the two reads, a page rendered out of order)
//! say nothing about load.

use std::fmt;

use super::SampleError;

/// The longest expression accepted, in bytes.
pub const MAX_LEN: usize = 1024;
/// The most terms an expression may have.
pub const MAX_TERMS: usize = 8;
/// The most matchers a term may have.
pub const MAX_MATCHERS: usize = 8;

/// How a matcher compares a label's value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// `=`
    Eq,
    /// `!=`
    Ne,
    /// `=~`
    Match,
    /// `!~`
    NoMatch,
}

impl Op {
    fn as_str(self) -> &'static str {
        match self {
            Op::Eq => "=",
            Op::Ne => "!=",
            Op::Match => "=~",
            Op::NoMatch => "!~",
        }
    }
}

/// One piece of a pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    /// This character.
    Char(char),
    /// Any one character.
    Any,
    /// Any run of characters, also empty.
    Star,
}

/// An anchored pattern: alternatives of piece sequences.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pattern(Vec<Vec<Piece>>);

impl Pattern {
    /// Parses `src`, whose first character is at column `col` of the expression.
    fn parse(src: &str, col: usize) -> Result<Self, (usize, String)> {
        let mut alts = vec![Vec::new()];
        let mut chars = src.chars().enumerate().peekable();
        while let Some((i, c)) = chars.next() {
            let Some(cur) = alts.last_mut() else {
                break;
            };
            match c {
                '|' => alts.push(Vec::new()),
                '\\' => match chars.next() {
                    Some((_, 'n')) => cur.push(Piece::Char('\n')),
                    Some((_, e)) => cur.push(Piece::Char(e)),
                    None => return Err((col + i, "pattern ends with `\\`".into())),
                },
                '.' => match chars.peek() {
                    Some((_, '*')) => {
                        chars.next();
                        cur.push(Piece::Star);
                    }
                    Some((_, '+')) => {
                        chars.next();
                        cur.push(Piece::Any);
                        cur.push(Piece::Star);
                    }
                    _ => cur.push(Piece::Any),
                },
                '(' | ')' | '[' | ']' | '{' | '}' | '?' | '+' | '*' | '^' | '$' => {
                    return Err((
                        col + i,
                        format!(
                            "`{c}` is not supported in patterns (literal text, `.`, `.*`, \
                             `.+`, `\\x` and `a|b` are; escape it as `\\{c}` to match it)"
                        ),
                    ))
                }
                c => cur.push(Piece::Char(c)),
            }
        }
        Ok(Pattern(alts))
    }

    /// Whether the whole of `value` matches one alternative.
    pub fn matches(&self, value: &str) -> bool {
        let value: Vec<char> = value.chars().collect();
        self.0.iter().any(|alt| glob(alt, &value))
    }
}

/// Matches `value` against `pieces`, anchored, in O(len × pieces): the classic
/// wildcard walk that backtracks only to the last `Star`.
fn glob(pieces: &[Piece], value: &[char]) -> bool {
    let (mut p, mut v) = (0usize, 0usize);
    let mut star: Option<(usize, usize)> = None;
    while v < value.len() {
        match pieces.get(p) {
            Some(Piece::Star) => {
                star = Some((p, v));
                p += 1;
            }
            Some(Piece::Any) => {
                p += 1;
                v += 1;
            }
            Some(Piece::Char(c)) if *c == value[v] => {
                p += 1;
                v += 1;
            }
            _ => match star {
                Some((sp, sv)) => {
                    p = sp + 1;
                    v = sv + 1;
                    star = Some((sp, sv + 1));
                }
                None => return false,
            },
        }
    }
    pieces[p.min(pieces.len())..]
        .iter()
        .all(|x| *x == Piece::Star)
}

/// A label matcher.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Matcher {
    /// The label's name.
    pub label: String,
    /// The comparison.
    pub op: Op,
    /// The value, unescaped; a pattern as written.
    pub value: String,
    pattern: Option<Pattern>,
}

impl Matcher {
    /// Whether a series with these labels is selected; a missing label is `""`, as in
    /// Prometheus.
    pub fn selects(&self, labels: &[(String, String)]) -> bool {
        let v = labels
            .iter()
            .find(|(k, _)| *k == self.label)
            .map_or("", |(_, v)| v.as_str());
        match (&self.op, &self.pattern) {
            (Op::Eq, _) => v == self.value,
            (Op::Ne, _) => v != self.value,
            (Op::Match, Some(p)) => p.matches(v),
            (Op::NoMatch, Some(p)) => !p.matches(v),
            (Op::Match | Op::NoMatch, None) => false,
        }
    }
}

/// A metric name and its matchers: the sum of the series they select.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selector {
    /// The metric's name (a counter's `_total` sample name, or its family name).
    pub metric: String,
    /// All must select a series.
    pub matchers: Vec<Matcher>,
}

impl Selector {
    /// Whether the series' labels are selected by every matcher.
    pub fn selects(&self, labels: &[(String, String)]) -> bool {
        self.matchers.iter().all(|m| m.selects(labels))
    }
}

impl fmt::Display for Selector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.metric)?;
        if !self.matchers.is_empty() {
            let parts: Vec<String> = self
                .matchers
                .iter()
                .map(|m| {
                    let v = match m.op {
                        Op::Eq | Op::Ne => escape(&m.value),
                        Op::Match | Op::NoMatch => m.value.clone(),
                    };
                    format!("{}{}\"{v}\"", m.label, m.op.as_str())
                })
                .collect();
            write!(f, "{{{}}}", parts.join(","))?;
        }
        Ok(())
    }
}

/// A label value as the exposition format and expressions quote it.
pub fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// An expression: signed terms, summed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expr {
    /// `(negated, selector)`; the first term is never negated.
    pub terms: Vec<(bool, Selector)>,
}

impl fmt::Display for Expr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (neg, sel)) in self.terms.iter().enumerate() {
            match (i, neg) {
                (0, _) => write!(f, "{sel}")?,
                (_, true) => write!(f, " - {sel}")?,
                (_, false) => write!(f, " + {sel}")?,
            }
        }
        Ok(())
    }
}

/// The parser's cursor over the expression's characters.
struct Cursor<'a> {
    src: &'a str,
    chars: Vec<char>,
    pos: usize,
}

impl Cursor<'_> {
    fn err(&self, col: usize, why: impl Into<String>) -> SampleError {
        SampleError::InvalidSpec(format!(
            "expression {:?}, column {col}: {}",
            self.src,
            why.into()
        ))
    }

    /// The 1-based column of the current character.
    fn col(&self) -> usize {
        self.pos + 1
    }

    fn peek(&self) -> Option<char> {
        self.chars.get(self.pos).copied()
    }

    fn skip_blanks(&mut self) {
        while self.peek().is_some_and(char::is_whitespace) {
            self.pos += 1;
        }
    }

    fn what_is_here(&self) -> String {
        match self.peek() {
            Some(c) => format!("found `{c}`"),
            None => "found the end".into(),
        }
    }

    fn expect(&mut self, c: char, what: &str) -> Result<(), SampleError> {
        if self.peek() == Some(c) {
            self.pos += 1;
            Ok(())
        } else {
            Err(self.err(
                self.col(),
                format!("expected {what}, {}", self.what_is_here()),
            ))
        }
    }

    /// `[a-zA-Z_:][a-zA-Z0-9_:]*` (without `:` for label names).
    fn name(&mut self, what: &str, colons: bool) -> Result<String, SampleError> {
        let ok_first = |c: char| c.is_ascii_alphabetic() || c == '_' || (colons && c == ':');
        let ok = |c: char| ok_first(c) || c.is_ascii_digit();
        if !self.peek().is_some_and(ok_first) {
            return Err(self.err(
                self.col(),
                format!("expected {what}, {}", self.what_is_here()),
            ));
        }
        let start = self.pos;
        while self.peek().is_some_and(ok) {
            self.pos += 1;
        }
        Ok(self.chars[start..self.pos].iter().collect())
    }

    /// A double-quoted string, returned as written (escapes intact) with the column of
    /// its first character.
    fn quoted(&mut self) -> Result<(String, usize), SampleError> {
        self.expect('"', "a quoted value")?;
        let col = self.col();
        let start = self.pos;
        loop {
            match self.peek() {
                None => return Err(self.err(col - 1, "unterminated quoted value")),
                Some('"') => {
                    self.pos += 1;
                    return Ok((self.chars[start..self.pos - 1].iter().collect(), col));
                }
                Some('\\') => self.pos += 2,
                Some(_) => self.pos += 1,
            }
        }
    }

    fn matcher(&mut self) -> Result<Matcher, SampleError> {
        let label = self.name("a label name", false)?;
        self.skip_blanks();
        let op_col = self.col();
        let op = match (self.peek(), self.chars.get(self.pos + 1).copied()) {
            (Some('='), Some('~')) => Op::Match,
            (Some('='), _) => Op::Eq,
            (Some('!'), Some('=')) => Op::Ne,
            (Some('!'), Some('~')) => Op::NoMatch,
            _ => {
                return Err(self.err(
                    op_col,
                    format!("expected `=`, `!=`, `=~` or `!~`, {}", self.what_is_here()),
                ))
            }
        };
        self.pos += if op == Op::Eq { 1 } else { 2 };
        self.skip_blanks();
        let (raw, col) = self.quoted()?;
        let (value, pattern) = match op {
            // A pattern keeps its text as written: `\.` is an escaped dot there.
            Op::Match | Op::NoMatch => {
                let p = Pattern::parse(&raw, col).map_err(|(c, why)| self.err(c, why))?;
                (raw, Some(p))
            }
            Op::Eq | Op::Ne => (unescape(&raw), None),
        };
        Ok(Matcher {
            label,
            op,
            value,
            pattern,
        })
    }

    fn selector(&mut self) -> Result<Selector, SampleError> {
        let metric = self.name("a metric name", true)?;
        self.skip_blanks();
        let mut matchers = Vec::new();
        if self.peek() == Some('{') {
            self.pos += 1;
            loop {
                self.skip_blanks();
                if self.peek() == Some('}') {
                    self.pos += 1;
                    break;
                }
                if matchers.len() == MAX_MATCHERS {
                    return Err(self.err(
                        self.col(),
                        format!("more than {MAX_MATCHERS} matchers in one term"),
                    ));
                }
                matchers.push(self.matcher()?);
                self.skip_blanks();
                match self.peek() {
                    Some(',') => self.pos += 1,
                    Some('}') => {}
                    _ => {
                        return Err(self.err(
                            self.col(),
                            format!("expected `,` or `}}`, {}", self.what_is_here()),
                        ))
                    }
                }
            }
        }
        Ok(Selector { metric, matchers })
    }
}

/// A quoted value's text: `\n` is a newline, and a backslash before any other
/// character stands for that character (`\"`, `\\`).
fn unescape(raw: &str) -> String {
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        match (c, c == '\\') {
            (_, true) => match chars.next() {
                Some('n') => out.push('\n'),
                Some(n) => out.push(n),
                None => {}
            },
            (c, false) => out.push(c),
        }
    }
    out
}

impl Expr {
    /// Parses an expression. Errors name the 1-based column (in characters).
    pub fn parse(src: &str) -> Result<Self, SampleError> {
        let mut c = Cursor {
            src,
            chars: src.chars().collect(),
            pos: 0,
        };
        if src.len() > MAX_LEN {
            return Err(c.err(MAX_LEN + 1, format!("longer than {MAX_LEN} bytes")));
        }
        let mut terms = Vec::new();
        let mut negated = false;
        loop {
            c.skip_blanks();
            if terms.len() == MAX_TERMS {
                return Err(c.err(c.col(), format!("more than {MAX_TERMS} terms")));
            }
            terms.push((negated, c.selector()?));
            c.skip_blanks();
            match c.peek() {
                None => break,
                Some('+') => negated = false,
                Some('-') => negated = true,
                Some(_) => {
                    return Err(c.err(
                        c.col(),
                        format!("expected `+`, `-` or the end, {}", c.what_is_here()),
                    ))
                }
            }
            c.pos += 1;
        }
        Ok(Expr { terms })
    }

    /// The metric names the terms read.
    pub fn metrics(&self) -> impl Iterator<Item = &str> {
        self.terms.iter().map(|(_, s)| s.metric.as_str())
    }
}

/// A named preset: a service kind whose exporter's series are known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preset {
    /// go-grpc-prometheus (and compatible) server counters: started − handled.
    Grpc,
    /// OpenTelemetry's HTTP server semantic conventions: active requests.
    OtelHttp,
    /// Envoy's HTTP connection manager: active downstream requests.
    Envoy,
    /// HAProxy's Prometheus exporter: a backend's current sessions plus queue.
    Haproxy,
    /// nginx `stub_status`: the `Writing` count less the status request itself.
    Nginx,
}

impl Preset {
    /// Every preset, in the order the docs list them.
    pub const ALL: [Preset; 5] = [
        Preset::Grpc,
        Preset::OtelHttp,
        Preset::Envoy,
        Preset::Haproxy,
        Preset::Nginx,
    ];

    /// The word that names it in `--inflight NAME:URL`.
    pub fn name(self) -> &'static str {
        match self {
            Preset::Grpc => "grpc",
            Preset::OtelHttp => "otel-http",
            Preset::Envoy => "envoy",
            Preset::Haproxy => "haproxy",
            Preset::Nginx => "nginx",
        }
    }

    /// The preset a word names.
    pub fn from_name(name: &str) -> Option<Preset> {
        Preset::ALL.into_iter().find(|p| p.name() == name)
    }

    /// The one option the preset takes after `#`, if any (`service=`, `prefix=`,
    /// `backend=`).
    pub fn option(self) -> Option<&'static str> {
        match self {
            Preset::Grpc => Some("service"),
            Preset::Envoy => Some("prefix"),
            Preset::Haproxy => Some("backend"),
            Preset::OtelHttp | Preset::Nginx => None,
        }
    }

    /// The expression the preset reads from a Prometheus page; `None` for `nginx`,
    /// whose status page is not one.
    pub fn expression(self, option: Option<&str>) -> Option<String> {
        let with = |label: &str| {
            option.map_or_else(String::new, |v| format!("{{{label}=\"{}\"}}", escape(v)))
        };
        Some(match self {
            Preset::Grpc => {
                let m = with("grpc_service");
                format!("grpc_server_started_total{m} - grpc_server_handled_total{m}")
            }
            Preset::OtelHttp => "http_server_active_requests".into(),
            Preset::Envoy => format!(
                "envoy_http_downstream_rq_active{{envoy_http_conn_manager_prefix=\"{}\"}}",
                escape(option.unwrap_or("ingress_http"))
            ),
            Preset::Haproxy => {
                let m = with("proxy");
                format!("haproxy_backend_current_sessions{m} + haproxy_backend_current_queue{m}")
            }
            Preset::Nginx => return None,
        })
    }

    /// Checks an option value: one line, not empty.
    pub fn check_option(self, value: &str) -> Result<(), String> {
        if value.is_empty() || value.contains(['\n', '\r']) {
            Err(format!(
                "{}: the value must be one non-empty line",
                self.name()
            ))
        } else {
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(src: &str) -> String {
        Expr::parse(src).unwrap_err().to_string()
    }

    #[test]
    fn parses_terms_matchers_and_signs() {
        let e = Expr::parse(r#"a_total{x="1", y!="2",z=~"p.*|q" ,w!~"\.x"} - b:c + d{}"#).unwrap();
        assert_eq!(e.terms.len(), 3);
        assert!(!e.terms[0].0 && e.terms[1].0 && !e.terms[2].0);
        let ops: Vec<Op> = e.terms[0].1.matchers.iter().map(|m| m.op).collect();
        assert_eq!(ops, [Op::Eq, Op::Ne, Op::Match, Op::NoMatch]);
        assert_eq!(e.terms[1].1.metric, "b:c");
        assert!(e.terms[2].1.matchers.is_empty());
        // Printed back, it parses to the same expression.
        assert_eq!(Expr::parse(&e.to_string()).unwrap(), e);
        let q = Expr::parse(r#"m{l="a\"b\\c\nd"}"#).unwrap();
        assert_eq!(q.terms[0].1.matchers[0].value, "a\"b\\c\nd");
        assert_eq!(Expr::parse(&q.to_string()).unwrap(), q);
    }

    #[test]
    fn errors_name_the_column() {
        for (src, col, what) in [
            ("", 1, "expected a metric name, found the end"),
            ("1m", 1, "expected a metric name, found `1`"),
            ("a b", 3, "expected `+`, `-` or the end, found `b`"),
            ("a -", 4, "expected a metric name, found the end"),
            ("a{x=1}", 5, "expected a quoted value, found `1`"),
            (
                "a{x~\"1\"}",
                4,
                "expected `=`, `!=`, `=~` or `!~`, found `~`",
            ),
            ("a{x=\"1\" y=\"2\"}", 9, "expected `,` or `}`, found `y`"),
            ("a{x=\"1", 5, "unterminated quoted value"),
            ("a{x=~\"(a)\"}", 7, "`(` is not supported in patterns"),
            ("a{x=~\"ab?\"}", 9, "`?` is not supported"),
            ("a{x=~\"ab\\\"}", 6, "unterminated quoted value"),
            ("a{é=\"1\"}", 3, "expected a label name, found `é`"),
            ("é + b", 1, "expected a metric name"),
            (
                "a{x=\"1\"} * b",
                10,
                "expected `+`, `-` or the end, found `*`",
            ),
        ] {
            let e = err(src);
            assert!(e.contains(&format!("column {col}: {what}")), "{src:?}: {e}");
        }
        let long = format!("a{}", " ".repeat(MAX_LEN));
        assert!(err(&long).contains("longer than"), "{}", err(&long));
        let many = ["a"; MAX_TERMS + 1].join("+");
        assert!(err(&many).contains("more than 8 terms"));
    }

    #[test]
    fn patterns_are_anchored() {
        let p = |s: &str| Pattern::parse(s, 1).unwrap();
        assert!(p("abc").matches("abc"));
        assert!(!p("abc").matches("abcd") && !p("abc").matches("xabc"));
        assert!(p("a.*").matches("a") && p("a.*").matches("abc"));
        assert!(!p("a.+").matches("a") && p("a.+").matches("ab"));
        assert!(p(".*b.*").matches("abc") && !p(".*b.*").matches("ac"));
        assert!(p("a.c").matches("abc") && !p("a.c").matches("ac"));
        assert!(p("shop|cart").matches("cart") && !p("shop|cart").matches("shopcart"));
        assert!(p("a\\.b").matches("a.b") && !p("a\\.b").matches("axb"));
        assert!(p("").matches("") && !p("").matches("x"));
        assert!(p("|x").matches(""));
        assert!(p(".*a.*a.*a.*b").matches(&"a".repeat(40).replace("aa", "ab")));
        assert!(!p(".*a.*a.*a.*c").matches(&"a".repeat(2000)));
        assert!(p("é.").matches("éé"));
    }

    #[test]
    fn matchers_select_series() {
        let e = Expr::parse(r#"m{a="1",b!="2",c=~"x|y.*",d!~".+"}"#).unwrap();
        let sel = &e.terms[0].1;
        let l = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        assert!(sel.selects(&l(&[("a", "1"), ("c", "yes")])));
        assert!(sel.selects(&l(&[("a", "1"), ("b", "3"), ("c", "x"), ("d", "")])));
        assert!(!sel.selects(&l(&[("a", "1"), ("c", "xx")])));
        assert!(!sel.selects(&l(&[("a", "1"), ("b", "2"), ("c", "x")])));
        assert!(!sel.selects(&l(&[("a", "1"), ("c", "x"), ("d", "v")])));
        assert!(!sel.selects(&l(&[("c", "x")])));
    }

    #[test]
    fn presets_expand_to_expressions_that_parse() {
        for p in Preset::ALL {
            assert_eq!(Preset::from_name(p.name()), Some(p));
            let opts = match p.option() {
                Some(_) => vec![None, Some("a\"b")],
                None => vec![None],
            };
            for opt in opts {
                if let Some(src) = p.expression(opt) {
                    let e = Expr::parse(&src).unwrap_or_else(|e| panic!("{p:?}: {e}"));
                    if let Some(v) = opt {
                        assert!(
                            e.terms.iter().all(|(_, s)| s.matchers[0].value == v),
                            "{src}"
                        );
                    }
                }
            }
        }
        assert_eq!(
            Preset::Grpc.expression(Some("shop.Cart")).unwrap(),
            r#"grpc_server_started_total{grpc_service="shop.Cart"} - grpc_server_handled_total{grpc_service="shop.Cart"}"#
        );
        assert_eq!(
            Preset::Grpc.expression(None).unwrap(),
            "grpc_server_started_total - grpc_server_handled_total"
        );
        assert_eq!(
            Preset::Envoy.expression(None).unwrap(),
            r#"envoy_http_downstream_rq_active{envoy_http_conn_manager_prefix="ingress_http"}"#
        );
        assert_eq!(
            Preset::Haproxy.expression(Some("app")).unwrap(),
            r#"haproxy_backend_current_sessions{proxy="app"} + haproxy_backend_current_queue{proxy="app"}"#
        );
        assert_eq!(Preset::Nginx.expression(None), None);
        assert_eq!(Preset::from_name("otel_http"), None);
    }
}
