//! Every figure the documentation quotes has one source, and every quote of it agrees.
//!
//! The figures Ballast is measured by are written by the commands that measure them:
//! `tests/ratios` writes the blocks between `<!-- figures: NAME -->` and
//! `<!-- figures: end -->` in `docs/performance.md` (`cycle`, `ingest` beside bare
//! quinn, `agent` beside node_exporter), `fuzz/bench` and the soak write theirs in
//! `docs/reliability.md`, the simulator writes `docs/balance.md` and the lab
//! `docs/lab.md` whole. Elsewhere in `README.md` and `docs/*.md` a figure should be a
//! link to its block; where prose quotes it all the same, this test reads the real
//! files, parses each source, finds the known phrasings of each figure in the prose
//! (outside generated blocks and code fences; a table's row counts as a sentence) and
//! fails on any quote that differs from the source, naming the file, the line, the
//! quote and the source's value. A block quoted whole, between its own markers, is
//! held to its source byte for byte by `tests/tests/figures.rs`, which also knows
//! which command writes each `figures` block.
//! A quote agrees when it is the source's value rounded to the decimals the quote
//! shows (1.43 for a block's 1.432); a range never does, since a source holds one run.
//!
//! What it checks, and against what:
//!
//! - the agent's CPU on a quiet and on a busy host, its RSS and its binary's size:
//!   the `agent` block;
//! - the encoded sizes of `docs/protocol.md` (a reply, a report, a hello): computed
//!   here with the wire encoder itself, which also holds the reply sizes the
//!   `ingest` block measured to sizes a reply can have;
//! - the number of fuzz targets and which the long runs lack: the files in
//!   `fuzz/fuzz_targets/`, against the target table, the `fuzz-bench` block and the
//!   prose of `docs/reliability.md`;
//! - failover: each goal in `docs/scale.md` is its section's lease and two of its
//!   cycles, and the figures quoted elsewhere are the measured rows of `docs/scale.md`
//!   (no generator writes them: the cluster and relay tests print them);
//! - the lab's and the simulator's headlines: `docs/lab.md` and `docs/balance.md`;
//! - the ingest ratios and the cycle time: the `tests/ratios` blocks;
//! - the verdicts beside them ("Met", "missed", "just over the target"): the cycle's
//!   target and the agent's CPU and memory targets, judged by the block's run;
//! - the soak's memory: the `soak` block;
//! - links to a heading of the documents that hold the sources: they land.
//!
//! The README's lab and simulator headlines must be found in the phrasing the test
//! knows, so that rewording them cannot slip past it. Dated runs kept as the record of
//! a decision, in tables of their own under their date, are history rather than the
//! figure: a table's bare cells match none of the phrasings, so they are not checked.

// A test: a failed expectation fails it, with its message.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use ballast_shared::wire::{self, examples, Message};
use regex::Regex;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::LazyLock;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("reading {rel}: {e}"))
}

fn re(pattern: &str) -> Regex {
    Regex::new(pattern).unwrap_or_else(|e| panic!("pattern {pattern}: {e}"))
}

/// Lines that open and close a block written by the command that measures it.
const BLOCKS: &[(&str, &str)] = &[
    ("<!-- figures: cycle -->", "<!-- figures: end -->"),
    ("<!-- figures: ingest -->", "<!-- figures: end -->"),
    ("<!-- figures: agent -->", "<!-- figures: end -->"),
    ("<!-- fuzz-bench: begin", "<!-- fuzz-bench: end -->"),
    ("<!-- soak:begin -->", "<!-- soak:end -->"),
];

/// Documents that the command measuring their figures writes whole.
const GENERATED: &[&str] = &["docs/balance.md", "docs/lab.md"];

/// `README.md` and every `docs/*.md`, as (path, text).
fn docs() -> Vec<(String, String)> {
    let mut paths = vec!["README.md".to_string()];
    let dir = std::fs::read_dir(root().join("docs")).expect("docs/ is readable");
    let mut md: Vec<String> = dir
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".md"))
        .map(|n| format!("docs/{n}"))
        .collect();
    md.sort();
    paths.extend(md);
    paths
        .into_iter()
        .map(|p| {
            let text = read(&p);
            (p, text)
        })
        .collect()
}

/// The lines strictly between the line starting with `start` and the next line
/// starting with `end`.
fn block(doc: &str, text: &str, start: &str, end: &str) -> String {
    let mut lines = text.lines().skip_while(|l| !l.starts_with(start));
    assert!(
        lines.next().is_some(),
        "{doc} has no block opened by `{start}`: the figures checked here come from it"
    );
    let body: Vec<&str> = lines.take_while(|l| !l.starts_with(end)).collect();
    body.join("\n")
}

/// One sentence of prose, or of a table's row: the document, its line, its text.
struct Sentence {
    doc: String,
    line: usize,
    text: String,
}

/// The prose of every document that is not generated whole, outside generated blocks
/// and code fences: paragraphs joined into one line and each table row on its own,
/// cut into sentences at a full stop followed by a space (a decimal point never is).
fn prose() -> Vec<Sentence> {
    let mut out = Vec::new();
    for (doc, text) in docs() {
        if GENERATED.contains(&doc.as_str()) {
            continue;
        }
        // The paragraph being gathered: its text, and where each of its lines starts.
        let mut para = String::new();
        let mut starts: Vec<(usize, usize)> = Vec::new();
        let mut flush = |para: &mut String, starts: &mut Vec<(usize, usize)>| {
            for (at, s) in split_sentences(para) {
                let line = starts
                    .iter()
                    .take_while(|(offset, _)| *offset <= at)
                    .last()
                    .map_or(0, |(_, line)| *line);
                out.push(Sentence {
                    doc: doc.clone(),
                    line,
                    text: s.to_string(),
                });
            }
            para.clear();
            starts.clear();
        };
        let mut in_block: Option<&str> = None;
        let mut in_fence = false;
        for (i, l) in text.lines().enumerate() {
            let n = i + 1;
            if let Some(end) = in_block {
                if l.starts_with(end) {
                    in_block = None;
                }
                continue;
            }
            if let Some((_, end)) = BLOCKS.iter().find(|(s, _)| l.starts_with(s)) {
                if !l.starts_with(end) {
                    flush(&mut para, &mut starts);
                    in_block = Some(end);
                    continue;
                }
            }
            if l.trim_start().starts_with("```") {
                flush(&mut para, &mut starts);
                in_fence = !in_fence;
                continue;
            }
            let t = l.trim();
            if in_fence || t.is_empty() || t.starts_with('#') {
                flush(&mut para, &mut starts);
                continue;
            }
            // A table row, and a list item, start a unit of their own.
            if t.starts_with('|') || t.starts_with("- ") || t.starts_with("* ") {
                flush(&mut para, &mut starts);
            }
            if !para.is_empty() {
                para.push(' ');
            }
            starts.push((para.len(), n));
            para.push_str(t);
            if t.starts_with('|') {
                flush(&mut para, &mut starts);
            }
        }
        flush(&mut para, &mut starts);
    }
    out
}

/// The sentences of a paragraph, each with its offset in it.
fn split_sentences(para: &str) -> Vec<(usize, &str)> {
    let mut out = Vec::new();
    let mut from = 0;
    let bytes = para.as_bytes();
    for i in 0..bytes.len() {
        if bytes[i] == b'.' && bytes.get(i + 1) == Some(&b' ') {
            out.push((from, &para[from..=i]));
            from = i + 2;
        }
    }
    if from < para.len() {
        out.push((from, &para[from..]));
    }
    out
}

/// Markdown tables in `text`: each a header and its rows, cells trimmed.
struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    fn col(&self, name: &str, what: &str) -> usize {
        self.header
            .iter()
            .position(|h| h == name)
            .unwrap_or_else(|| panic!("{what}: no column `{name}` in {:?}", self.header))
    }
}

fn cells(line: &str) -> Vec<String> {
    let t = line.trim().trim_start_matches('|').trim_end_matches('|');
    t.split('|').map(|c| c.trim().to_string()).collect()
}

fn tables(text: &str) -> Vec<Table> {
    let mut out: Vec<Table> = Vec::new();
    let mut current: Option<Table> = None;
    for l in text.lines() {
        let t = l.trim();
        if t.starts_with('|') {
            match current.as_mut() {
                None => {
                    current = Some(Table {
                        header: cells(t),
                        rows: Vec::new(),
                    })
                }
                Some(table) => {
                    if !t.starts_with("|---") && !t.starts_with("| ---") {
                        table.rows.push(cells(t));
                    }
                }
            }
        } else if let Some(table) = current.take() {
            out.push(table);
        }
    }
    out.extend(current);
    out
}

/// A figure as the source writes it: `**1.10**`, `1,000`, `173×` and `0.235` all read.
fn number(cell: &str, what: &str) -> f64 {
    let t: String = cell
        .chars()
        .filter(|c| c.is_ascii_digit() || *c == '.' || *c == '-')
        .collect();
    t.parse()
        .unwrap_or_else(|_| panic!("{what}: `{cell}` is not a figure"))
}

/// Whether a quote is the source's value rounded to the decimals the quote shows. A
/// source that sits exactly halfway between two quotes (1.425 for two decimals) is
/// itself rounded from a value on either side, which its writer rounded to the quote
/// from: either quote agrees.
fn agrees(quoted: &str, source: f64) -> bool {
    let q = quoted.replace(',', "");
    let decimals = q.split_once('.').map_or(0, |(_, d)| d.len());
    if format!("{source:.decimals$}") == q {
        return true;
    }
    let half = 0.5 / 10f64.powi(i32::try_from(decimals).unwrap_or(i32::MAX));
    q.parse::<f64>()
        .is_ok_and(|v| ((v - source).abs() - half).abs() < half * 1e-6)
}

#[test]
fn a_quote_agrees_when_it_rounds_the_source_and_either_way_on_a_tie() {
    assert!(agrees("1.43", 1.4312));
    assert!(!agrees("1.44", 1.4312));
    // A table's 1.425 was rounded from a value on either side of it.
    assert!(agrees("1.42", 1.425) && agrees("1.43", 1.425));
    assert!(!agrees("1.41", 1.425) && !agrees("1.44", 1.425));
    assert!(!agrees("1.42", 1.4251) && !agrees("1.43", 1.4249));
    assert!(agrees("1,200", 1200.0) && !agrees("1,201", 1200.0));
}

/// The source's value as the source has it, and at the quote's precision if that
/// differs: "1.0 (1.00)".
fn shown(quoted: &str, source: f64) -> String {
    let decimals = quoted.split_once('.').map_or(0, |(_, d)| d.len());
    let rounded = format!("{source:.decimals$}");
    let plain = format!("{source}");
    if rounded == plain {
        plain
    } else {
        format!("{rounded} ({plain})")
    }
}

/// Problems found, each a line of the failure message.
#[derive(Default)]
struct Findings(Vec<String>);

impl Findings {
    fn quote(&mut self, s: &Sentence, figure: &str, quoted: &str, source: f64, from: &str) {
        if !agrees(quoted, source) {
            self.0.push(format!(
                "{}:{}: quotes {figure} as {quoted}, but its source ({from}) says {}; \
                 link to the source instead of restating it, or quote its value\n    in: {}",
                s.doc,
                s.line,
                shown(quoted, source),
                s.text
            ));
        }
    }

    fn range(&mut self, s: &Sentence, figure: &str, range: &str, from: &str) {
        self.0.push(format!(
            "{}:{}: quotes {figure} as a range, {range}, where its source ({from}) holds one \
             run's value; quote that value or link to it\n    in: {}",
            s.doc, s.line, s.text
        ));
    }

    fn assert_none(self, what: &str) {
        assert!(
            self.0.is_empty(),
            "{what}: {} problem(s), each a figure that is not its source's:\n{}",
            self.0.len(),
            self.0.join("\n")
        );
    }
}

/// For each match of `pattern` in every sentence of prose that `applies`, the figure it
/// quotes (the group named `q`) checked against `source`; a range (`q`–`hi`) never
/// agrees. Returns how many it found.
fn check(
    found: &mut Findings,
    sentences: &[Sentence],
    applies: impl Fn(&Sentence) -> bool,
    pattern: &str,
    figure: &str,
    source: f64,
    from: &str,
) -> usize {
    let re = re(pattern);
    let mut n = 0;
    for s in sentences.iter().filter(|s| applies(s)) {
        for c in re.captures_iter(&s.text) {
            n += 1;
            let q = c
                .name("q")
                .expect("the pattern names its figure `q`")
                .as_str();
            if let Some(hi) = c.name("hi") {
                found.range(s, figure, &format!("{q}–{}", hi.as_str()), from);
            } else {
                found.quote(s, figure, q, source, from);
            }
        }
    }
    n
}

fn mentions_agent(s: &Sentence) -> bool {
    static AGENT: LazyLock<Regex> = LazyLock::new(|| re(r"\bagent\b"));
    AGENT.is_match(&s.text)
}

/// The sentences about the agent's footprint: those that name the agent, and all of
/// the page about it.
fn about_the_agent(s: &Sentence) -> bool {
    s.doc == "docs/footprint.md" || mentions_agent(s)
}

// ---------------------------------------------------------------------------------
// The agent: CPU, RSS, binary size.

struct Agent {
    quiet_cpu: f64,
    busy_cpu: f64,
    rss: f64,
    binary: f64,
    /// node_exporter's RSS on the quiet host, the yardstick of the agent's.
    exporter_rss: f64,
}

const AGENT_BLOCK: &str = "the `agent` block of docs/performance.md (written by tests/ratios)";

fn agent_block() -> Agent {
    let doc = "docs/performance.md";
    let b = block(
        doc,
        &read(doc),
        "<!-- figures: agent -->",
        "<!-- figures: end -->",
    );
    let ts = tables(&b);
    assert_eq!(
        ts.len(),
        2,
        "{AGENT_BLOCK}: expected two tables (this host as it is, and busy)"
    );
    let row = |t: &Table| -> Vec<String> {
        t.rows
            .iter()
            .find(|r| r[0].starts_with("ballast-agent"))
            .unwrap_or_else(|| panic!("{AGENT_BLOCK}: no ballast-agent row"))
            .clone()
    };
    let (quiet, busy) = (row(&ts[0]), row(&ts[1]));
    let exporter = ts[0]
        .rows
        .iter()
        .find(|r| r[0].starts_with("node_exporter"))
        .unwrap_or_else(|| panic!("{AGENT_BLOCK}: no node_exporter row"));
    let cpu = ts[0].col("% of one core", AGENT_BLOCK);
    let rss = ts[0].col("RSS MiB", AGENT_BLOCK);
    let bin = ts[0].col("binary MiB", AGENT_BLOCK);
    Agent {
        quiet_cpu: number(&quiet[cpu], AGENT_BLOCK),
        busy_cpu: number(&busy[cpu], AGENT_BLOCK),
        rss: number(&quiet[rss], AGENT_BLOCK),
        binary: number(&quiet[bin], AGENT_BLOCK),
        exporter_rss: number(&exporter[rss], AGENT_BLOCK),
    }
}

/// A document's verdict on a target, beside the block that holds the figure: the first
/// match of `pattern` (its group `v` the verdict, `t` the target if it names one) in
/// `doc`, read across line breaks. A verdict among `met_words` must `meet` the target,
/// any other must `miss` it: a rerun that crosses the target makes the verdict stale.
#[allow(clippy::too_many_arguments)]
fn verdict(
    found: &mut Findings,
    doc: &str,
    pattern: &str,
    what: &str,
    met_words: &[&str],
    meets: impl Fn(f64) -> bool,
    misses: impl Fn(f64) -> bool,
    figure: &str,
    from: &str,
) {
    let text = read(doc);
    let c = re(pattern).captures(&text).unwrap_or_else(|| {
        panic!("{doc}: no verdict on {what} (`{pattern}`); update this test with its new phrasing")
    });
    let target = c.name("t").map_or(f64::NAN, |t| number(t.as_str(), doc));
    let says = c["v"]
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .to_lowercase();
    let says_met = met_words.contains(&says.as_str());
    let holds = if says_met {
        meets(target)
    } else {
        misses(target)
    };
    if !holds {
        let line = text[..c.get(0).expect("a match").start()]
            .matches('\n')
            .count()
            + 1;
        found.0.push(format!(
            "{doc}:{line}: says {what}: {says}, but {from} gives {figure}; rewrite the \
             verdict to the block's run\n    in: {}",
            c[0].split_whitespace().collect::<Vec<_>>().join(" ")
        ));
    }
}

#[test]
fn the_agents_cpu_rss_and_binary_are_the_ratio_bars() {
    let a = agent_block();
    let prose = prose();
    let mut found = Findings::default();
    let from = AGENT_BLOCK;
    // "0.235 % of a core on a quiet host", "0.34 % quiet", "0.58 % busy", "0.527 % with
    // `--busy 20000`", and a bare "the agent used 0.58 % of a core": each is the
    // agent's CPU, on a busy host where the sentence says so, on a quiet one otherwise.
    let cpu = re(concat!(
        r"(?P<q>\d+\.\d+)(?:–(?P<hi>\d+\.\d+))? ?%(?P<core> of (?:a|one) core)?",
        r"(?: (?:on (?:a|this|the) )?(?P<quiet>quiet)| on this host as it is(?P<quiet2>)",
        r"| (?:on (?:a|this|the) )?(?P<busy>busy)",
        r"| with `--busy(?P<busy2>))?"
    ));
    // Not measurements of the agent as it ships: a target, a source turned off, or
    // node_exporter beside it.
    let not_it = re(r"(?i)(?:target(?: of| is)?|\boff\b[^;]{0,30}|node_exporter[^;]{0,30}) $");
    for s in prose.iter().filter(|s| about_the_agent(s)) {
        for c in cpu.captures_iter(&s.text) {
            let whole = c.get(0).expect("a match");
            let busy = c.name("busy").is_some() || c.name("busy2").is_some();
            let quiet = c.name("quiet").is_some() || c.name("quiet2").is_some();
            if !(busy || quiet || c.name("core").is_some()) {
                continue;
            }
            if not_it.is_match(&s.text[..whole.start()]) {
                continue;
            }
            let busy = busy || (!quiet && s.text.contains("busy"));
            let (figure, source) = if busy {
                ("the agent's CPU on a busy host", a.busy_cpu)
            } else {
                ("the agent's CPU on a quiet host", a.quiet_cpu)
            };
            let q = c.name("q").expect("q").as_str();
            match c.name("hi") {
                Some(hi) => found.range(s, figure, &format!("{q}–{}", hi.as_str()), from),
                None => found.quote(s, figure, q, source, from),
            }
        }
    }
    // "RSS is 0.25 of node_exporter's (5.1 of 20.5 MiB", "an RSS of 5.3 MiB", "RSS 5.1 and".
    let rss = concat!(
        r"RSS (?:is |of |at )?(?:[^()]{0,40}\()?(?P<q>\d+\.\d+)(?:–(?P<hi>\d+\.\d+))?",
        r"(?: (?:of|and|against) \d+\.\d+)? MiB"
    );
    check(
        &mut found,
        &prose,
        mentions_agent,
        rss,
        "the agent's RSS",
        a.rss,
        from,
    );
    // "whose binary is 3.6 MiB", "halves the binary (3.6 against 7.0 MiB)", "a 3.8 MiB binary".
    let binary = concat!(
        r"binary(?:'s size)? (?:is |of |at )?\(?(?P<q>\d+\.\d+)(?:–(?P<hi>\d+\.\d+))?",
        r"(?: against \d+\.\d+)? MiB"
    );
    let size = "the agent's binary size";
    check(
        &mut found,
        &prose,
        mentions_agent,
        binary,
        size,
        a.binary,
        from,
    );
    let before = r"(?P<q>\d+\.\d+)(?:–(?P<hi>\d+\.\d+))? MiB (?:agent )?binary";
    check(
        &mut found,
        &prose,
        mentions_agent,
        before,
        size,
        a.binary,
        from,
    );
    // The verdicts on the targets, which the block's figures decide.
    let cpus = format!(
        "{} % on the quiet host and {} % on the busy one",
        a.quiet_cpu, a.busy_cpu
    );
    verdict(
        &mut found,
        "docs/performance.md",
        concat!(
            r"Target\s+of\s+(?P<t>\d+(?:\.\d+)?)\s+%\s+of\s+a\s+core:\s+(?P<v>met|missed)\*\*",
            r"\s+with\s+the\s+default\s+sources,\s+on\s+a\s+quiet\s+host\s+and\s+on\s+a\s+busy\s+one"
        ),
        "the agent's CPU target, on both hosts",
        &["met"],
        |t| a.quiet_cpu <= t && a.busy_cpu <= t,
        |t| a.quiet_cpu > t && a.busy_cpu > t,
        &cpus,
        from,
    );
    // "Memory: just over the target": a quarter of node_exporter's RSS or less.
    let share = a.rss / a.exporter_rss;
    verdict(
        &mut found,
        "docs/footprint.md",
        r"\*\*Memory:\s+(?P<v>just\s+over|over|within|under)\s+the\s+target\.\*\*",
        "the agent's memory target, a quarter of node_exporter's RSS",
        &["within", "under"],
        |_| share <= 0.25,
        |_| share > 0.25,
        &format!("{} of {} MiB, {share:.3} of it", a.rss, a.exporter_rss),
        from,
    );
    found.assert_none("the agent's footprint");
}

/// Like [`check`], for a pattern that quotes several figures at once: each named group
/// of `groups` against its source. Returns how many sentences matched.
fn check_groups(
    found: &mut Findings,
    sentences: &[Sentence],
    applies: impl Fn(&Sentence) -> bool,
    pattern: &str,
    groups: &[(&str, &str, f64)],
    from: &str,
) -> usize {
    let re = re(pattern);
    let mut n = 0;
    for s in sentences.iter().filter(|s| applies(s)) {
        for c in re.captures_iter(&s.text) {
            n += 1;
            for (name, figure, source) in groups {
                let q = c
                    .name(name)
                    .unwrap_or_else(|| panic!("the pattern names no group `{name}`"));
                found.quote(s, figure, q.as_str(), *source, from);
            }
        }
    }
    n
}

fn everywhere(_: &Sentence) -> bool {
    true
}

// ---------------------------------------------------------------------------------
// Encoded sizes: computed with the wire encoder.

fn encoded(m: Message) -> f64 {
    let bytes = wire::encode(&m).unwrap_or_else(|e| panic!("encoding {m:?}: {e}"));
    bytes.len() as f64
}

/// The reports of `docs/protocol.md`'s table (those `cargo bench -p ballast-sim --bench
/// figures` prints): a typical one, and every field at its maximum.
fn reports() -> (f64, f64) {
    (
        encoded(Message::Report(examples::typical_report())),
        encoded(Message::Report(examples::largest_report())),
    )
}

/// A reply at `cycle`, telling the agent to report every `interval_ms`.
fn reply(cycle: u64, interval_ms: u32) -> f64 {
    encoded(Message::Reply(examples::reply(cycle, interval_ms)))
}

fn hello() -> f64 {
    encoded(Message::Hello(examples::hello()))
}

/// Every size a reply can have at the intervals the ingest bench sets (100 and
/// 1,000 ms), whatever its cycle.
fn reply_sizes() -> BTreeSet<u64> {
    let cycles = [0, 251, 65_536, 1 << 32];
    let mut out = BTreeSet::new();
    for c in cycles {
        for i in [100, 1000] {
            out.insert(reply(c, i) as u64);
        }
    }
    out
}

#[test]
fn encoded_sizes_are_the_encoders_and_the_measured_replies_are_sizes_a_reply_has() {
    let (typical, worst) = reports();
    let from = "the wire encoder, `ballast_shared::wire::encode`";
    let mut found = Findings::default();

    // docs/protocol.md's table: the one place the sizes are written.
    let doc = "docs/protocol.md";
    let text = read(doc);
    let section: String = text
        .split("\n## ")
        .find(|s| s.starts_with("Sizes"))
        .unwrap_or_else(|| panic!("{doc} has no `## Sizes` section"))
        .to_string();
    let table = tables(&section)
        .into_iter()
        .find(|t| t.header.first().is_some_and(|h| h == "message"))
        .unwrap_or_else(|| panic!("{doc}: no `| message | bytes |` table under `## Sizes`"));
    let cycle = re(r"cycle (?P<c>[\d,]+)");
    let interval = re(r"interval (?P<i>[\d,]+) ms");
    let int = |s: &str| -> u64 { s.replace(',', "").parse().expect("an integer") };
    let mut rows = 0;
    for row in &table.rows {
        let (label, bytes) = (&row[0], &row[1]);
        let computed = if label.starts_with("report, typical") {
            typical
        } else if label.starts_with("report, every field at its maximum") {
            worst
        } else if label.starts_with("hello") {
            hello()
        } else if label.starts_with("reply") {
            let c = cycle.captures(label).unwrap_or_else(|| {
                panic!("{doc}: the reply row `{label}` names no cycle (its size depends on it)")
            });
            let i = interval.captures(label).unwrap_or_else(|| {
                panic!("{doc}: the reply row `{label}` names no interval (its size depends on it)")
            });
            reply(int(&c["c"]), int(&i["i"]) as u32)
        } else {
            panic!("{doc}: a size row this test does not know, `{label}`: teach it the message");
        };
        rows += 1;
        if !agrees(bytes, computed) {
            found.0.push(format!(
                "{doc}: `{label}` is {bytes} bytes in the table, {computed} by {from}"
            ));
        }
    }
    assert!(rows >= 4, "{doc}: the sizes table has {rows} rows");

    // No other copy of that table: it is linked to.
    for (d, t) in docs() {
        if d != doc && tables(&t).iter().any(|t| t.header == ["message", "bytes"]) {
            found.0.push(format!(
                "{d}: a table of encoded sizes besides {doc}'s; link to {doc}#sizes instead"
            ));
        }
    }

    // The ingest block measured the replies each server sent: the bare server's is the
    // figures bench's reply of cycle 86,400; the aggregator's must be a size a reply has.
    let perf = "docs/performance.md";
    let ingest = block(
        perf,
        &read(perf),
        "<!-- figures: ingest -->",
        "<!-- figures: end -->",
    );
    let sizes = reply_sizes();
    let bare = reply(86_400, 1000);
    let measured = re(r"\((?P<who>a|b)\) [a-z -]+: replies of (?P<lo>\d+)(?:–(?P<hi>\d+))? bytes");
    let mut seen = 0;
    for c in measured.captures_iter(&ingest) {
        seen += 1;
        for n in [c.name("lo"), c.name("hi")].into_iter().flatten() {
            let n: u64 = n.as_str().parse().expect("a size");
            let ok = if &c["who"] == "a" {
                n as f64 == bare
            } else {
                sizes.contains(&n)
            };
            if !ok {
                found.0.push(format!(
                    "{perf}, the ingest block: `{}`, but a reply is {sizes:?} bytes by {from} \
                     (the bare server's, cycle 86,400, {bare})",
                    &c[0]
                ));
            }
        }
    }
    assert!(seen > 0, "{perf}: the ingest block names no reply size");

    // Prose: "a report is 13 bytes", "13-byte reports", "a fixed 20-byte reply",
    // "replies of 14 bytes", "the aggregator's are 14 or 16 bytes".
    let prose = prose();
    let report =
        r"(?:report is (?P<q>\d+) bytes|(?P<q2>\d+)-byte reports?\b|reports of (?P<q3>\d+) bytes)";
    let re_report = re(report);
    for s in &prose {
        for c in re_report.captures_iter(&s.text) {
            let q = c
                .name("q")
                .or(c.name("q2"))
                .or(c.name("q3"))
                .expect("a size");
            found.quote(s, "a typical report's size", q.as_str(), typical, from);
        }
    }
    let fixed = r"fixed (?P<q>\d+)-byte reply";
    check(
        &mut found,
        &prose,
        everywhere,
        fixed,
        "the bench's reply (cycle 86,400)",
        bare,
        from,
    );
    let replies =
        re(r"(?:replies|reply|aggregator's) (?:are|is|of) (?P<q>\d+)(?: or (?P<q2>\d+))? bytes");
    for s in &prose {
        for c in replies.captures_iter(&s.text) {
            for q in [c.name("q"), c.name("q2")].into_iter().flatten() {
                let n: u64 = q.as_str().parse().expect("a size");
                if !sizes.contains(&n) {
                    found.0.push(format!(
                        "{}:{}: a reply of {n} bytes, but a reply is {sizes:?} bytes by {from}\n    in: {}",
                        s.doc, s.line, s.text
                    ));
                }
            }
        }
    }
    found.assert_none("encoded sizes");
}

// ---------------------------------------------------------------------------------
// Fuzz targets: the files are the truth.

fn fuzz_targets() -> BTreeSet<String> {
    let dir = root().join("fuzz/fuzz_targets");
    std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter_map(|n| n.strip_suffix(".rs").map(str::to_string))
        .collect()
}

const NUMBERS: &[&str] = &[
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
    "twenty",
    "twenty-one",
    "twenty-two",
    "twenty-three",
    "twenty-four",
    "twenty-five",
];

#[test]
fn the_fuzz_targets_counted_and_listed_are_the_files() {
    let files = fuzz_targets();
    let count = files.len();
    assert!(count > 0, "fuzz/fuzz_targets/ holds no target");
    let mut found = Findings::default();

    // Each file is a [[bin]] of fuzz/Cargo.toml, and each [[bin]] a file.
    let manifest = read("fuzz/Cargo.toml");
    let bins: BTreeSet<String> = re(r#"(?m)^name = "(?P<n>[a-z0-9_]+)"\s*\npath = "fuzz_targets/"#)
        .captures_iter(&manifest)
        .map(|c| c["n"].to_string())
        .collect();
    if bins != files {
        found.0.push(format!(
            "fuzz/Cargo.toml's targets {bins:?} are not the files of fuzz/fuzz_targets/ {files:?}"
        ));
    }

    // docs/reliability.md's table of targets lists every one.
    let doc = "docs/reliability.md";
    let text = read(doc);
    let listed: BTreeSet<String> = tables(&text)
        .into_iter()
        .find(|t| t.header.first().is_some_and(|h| h == "Target") && t.header.len() == 3)
        .unwrap_or_else(|| panic!("{doc}: no `| Target | Parser | Invariants |` table"))
        .rows
        .iter()
        .map(|r| r[0].trim_matches('`').to_string())
        .collect();
    if listed != files {
        found.0.push(format!(
            "{doc}: the table of targets lists {} of the {count} in fuzz/fuzz_targets/: \
             missing {:?}, not a target {:?}",
            listed.intersection(&files).count(),
            files.difference(&listed).collect::<Vec<_>>(),
            listed.difference(&files).collect::<Vec<_>>()
        ));
    }

    // The fuzz-bench block: every row a target; the prose names the ones it lacks.
    let bench = block(
        doc,
        &text,
        "<!-- fuzz-bench: begin",
        "<!-- fuzz-bench: end -->",
    );
    let benched: BTreeSet<String> = tables(&bench)
        .into_iter()
        .flat_map(|t| t.rows)
        .map(|r| r[0].trim_matches('`').to_string())
        .collect();
    for b in benched.difference(&files) {
        found.0.push(format!(
            "{doc}, the fuzz-bench block: `{b}` is not a target of fuzz/fuzz_targets/"
        ));
    }
    let lacking: BTreeSet<String> = files.difference(&benched).cloned().collect();
    let prose = prose();
    let named = re(r"`(?P<t>[a-z0-9_]+)`");
    let not_joined: Vec<&Sentence> = prose
        .iter()
        .filter(|s| s.doc == doc && s.text.contains("not joined"))
        .collect();
    if !lacking.is_empty() && not_joined.is_empty() {
        found.0.push(format!(
            "{doc}: the long runs lack {lacking:?}, and no sentence says they have not joined"
        ));
    }
    for s in not_joined {
        let (_, after) = s.text.split_once("not joined").expect("it is there");
        let before = &s.text[..s.text.len() - after.len()];
        // The targets named in the clause that says so.
        let clause = before.rsplit([';', '(']).next().unwrap_or(before);
        let said: BTreeSet<String> = named
            .captures_iter(clause)
            .map(|c| c["t"].to_string())
            .filter(|t| files.contains(t) || benched.contains(t))
            .collect();
        if said != lacking {
            found.0.push(format!(
                "{}:{}: says {said:?} have not joined the long runs; the fuzz-bench block lacks \
                 {lacking:?}\n    in: {}",
                s.doc, s.line, s.text
            ));
        }
    }

    // "16 fuzz targets", "sixteen targets": the count of files.
    let words = NUMBERS.join("|");
    let counted = re(&format!(
        r"(?i)\b(?P<n>\d+|{words}) (?:cargo-fuzz |fuzz |libFuzzer )?targets\b"
    ));
    for s in &prose {
        for c in counted.captures_iter(&s.text) {
            let n = &c["n"];
            let value = n
                .parse::<usize>()
                .ok()
                .or_else(|| NUMBERS.iter().position(|w| w.eq_ignore_ascii_case(n)));
            if value != Some(count) {
                found.0.push(format!(
                    "{}:{}: `{}`, but fuzz/fuzz_targets/ holds {count}\n    in: {}",
                    s.doc, s.line, &c[0], s.text
                ));
            }
        }
    }
    found.assert_none("fuzz targets");
}

// ---------------------------------------------------------------------------------
// Failover: docs/scale.md's measured rows, and goals computed from lease and cycle.

#[test]
fn failover_goals_follow_lease_and_cycle_and_quotes_are_scales_rows() {
    let doc = "docs/scale.md";
    let text = read(doc);
    let mut found = Findings::default();

    // Each goal is the lease and two cycles of its section's set-up.
    let cycle_re = re(r"(?P<ms>\d+) ms cycles");
    let lease_re = re(r"(?:a (?P<a>\d+) s lease|the lease's (?P<b>\d+) s)");
    // Read across line breaks: a section's text, not a sentence of prose.
    let goal_re = re(concat!(
        r"goal(?::|\s+is)?\s+(?:the\s+lease's\s+(?P<lease>\d+)\s+s\s+and\s+two\s+cycles,\s+)?",
        r"(?P<q>\d+(?:\.\d+)?)\s+s\b"
    ));
    let mut goals = 0;
    for section in text.split("\n## ") {
        let title = section.lines().next().unwrap_or("");
        for c in goal_re.captures_iter(section) {
            goals += 1;
            let cycle = cycle_re.captures(section).unwrap_or_else(|| {
                panic!("{doc}, `{title}`: a failover goal, and no `N ms cycles` to check it by")
            });
            let lease = c
                .name("lease")
                .map(|m| m.as_str().to_string())
                .or_else(|| {
                    lease_re
                        .captures(section)
                        .and_then(|l| l.name("a").or(l.name("b")))
                        .map(|m| m.as_str().to_string())
                })
                .unwrap_or_else(|| panic!("{doc}, `{title}`: a failover goal and no lease"));
            let lease: f64 = lease.parse().expect("seconds");
            let cycle: f64 = cycle["ms"].parse::<f64>().expect("ms") / 1000.0;
            let goal = lease + 2.0 * cycle;
            // Computed, not measured: exactly, not to the quote's precision.
            let quoted: f64 = c["q"].parse().expect("seconds");
            if (quoted - goal).abs() > 1e-9 {
                found.0.push(format!(
                    "{doc}, `{title}`: the goal `{}` is not the lease ({lease} s) and two \
                     cycles ({cycle} s each): {goal} s",
                    c[0].split_whitespace().collect::<Vec<_>>().join(" ")
                ));
            }
        }
    }
    assert!(
        goals >= 2,
        "{doc}: {goals} failover goals found, expected the cluster's and the relay's"
    );

    // The measured rows: the owner SIGKILLed, in the cluster's table.
    let killed = re(concat!(
        r"\| the owner of a service is SIGKILLed \| another replica owns it \| ",
        r"(?P<lo>\d+\.\d+)–(?P<hi>\d+\.\d+) s after the kill"
    ));
    let k = killed
        .captures(&text)
        .unwrap_or_else(|| panic!("{doc}: no row `the owner of a service is SIGKILLed`"));
    let (lo, hi) = (k["lo"].to_string(), k["hi"].to_string());
    let weights_re = re(
        r"\| \| the weights the new owner writes first[^|]*\| within (?P<lo>\d+\.\d+)–(?P<hi>\d+\.\d+) of each other",
    );
    let w = weights_re
        .captures(&text)
        .unwrap_or_else(|| panic!("{doc}: no row `the weights the new owner writes first`"));
    let (wlo, whi) = (w["lo"].to_string(), w["hi"].to_string());
    // The slowest handover measured, in any of the tables.
    let slowest: f64 = re(r"another replica own(?:s|ed) it (?:\| )?\d+\.\d+–(?P<hi>\d+\.\d+) s")
        .captures_iter(&text)
        .map(|c| c["hi"].parse::<f64>().expect("seconds"))
        .fold(0.0, f64::max);
    assert!(
        slowest > 0.0,
        "{doc}: no measured handover (`another replica owns it`)"
    );

    let from = "the cluster's measured rows in docs/scale.md";
    let prose = prose();
    let elsewhere = |s: &Sentence| s.doc != doc;
    // "failover 2.4–3.3 s", "weights within 0.011–0.020 of the last written".
    let range = |found: &mut Findings, pattern: &str, figure: &str, lo: &str, hi: &str| {
        let r = re(pattern);
        for s in prose.iter().filter(|s| elsewhere(s)) {
            for c in r.captures_iter(&s.text) {
                let q = c.name("q").expect("q").as_str();
                let h = c.name("hi").map_or("", |m| m.as_str());
                if q != lo || h != hi {
                    found.0.push(format!(
                        "{}:{}: quotes {figure} as {q}{}{h}, but {from} say {lo}–{hi}\n    in: {}",
                        s.doc,
                        s.line,
                        if h.is_empty() { "" } else { "–" },
                        s.text
                    ));
                }
            }
        }
    };
    range(
        &mut found,
        r"failover (?:in |of |within )?(?P<q>\d+\.\d+)(?:–(?P<hi>\d+\.\d+))? s",
        "failover",
        &lo,
        &hi,
    );
    range(
        &mut found,
        r"weights within (?P<q>\d+\.\d+)(?:–(?P<hi>\d+\.\d+))? of the last (?:ones )?written",
        "the new owner's weights",
        &wlo,
        &whi,
    );
    // The lease itself, as the cluster's set-up gives it.
    let lease = re(r"a (?P<s>\d+) s lease")
        .captures(&text)
        .map(|c| c["s"].parse::<f64>().expect("seconds"))
        .unwrap_or_else(|| panic!("{doc}: the cluster's set-up gives no `a N s lease`"));
    let lease_re = r"(?:etcd lease|lease's|lease of) \(?(?P<q>\d+(?:\.\d+)?) s\b";
    let figure = "the etcd lease (s)";
    check(&mut found, &prose, elsewhere, lease_re, figure, lease, doc);
    // "hands its services on within its etcd lease (3 s)": only if no run took longer.
    let within =
        re(r"within (?:its etcd |the |its )lease \((?P<q>\d+) s\)(?P<more> and two cycles)?");
    for s in &prose {
        for c in within.captures_iter(&s.text) {
            let lease: f64 = c["q"].parse().expect("seconds");
            if c.name("more").is_none() && slowest > lease {
                found.0.push(format!(
                    "{}:{}: says failover is within the lease ({lease} s), but {doc} measured up \
                     to {slowest} s (the goal is the lease and two cycles)\n    in: {}",
                    s.doc, s.line, s.text
                ));
            }
        }
    }
    found.assert_none("failover");
}

// ---------------------------------------------------------------------------------
// The lab's headline: docs/lab.md, written whole by the lab.

#[test]
fn the_labs_headline_is_the_labs() {
    let doc = "docs/lab.md";
    let text = read(doc);
    let from = "docs/lab.md, written by the lab";
    let results = tables(&text)
        .into_iter()
        .find(|t| t.header.first().is_some_and(|h| h == "run"))
        .unwrap_or_else(|| panic!("{doc}: no results table (`| run | window | max/avg |`)"));
    let maxavg = results.col("max/avg", doc);
    let p99 = results.col("p99 ms", doc);
    let run = |prefix: &str| -> (f64, f64) {
        let r = results
            .rows
            .iter()
            .find(|r| r[0].starts_with(prefix))
            .unwrap_or_else(|| panic!("{doc}: no run `{prefix}` in the results"));
        (number(&r[maxavg], doc), number(&r[p99], doc))
    };
    let (rr, rr_p99) = run("1. round robin");
    let (oracle, oracle_p99) = run("2. oracle");
    let (ballast, ballast_p99) = run("3. Ballast");
    let targets = tables(&text)
        .into_iter()
        .find(|t| t.header.first().is_some_and(|h| h == "target"))
        .unwrap_or_else(|| panic!("{doc}: no targets table"));
    let target = |prefix: &str| -> f64 {
        let r = targets
            .rows
            .iter()
            .find(|r| r[0].starts_with(prefix))
            .unwrap_or_else(|| panic!("{doc}: no target `{prefix}`"));
        let first = r[1].split_whitespace().next().unwrap_or("");
        number(first, doc)
    };
    let converged = target("converged");
    let stalled = target("the stalled backend's share");

    let prose = prose();
    let mut found = Findings::default();
    let n = check_groups(
        &mut found,
        &prose,
        everywhere,
        r"(?i)round robin leaves[^;]*?\(max/avg (?P<m>\d\.\d+), p99 (?P<p>\d+) ms\)",
        &[
            ("m", "round robin's max/avg in the lab", rr),
            ("p", "round robin's p99 (ms) in the lab", rr_p99),
        ],
        from,
    );
    assert!(n > 0, "README.md: the lab's round robin headline is not found; update this test with its new phrasing");
    let n = check_groups(
        &mut found,
        &prose,
        everywhere,
        r"the oracle, gives? (?P<m>\d\.\d+) and p99 (?P<p>\d+) ms",
        &[
            ("m", "the oracle's max/avg in the lab", oracle),
            ("p", "the oracle's p99 (ms) in the lab", oracle_p99),
        ],
        from,
    );
    assert!(
        n > 0,
        "README.md: the lab's oracle headline is not found; update this test with its new phrasing"
    );
    let n = check_groups(
        &mut found,
        &prose,
        everywhere,
        r"Ballast gives (?P<m>\d\.\d+) and p99 (?P<p>\d+) ms",
        &[
            ("m", "Ballast's max/avg in the lab", ballast),
            ("p", "Ballast's p99 (ms) in the lab", ballast_p99),
        ],
        from,
    );
    assert!(n > 0, "README.md: the lab's Ballast headline is not found; update this test with its new phrasing");
    let conv = r"within (?P<q>\d+) s of the first reports";
    check(
        &mut found,
        &prose,
        everywhere,
        conv,
        "the lab's convergence (s)",
        converged,
        from,
    );
    let stall = r"stalled on I/O drops to (?P<q>\d+(?:\.\d+)?) % of the new requests";
    check(
        &mut found,
        &prose,
        everywhere,
        stall,
        "the stalled backend's share in the lab (%)",
        stalled,
        from,
    );
    found.assert_none("the lab's headline");
}

// ---------------------------------------------------------------------------------
// The simulator's headline: docs/balance.md, written whole by the simulator.

#[test]
fn the_simulators_headline_is_the_simulators() {
    let doc = "docs/balance.md";
    let text = read(doc);
    let from = "docs/balance.md, written by the simulator";
    let steady = text
        .split("\n## ")
        .find(|s| s.starts_with("Steady heterogeneous fleet"))
        .unwrap_or_else(|| panic!("{doc}: no `## Steady heterogeneous fleet` section"));
    let table = tables(steady)
        .into_iter()
        .find(|t| t.header.first().is_some_and(|h| h == "strategy"))
        .unwrap_or_else(|| panic!("{doc}: no table of strategies in the steady fleet"));
    let col = table.col("max/avg", doc);
    let strategy = |name: &str| -> f64 {
        let r = table
            .rows
            .iter()
            .find(|r| r[0] == name)
            .unwrap_or_else(|| panic!("{doc}: no strategy `{name}` in the steady fleet"));
        number(&r[col], doc)
    };
    let mut found = Findings::default();
    let prose = prose();
    let n = check_groups(
        &mut found,
        &prose,
        everywhere,
        concat!(
            r"Ballast holds max/avg at (?P<b>\d\.\d+) where round robin gives (?P<rr>\d\.\d+), ",
            r"gRPC's weighted round robin (?P<a>\d\.\d+) and power of two choices (?P<p>\d\.\d+)"
        ),
        &[
            (
                "b",
                "Ballast's max/avg in the simulator",
                strategy("Ballast PID"),
            ),
            (
                "rr",
                "round robin's max/avg in the simulator",
                strategy("round robin"),
            ),
            (
                "a",
                "gRPC A58's max/avg in the simulator",
                strategy("gRPC A58 WRR"),
            ),
            (
                "p",
                "P2C's max/avg in the simulator",
                strategy("P2C least request"),
            ),
        ],
        from,
    );
    assert!(
        n > 0,
        "README.md: the simulator's headline is not found; update this test with its new phrasing"
    );
    found.assert_none("the simulator's headline");
}

// ---------------------------------------------------------------------------------
// Ingest and the cycle: the ratio bar's blocks.

#[test]
fn ingest_ratios_and_cycle_time_are_the_ratio_bars() {
    let doc = "docs/performance.md";
    let text = read(doc);
    let mut found = Findings::default();
    let prose = prose();

    let ingest = block(
        doc,
        &text,
        "<!-- figures: ingest -->",
        "<!-- figures: end -->",
    );
    let table = tables(&ingest)
        .into_iter()
        .next()
        .unwrap_or_else(|| panic!("{doc}: the ingest block has no table"));
    let ratio_col = table.col("(b)/(a)", "the ingest block");
    let ratio = |pattern: &str| -> f64 {
        let r = table
            .rows
            .iter()
            .find(|r| r[0].starts_with(pattern) && !r[ratio_col].is_empty())
            .unwrap_or_else(|| panic!("{doc}: the ingest block has no ratio for `{pattern}`"));
        number(&r[ratio_col], "the ingest block")
    };
    let fleet = [
        ratio("200 × 10 Hz"),
        ratio("2,000 × 1 Hz"),
        ratio("10,000 × 1 Hz"),
    ];
    let from = "the `ingest` block of docs/performance.md (written by tests/ratios)";
    // "(b)/(a) of 0.86, 0.95 and 1.01": the three fleet patterns, in the block's order.
    check_groups(
        &mut found,
        &prose,
        everywhere,
        r"\(b\)/\(a\) of (?P<a>\d\.\d\d), (?P<b>\d\.\d\d) and (?P<c>\d\.\d\d)",
        &[
            ("a", "the ingest ratio at 200 × 10 Hz", fleet[0]),
            ("b", "the ingest ratio at 2,000 × 1 Hz", fleet[1]),
            ("c", "the ingest ratio at 10,000 × 1 Hz", fleet[2]),
        ],
        from,
    );
    // "0.83–0.94 of the bare server": a present-tense range of ratios.
    let of_bare = re(r"(?P<q>\d\.\d\d)(?:–(?P<hi>\d\.\d\d))? of the bare server");
    for s in &prose {
        for c in of_bare.captures_iter(&s.text) {
            let q = &c["q"];
            match c.name("hi") {
                Some(hi) => {
                    found.range(s, "the ingest ratio", &format!("{q}–{}", hi.as_str()), from)
                }
                None => {
                    if !fleet.iter().any(|r| agrees(q, *r)) {
                        found.quote(s, "the ingest ratio", q, fleet[0], from);
                    }
                }
            }
        }
    }

    let cycle = block(
        doc,
        &text,
        "<!-- figures: cycle -->",
        "<!-- figures: end -->",
    );
    let table = tables(&cycle)
        .into_iter()
        .next()
        .unwrap_or_else(|| panic!("{doc}: the cycle block has no table"));
    let row = |endpoints: &str| -> Vec<String> {
        table
            .rows
            .iter()
            .find(|r| r[0].replace(',', "") == endpoints)
            .unwrap_or_else(|| panic!("{doc}: the cycle block has no row for {endpoints}"))
            .clone()
    };
    let what = "the cycle block";
    let (big, small) = (row("100000"), row("10000"));
    let both = number(&big[table.col("cycle + publish, ms", what)], what);
    let cycle_ms = number(&big[table.col("cycle, ms", what)], what);
    let publish = number(&big[table.col("publish, ms", what)], what);
    let ratio = number(&big[table.col("ratio", what)], what);
    let both_small = number(&small[table.col("cycle + publish, ms", what)], what);
    let from = "the `cycle` block of docs/performance.md (written by tests/ratios)";
    let not_target = |s: &Sentence| !s.text.contains("Target: ");
    let at_100k =
        r"(?P<q>\d+(?:\.\d+)?)(?:–(?P<hi>\d+(?:\.\d+)?))? ms (?:a cycle )?at 100,000 endpoints";
    let fig = "the cycle and publication at 100,000 endpoints (ms)";
    check(&mut found, &prose, not_target, at_100k, fig, both, from);
    check(
        &mut found,
        &prose,
        everywhere,
        r"(?P<q>\d+(?:\.\d+)?) ms in the ratio bar's run",
        fig,
        both,
        from,
    );
    let parts = re(concat!(
        r"\((?P<c>\d+(?:\.\d+)?)(?:–(?P<chi>\d+(?:\.\d+)?))? of cycle, ",
        r"(?P<p>\d+(?:\.\d+)?)(?:–(?P<phi>\d+(?:\.\d+)?))? of publication"
    ));
    for s in &prose {
        for c in parts.captures_iter(&s.text) {
            for (q, hi, figure, source) in [
                ("c", "chi", "the cycle at 100,000 endpoints (ms)", cycle_ms),
                (
                    "p",
                    "phi",
                    "the publication at 100,000 endpoints (ms)",
                    publish,
                ),
            ] {
                let v = &c[q];
                match c.name(hi) {
                    Some(h) => found.range(s, figure, &format!("{v}–{}", h.as_str()), from),
                    None => found.quote(s, figure, v, source, from),
                }
            }
        }
    }
    let at_10k = r"(?P<q>\d+(?:\.\d+)?)(?:–(?P<hi>\d+(?:\.\d+)?))? ms at 10,000\b";
    let fig = "the cycle and publication at 10,000 endpoints (ms)";
    check(
        &mut found, &prose, everywhere, at_10k, fig, both_small, from,
    );
    let trivial = r"(?P<q>\d+)× the trivial pass";
    check(
        &mut found,
        &prose,
        everywhere,
        trivial,
        "the cycle's ratio to the trivial pass",
        ratio,
        from,
    );
    verdict(
        &mut found,
        doc,
        concat!(
            r"Target:\s+(?P<t>\d+(?:\.\d+)?)\s+ms\s+at\s+100,000\s+endpoints,\s+cycle\s+and\s+",
            r"publication\s+together\.\s+(?P<v>Met|Missed)\b"
        ),
        "the target for the cycle and publication at 100,000 endpoints",
        &["met"],
        |t| both <= t,
        |t| both > t,
        &format!("{both} ms"),
        from,
    );
    found.assert_none("ingest and the cycle");
}

// ---------------------------------------------------------------------------------
// The soak's memory: its block in docs/reliability.md.

#[test]
fn the_soaks_memory_is_the_soaks() {
    let doc = "docs/reliability.md";
    let soak = block(doc, &read(doc), "<!-- soak:begin -->", "<!-- soak:end -->");
    let table = tables(&soak)
        .into_iter()
        .find(|t| t.header.first().is_some_and(|h| h == "figure"))
        .unwrap_or_else(|| panic!("{doc}: the soak block has no table of figures"));
    let row = |name: &str| -> (f64, f64) {
        let r = table
            .rows
            .iter()
            .find(|r| r[0].starts_with(name))
            .unwrap_or_else(|| panic!("{doc}: the soak block has no `{name}`"));
        (number(&r[1], doc), number(&r[2], doc))
    };
    let (agg0, agg1) = row("aggregator RSS");
    let (agent0, agent1) = row("agent RSS");
    let mut found = Findings::default();
    check_groups(
        &mut found,
        &prose(),
        everywhere,
        concat!(
            r"aggregator (?P<a0>\d+\.\d) → (?P<a1>\d+\.\d) MB, ",
            r"one agent (?P<g0>\d+\.\d) → (?P<g1>\d+\.\d) MB"
        ),
        &[
            (
                "a0",
                "the aggregator's RSS after the soak's warm-up (MB)",
                agg0,
            ),
            ("a1", "the aggregator's RSS at the soak's end (MB)", agg1),
            ("g0", "an agent's RSS after the soak's warm-up (MB)", agent0),
            ("g1", "an agent's RSS at the soak's end (MB)", agent1),
        ],
        "the soak block of docs/reliability.md",
    );
    found.assert_none("the soak");
}

// ---------------------------------------------------------------------------------
// Links to the sources: a figure replaced by a link needs the link to land.

/// The anchors GitHub gives a document's headings: lower case, punctuation dropped but
/// `-` and `_`, spaces as `-`, and `-1`, `-2` after repeats.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut in_fence = false;
    for l in text.lines() {
        if l.trim_start().starts_with("```") {
            in_fence = !in_fence;
            continue;
        }
        if in_fence || !l.starts_with('#') {
            continue;
        }
        let title = l.trim_start_matches('#').trim();
        let slug: String = title
            .to_lowercase()
            .chars()
            .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
            .map(|c| if c == ' ' { '-' } else { c })
            .collect();
        let mut candidate = slug.clone();
        let mut n = 0;
        while out.contains(&candidate) {
            n += 1;
            candidate = format!("{slug}-{n}");
        }
        out.insert(candidate);
    }
    out
}

/// The documents that hold the figures' sources.
const SOURCES: &[&str] = &[
    "docs/performance.md",
    "docs/reliability.md",
    "docs/protocol.md",
    "docs/scale.md",
    "docs/lab.md",
    "docs/balance.md",
    "docs/footprint.md",
];

#[test]
fn links_to_the_sources_land_on_a_heading() {
    let link = re(r"\]\((?P<path>[A-Za-z0-9_./-]*\.md)?#(?P<anchor>[^)\s]+)\)");
    let mut found = Findings::default();
    let mut checked = 0;
    for (doc, text) in docs() {
        let dir = Path::new(&doc).parent().unwrap_or(Path::new(""));
        for c in link.captures_iter(&text) {
            let target = match c.name("path") {
                None => doc.clone(),
                Some(p) => {
                    let joined = dir.join(p.as_str());
                    let mut parts: Vec<String> = Vec::new();
                    for part in joined.components() {
                        match part.as_os_str().to_str() {
                            Some("..") => {
                                parts.pop();
                            }
                            Some(".") | None => {}
                            Some(s) => parts.push(s.to_string()),
                        }
                    }
                    parts.join("/")
                }
            };
            if !SOURCES.contains(&target.as_str()) {
                continue;
            }
            checked += 1;
            let anchor = &c["anchor"];
            if !anchors(&read(&target)).contains(anchor) {
                found.0.push(format!(
                    "{doc}: the link `{}` names no heading of {target}",
                    &c[0]
                ));
            }
        }
    }
    assert!(checked > 0, "no link to a source's heading was found");
    found.assert_none("links to the figures' sources");
}
