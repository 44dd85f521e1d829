//! The in-flight expression language and the pages it reads: `Expr::parse` on the
//! input's first line, evaluated (`evaluate`) on the rest as a Prometheus or OpenMetrics
//! page, which is also read as an nginx `stub_status` page; and an expression and page
//! built from values drawn from the input.
//!
//! Invariants: nothing panics; a parsed expression prints as text that parses back to
//! the same expression; an evaluation is finite and never below zero (a negative
//! difference is an error); an `=` matcher on an escaped value selects exactly the
//! series with that value, and a pattern made of the value with every character
//! escaped (`\\n` for a newline, letters and digits as they are) matches the value.

#![no_main]

use arbitrary::Unstructured;
use ballast_agent::sample::expr::{escape, Expr, MAX_LEN};
use ballast_agent::sample::nginx::StubStatus;
use ballast_agent::sample::prometheus::evaluate;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let (first, page) = text.split_once('\n').unwrap_or((&text, ""));
    if let Ok(expr) = Expr::parse(first) {
        let printed = expr.to_string();
        // Printing adds blanks around the signs, which may take it past the limit.
        if printed.len() <= MAX_LEN {
            let again = Expr::parse(&printed)
            .unwrap_or_else(|e| panic!("{first:?} printed as {printed:?}: {e}"));
            assert_eq!(again, expr, "{first:?} printed as {printed:?}");
        }
        if let Ok(e) = evaluate(page, &expr) {
            assert!(e.value.is_finite() && e.value >= 0.0, "{e:?}");
        }
    }
    if let Ok(s) = StubStatus::parse(page) {
        if let Ok(n) = s.inflight() {
            assert_eq!(n + 1, s.writing);
        }
    }

    // A page of known series and expressions that select some of them.
    let mut u = Unstructured::new(data);
    let values: Vec<(String, u16)> = u.arbitrary().unwrap_or_default();
    let Some((wanted, _)) = values.first().cloned() else {
        return;
    };
    let mut page = String::from("# TYPE calls counter\n");
    let mut sum = 0.0;
    for (v, n) in values.iter().take(16) {
        page.push_str(&format!("calls_total{{svc=\"{}\",x=\"}}\"}} {n}\n", escape(v)));
        if *v == wanted {
            sum += f64::from(*n);
        }
    }
    page.push_str("# EOF\n");
    let eq = format!("calls_total{{svc=\"{}\"}}", escape(&wanted));
    let literal: String = wanted
        .chars()
        .map(|c| match c {
            '\n' => "\\n".to_string(),
            // `\n` is a newline: letters and digits go as they are.
            c if c.is_ascii_alphanumeric() => c.to_string(),
            c => format!("\\{c}"),
        })
        .collect();
    let re = format!("calls - calls_total{{svc=~\"{literal}\"}}");
    // Expressions past the length limit are refused, rightly: not this check's subject.
    if re.len() > MAX_LEN {
        return;
    }
    let e = Expr::parse(&eq).unwrap_or_else(|e| panic!("{eq:?}: {e}"));
    let got = evaluate(&page, &e).unwrap_or_else(|e| panic!("{eq:?} on {page:?}: {e}"));
    assert_eq!(got.value, sum, "{eq:?} on {page:?}");
    let e = Expr::parse(&re).unwrap_or_else(|e| panic!("{re:?}: {e}"));
    let got = evaluate(&page, &e).unwrap_or_else(|e| panic!("{re:?} on {page:?}: {e}"));
    let total: f64 = values.iter().take(16).map(|(_, n)| f64::from(*n)).sum();
    assert_eq!(got.value, total - sum, "{re:?} on {page:?}");
});
