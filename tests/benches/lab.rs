//! The full physical lab, then its runs at a low request rate: writes `docs/lab.md` and
//! `docs/img/lab-*.svg`, then exits non-zero, naming each target missed, if any is.
//! Run with `bash tests/lab/run` (see `ballast_tests::lab` for what it does).

use ballast_tests::lab::{report, run, Plan};
use std::path::Path;

fn main() {
    let docs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs");
    let r = run(&Plan::full());
    let low = run(&Plan::low_rate());
    let when = std::process::Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "an unknown date".into());
    let charts = report::charts(&r, &docs.join("img")).unwrap_or_else(|e| panic!("charts: {e}"));
    let headline = report::headline(&r, &low);
    let mut md = report::markdown(
        &r,
        Some(&headline),
        "bash tests/lab/run",
        &format!("{when}, {}", r.host),
    );
    md.push('\n');
    md.push_str(&report::low_rate_markdown(&low));
    let path = docs.join("lab.md");
    std::fs::write(&path, &md).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    println!("{md}");
    println!("wrote {} and {:?}", path.display(), charts);
    let missed: Vec<report::Target> = report::targets(&r)
        .into_iter()
        .chain(report::low_rate_targets(&low))
        .filter(|t| !t.met)
        .collect();
    if !missed.is_empty() {
        eprintln!("the lab missed {} target(s):", missed.len());
        for t in &missed {
            eprintln!("  - {}: {}", t.what, t.measured);
        }
        std::process::exit(1);
    }
    println!("every target met");
}
