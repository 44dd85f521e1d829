//! The aggregator's HTTP API as the tests read it: its JSON views deserialised into
//! the product's own types (so a field the product renames or retypes breaks the
//! tests at compile time instead of drifting from a copy), and a Prometheus text
//! parser.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::process::Stdio;

pub use ballast_aggregator::api::views::{
    ConfigView, EndpointView, ErrorBody, Health, HealthStatus, ServiceConfigView, ServiceDetail,
    ServiceSummary, WeightEntry, WeightSet,
};
pub use ballast_aggregator::store::StoreCondition;
pub use ballast_balance::inflight::InflightEstimate;
pub use ballast_balance::service::{HistoryPoint, ServiceStats};
pub use ballast_balance::{
    EndpointState, Published, PublishedEndpoint, PublishedService, SkipReason, Spread,
};

/// `GET /healthz`'s body in the product's own shape: a test names the product's fields,
/// so that a field renamed or retyped in the product breaks the tests at compile time
/// instead of reading as absent (`null`).
pub fn parse_health(body: &str) -> Result<Health, String> {
    serde_json::from_str(body).map_err(|e| format!("/healthz is not the health shape: {e}: {body}"))
}

/// Readings of a service's history that many tests share. A trait, because
/// [`ServiceDetail`] is the product's type and the tests cannot add methods to it.
pub trait ServiceHistory {
    /// The cycles that updated weights, oldest first.
    fn updates(&self) -> impl Iterator<Item = &HistoryPoint>;

    /// The last `n` cycles' max/avg, for failure messages.
    fn recent_max_over_avg(&self, n: usize) -> String;
}

impl ServiceHistory for ServiceDetail {
    fn updates(&self) -> impl Iterator<Item = &HistoryPoint> {
        self.history.iter().filter(|h| !h.skipped)
    }

    fn recent_max_over_avg(&self, n: usize) -> String {
        let from = self.history.len().saturating_sub(n);
        self.history[from..]
            .iter()
            .map(|h| {
                format!(
                    "#{}{}={:.3}",
                    h.cycle,
                    if h.skipped { "(skipped)" } else { "" },
                    h.spread.max_over_avg
                )
            })
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// One sample of a Prometheus / OpenMetrics text exposition.
#[derive(Debug, Clone, PartialEq)]
pub struct MetricSample {
    /// Metric name, with any `_total` suffix.
    pub name: String,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// Value.
    pub value: f64,
}

/// Parses the sample lines of a text exposition; comments and blank lines are skipped.
/// Panics on a line it cannot read, since the aggregator must emit valid text.
pub fn parse_metrics(text: &str) -> Vec<MetricSample> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (series, rest) = match line.find('{') {
            Some(open) => {
                let close = line[open..]
                    .rfind('}')
                    .map(|c| open + c)
                    .unwrap_or_else(|| panic!("unclosed label set in metrics line {line:?}"));
                (&line[..close + 1], line[close + 1..].trim())
            }
            None => line
                .split_once(char::is_whitespace)
                .map(|(a, b)| (a, b.trim()))
                .unwrap_or_else(|| panic!("metrics line without a value: {line:?}")),
        };
        let (name, labels) = match series.split_once('{') {
            Some((name, labels)) => (name, parse_labels(&labels[..labels.len() - 1], line)),
            None => (series, BTreeMap::new()),
        };
        let value_text = rest.split_whitespace().next().unwrap_or("");
        let value: f64 = match value_text {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v
                .parse()
                .unwrap_or_else(|_| panic!("bad value {v:?} in metrics line {line:?}")),
        };
        out.push(MetricSample {
            name: name.to_string(),
            labels,
            value,
        });
    }
    out
}

fn parse_labels(text: &str, line: &str) -> BTreeMap<String, String> {
    let mut labels = BTreeMap::new();
    let mut rest = text.trim();
    while !rest.is_empty() {
        let (key, after) = rest
            .split_once("=\"")
            .unwrap_or_else(|| panic!("bad label set in metrics line {line:?}"));
        let mut value = String::new();
        let mut chars = after.char_indices();
        let mut end = None;
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => {
                    if let Some((_, e)) = chars.next() {
                        value.push(match e {
                            'n' => '\n',
                            other => other,
                        });
                    }
                }
                '"' => {
                    end = Some(i);
                    break;
                }
                c => value.push(c),
            }
        }
        let end = end.unwrap_or_else(|| panic!("unterminated label value in {line:?}"));
        labels.insert(key.trim().trim_start_matches(',').trim().to_string(), value);
        rest = after[end + 1..].trim_start_matches(',').trim();
    }
    labels
}

/// The sum of the samples named `name` whose labels include every pair of `labels`;
/// 0 if there is none (a counter that was never incremented is often not exported).
pub fn sum_samples(samples: &[MetricSample], name: &str, labels: &[(&str, &str)]) -> f64 {
    samples
        .iter()
        .filter(|s| s.name == name)
        .filter(|s| {
            labels
                .iter()
                .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|s| s.value)
        .sum()
}

/// `ballast-aggregator token hash --name NAME --role ROLE` with `token` on stdin: the
/// entry it prints.
pub fn token_entry(name: &str, role: &str, token: &str) -> String {
    let mut cmd = super::process::command(super::process::AGGREGATOR_BIN);
    cmd.args(["token", "hash", "--name", name, "--role", role])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("spawn token hash");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(format!("{token}\n").as_bytes())
        .expect("write the token");
    let out = child.wait_with_output().expect("token hash");
    assert!(
        out.status.success(),
        "token hash failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let entry = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        entry.contains("$argon2id$") && !entry.contains(token),
        "the entry holds an argon2 hash and not the token: {entry}"
    );
    entry
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_counters_with_labels() {
        let text = "# HELP x y\n# TYPE ballast_reports_rejected counter\n\
            ballast_reports_rejected_total{reason=\"malformed\"} 3\n\
            ballast_reports_rejected_total{reason=\"oversized\"} 1\n\
            ballast_service_max_over_avg{service=\"a\\\"b\",zone=\"z\"} 1.25\n\
            ballast_reports_accepted_total 12\n# EOF\n";
        let s = parse_metrics(text);
        assert_eq!(s.len(), 4);
        assert_eq!(
            sum_samples(
                &s,
                "ballast_reports_rejected_total",
                &[("reason", "malformed")]
            ),
            3.0
        );
        assert_eq!(sum_samples(&s, "ballast_reports_rejected_total", &[]), 4.0);
        assert_eq!(sum_samples(&s, "ballast_reports_accepted_total", &[]), 12.0);
        assert_eq!(
            sum_samples(&s, "ballast_service_max_over_avg", &[("service", "a\"b")]),
            1.25
        );
        assert_eq!(sum_samples(&s, "nothing", &[]), 0.0);
    }
}
