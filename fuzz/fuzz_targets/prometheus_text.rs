//! The Prometheus text format as the agent reads a service's in-flight gauge from it:
//! `parse_gauge` on the input as a page (real expositions in the seeds), for the
//! metric names it declares and a few usual ones; and on a page rendered from samples
//! drawn from the input.
//!
//! Invariants: nothing panics; a parsed value is finite and not negative (NaN,
//! infinite or negative samples, and sums that overflow, are errors); a rendered page
//! (label values with escaped quotes, backslashes, newlines and braces, and other
//! metrics around it) parses back to the sum of its samples.

#![no_main]

use arbitrary::Unstructured;
use ballast_agent::sample::prometheus::parse_gauge;
use libfuzzer_sys::fuzz_target;

fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fuzz_target!(|data: &[u8]| {
    let page = String::from_utf8_lossy(data);
    let mut metrics: Vec<&str> = vec!["http_inflight", "inflight", "http_requests_in_flight"];
    for line in page.lines().take(64) {
        let mut words = line.split_whitespace();
        if let (Some("#"), Some("TYPE" | "HELP"), Some(name)) =
            (words.next(), words.next(), words.next())
        {
            if valid_name(name) && !metrics.contains(&name) {
                metrics.push(name);
            }
        }
    }
    for metric in metrics.iter().take(8) {
        if let Ok(v) = parse_gauge(&page, metric) {
            assert!(v.is_finite() && v >= 0.0, "{metric} = {v} in {page:?}");
        }
    }

    // A page of known samples.
    let mut u = Unstructured::new(data);
    let metric: String = u.arbitrary().unwrap_or_default();
    let metric = if valid_name(&metric) {
        metric
    } else {
        "http_inflight".to_string()
    };
    let declared: bool = u.arbitrary().unwrap_or(false);
    let samples: Vec<(String, u16)> = u.arbitrary().unwrap_or_default();
    let mut page = String::new();
    if declared {
        page.push_str(&format!(
            "# HELP {metric} Requests in flight.\n# TYPE {metric} gauge\n"
        ));
    }
    page.push_str(&format!("{metric}_total 7\n"));
    let mut sum = 0.0;
    for (i, (label, value)) in samples.iter().take(32).enumerate() {
        page.push_str(&format!(
            "{metric}{{handler=\"{}\",n=\"{i}\"}} {value}\n",
            escape(label)
        ));
        page.push_str(&format!("{metric}_other{{x=\"{}\"}} 3\n", escape(label)));
        sum += f64::from(*value);
    }
    match parse_gauge(&page, &metric) {
        Ok(v) => assert_eq!(v, sum, "page:\n{page}"),
        Err(e) => assert!(
            samples.is_empty() && !declared,
            "{e} on a well-formed page:\n{page}"
        ),
    }
});
