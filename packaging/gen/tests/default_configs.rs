//! The configuration files the packages install under /etc/ballast tell the truth: as
//! shipped they give the built-in defaults, every commented `#key = value` line still
//! gives them when uncommented (so each is the default it claims to be), and every
//! setting the daemons know is mentioned.

use ballast_agent::config::AgentConfig;
use ballast_aggregator::config::Config;
use serde_json::Value;

const AGENT_TOML: &str = include_str!("../../etc/agent.toml");
const AGGREGATOR_TOML: &str = include_str!("../../etc/aggregator.toml");

/// The file with every default line uncommented: `#key = value` and `#[table]`, not the
/// indented `#   ` examples or prose.
fn uncommented(text: &str) -> String {
    text.lines()
        .map(|line| match line.strip_prefix('#') {
            Some(rest) if rest.starts_with(|c: char| c.is_ascii_lowercase() || c == '[') => rest,
            _ => line,
        })
        .map(|line| format!("{line}\n"))
        .collect()
}

/// Asserts that each key of `value` (recursing into tables the file has a header for)
/// appears in `text` as `key = ` or as a table header, commented or not.
fn assert_documented(text: &str, value: &Value, prefix: &str, file: &str) {
    let Value::Object(map) = value else { return };
    for (key, v) in map {
        let path = format!("{prefix}{key}");
        let header = format!("[{path}]");
        if v.is_object() && text.contains(&header) {
            assert_documented(text, v, &format!("{path}."), file);
        } else {
            assert!(
                text.contains(&format!("{key} = ")) || text.contains(&header),
                "{file} does not mention the setting {path}"
            );
        }
    }
}

#[test]
fn the_agent_file_as_shipped_and_uncommented_is_the_default() {
    let defaults = AgentConfig::default().resolve();
    let shipped = AgentConfig::parse(AGENT_TOML, "agent.toml").expect("shipped file parses");
    assert_eq!(shipped.resolve(), defaults);
    let all = uncommented(AGENT_TOML);
    assert_ne!(all, AGENT_TOML, "the file has commented defaults");
    let uncommented =
        AgentConfig::parse(&all, "agent.toml (uncommented)").expect("uncommented file parses");
    assert_eq!(uncommented.resolve(), defaults);
}

#[test]
fn the_agent_file_mentions_every_setting() {
    let value = serde_json::to_value(AgentConfig::default()).expect("serializes");
    assert_documented(AGENT_TOML, &value, "", "agent.toml");
}

#[test]
fn the_aggregator_file_as_shipped_and_uncommented_is_the_default() {
    let shipped = Config::parse(AGGREGATOR_TOML, "aggregator.toml").expect("shipped file parses");
    assert_eq!(shipped, Config::default());
    let all = uncommented(AGGREGATOR_TOML);
    assert_ne!(all, AGGREGATOR_TOML, "the file has commented defaults");
    let uncommented =
        Config::parse(&all, "aggregator.toml (uncommented)").expect("uncommented file parses");
    assert_eq!(uncommented, Config::default());
}

#[test]
fn the_aggregator_file_mentions_every_setting() {
    let value = serde_json::to_value(Config::default()).expect("serializes");
    assert_documented(AGGREGATOR_TOML, &value, "", "aggregator.toml");
}

#[test]
fn uncommenting_keeps_examples_and_prose_commented() {
    let text = "# prose\n#key = 1\n#[table]\n#   example = 2\n# Key = 3\n";
    assert_eq!(
        uncommented(text),
        "# prose\nkey = 1\n[table]\n#   example = 2\n# Key = 3\n"
    );
}
