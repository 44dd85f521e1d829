//! One service's config file, `<dir>/<service>.toml`, owned by that service's team.
//!
//! ```toml
//! # Overrides of the global [balance] defaults; anything left out keeps the default.
//! [balance]
//! missing_threshold = 0.2
//! pid = { kp = 0.5 }
//! strategies = [
//!   { strategy = "pid", gate = 0.3 },
//!   { strategy = "round_robin", gate = 0.7 },
//! ]
//!
//! # Client zone -> traffic split across destination zones.
//! [locality.zone_2]
//! zone_2 = 50
//! zone_1 = 50
//! ```
//!
//! Overrides merge key by key onto the global defaults, so a team that sets one gain
//! keeps every other global setting, including later changes to them.

use super::locality::{self, LocalitySplit};
use ballast_balance::Params;
use serde::{Deserialize, Serialize};

/// The largest service file read; anything bigger is refused unread, so a stray dump
/// in the directory cannot balloon the aggregator.
pub(crate) const MAX_FILE_BYTES: u64 = 256 * 1024;

/// Why a service file was refused. The message names the file and, where the parser
/// or the check can tell, the line.
#[derive(
    Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize, utoipa::ToSchema,
)]
#[error("{file}: {message}")]
pub struct FileError {
    /// The file's name within the config directory.
    pub file: String,
    /// The line the problem is on, 1-based, when known.
    pub line: Option<usize>,
    /// What is wrong.
    pub message: String,
}

/// A service's config as parsed and validated: the effective parameters and the
/// locality split, with the source text they came from (kept for backups and restore).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServiceConfig {
    /// The parameters in force: the global defaults with the file's overrides.
    pub params: Params,
    /// Client zone → destination zone shares; empty for an even spread.
    pub locality: LocalitySplit,
    /// The file's text.
    pub source: String,
}

/// What the file may hold. `balance` is checked against `Params` twice: once as typed
/// TOML so that unknown keys and wrong types get a line number, and once merged onto
/// the global defaults to get the values.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Typed {
    #[serde(default)]
    #[allow(dead_code)] // only parsed, for its errors' line numbers
    balance: Option<Params>,
    #[serde(default)]
    locality: LocalitySplit,
}

/// Parses and validates one service file against the global `defaults`.
pub fn parse(file: &str, text: &str, defaults: &Params) -> Result<ServiceConfig, FileError> {
    let typed: Typed = toml::from_str(text).map_err(|e| FileError {
        file: file.to_string(),
        line: e.span().map(|s| line_of(text, s.start)),
        message: e.message().trim().to_string(),
    })?;
    let raw: toml::Table = toml::from_str(text).map_err(|e| FileError {
        file: file.to_string(),
        line: e.span().map(|s| line_of(text, s.start)),
        message: e.message().trim().to_string(),
    })?;
    let params = match raw.get("balance") {
        None => defaults.clone(),
        Some(overrides) => merged(defaults, overrides).map_err(|message| FileError {
            file: file.to_string(),
            line: line_of_table(text, "balance"),
            message,
        })?,
    };
    params.validate().map_err(|e| FileError {
        file: file.to_string(),
        line: line_of_key(text, e.field),
        message: format!("balance.{e}"),
    })?;
    locality::validate(&typed.locality).map_err(|e| FileError {
        file: file.to_string(),
        line: line_of_table(text, "locality"),
        message: e.to_string(),
    })?;
    Ok(ServiceConfig {
        params,
        locality: typed.locality,
        source: text.to_string(),
    })
}

/// The defaults with `overrides` laid over them, table by table.
fn merged(defaults: &Params, overrides: &toml::Value) -> Result<Params, String> {
    let mut base = toml::Value::try_from(defaults).map_err(|e| e.to_string())?;
    overlay(&mut base, overrides);
    base.try_into::<Params>().map_err(|e| e.to_string())
}

fn overlay(base: &mut toml::Value, over: &toml::Value) {
    match (base, over) {
        (toml::Value::Table(b), toml::Value::Table(o)) => {
            for (k, v) in o {
                match b.get_mut(k) {
                    Some(existing) => overlay(existing, v),
                    None => {
                        b.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        // Arrays (the strategy list) and scalars replace whole: a team that lists its
        // strategies means exactly that list.
        (b, o) => *b = o.clone(),
    }
}

fn line_of(text: &str, offset: usize) -> usize {
    text.get(..offset)
        .map_or(1, |t| t.matches('\n').count() + 1)
}

/// The line of `[name]` or of a `name.` key, if the file has one.
fn line_of_table(text: &str, name: &str) -> Option<usize> {
    text.lines()
        .position(|l| {
            let l = l.trim_start();
            l.starts_with(&format!("[{name}")) || l.starts_with(&format!("{name}."))
        })
        .map(|i| i + 1)
}

/// The line that sets the last part of a dotted field such as `pid.kp`, if any.
fn line_of_key(text: &str, field: &str) -> Option<usize> {
    let key = field.rsplit('.').next().unwrap_or(field);
    text.lines()
        .position(|l| {
            let l = l.trim_start();
            l.strip_prefix(key)
                .is_some_and(|rest| rest.trim_start().starts_with('='))
                || l.contains(&format!(" {key} ="))
                || l.contains(&format!("{{{key} ="))
        })
        .map(|i| i + 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ballast_balance::{PidGains, Strategy};

    fn defaults() -> Params {
        Params {
            cycle_ms: 2000,
            stale_ms: 6000,
            ..Params::default()
        }
    }

    #[test]
    fn an_empty_file_takes_the_global_defaults() {
        let cfg = parse("svc.toml", "", &defaults()).expect("valid");
        assert_eq!(cfg.params, defaults());
        assert!(cfg.locality.is_empty());
    }

    #[test]
    fn overrides_merge_key_by_key() {
        let text = "[balance]\nmissing_threshold = 0.2\npid = { kp = 0.5 }\n";
        let cfg = parse("svc.toml", text, &defaults()).expect("valid");
        assert_eq!(cfg.params.missing_threshold, 0.2);
        assert_eq!(
            cfg.params.pid,
            PidGains {
                kp: 0.5,
                ..PidGains::default()
            }
        );
        // Untouched: the global value, not the built-in default.
        assert_eq!(cfg.params.cycle_ms, 2000);
        assert_eq!(cfg.source, text);
    }

    #[test]
    fn a_strategy_list_replaces_the_default_list() {
        let text = "[balance]\nstrategies = [{ strategy = \"pid\", gate = 0.3 }, \
                    { strategy = \"round_robin\", gate = 0.7 }]\n";
        let cfg = parse("svc.toml", text, &defaults()).expect("valid");
        let s: Vec<_> = cfg.params.strategies.iter().map(|g| g.strategy).collect();
        assert_eq!(s, [Strategy::Pid, Strategy::RoundRobin]);
    }

    #[test]
    fn errors_name_file_line_and_reason() {
        let err = parse("svc.toml", "[balance]\nkp = 0.5\n", &defaults()).expect_err("unknown");
        assert_eq!((err.file.as_str(), err.line), ("svc.toml", Some(2)));
        assert!(err.message.contains("kp"), "{err}");

        let err = parse(
            "svc.toml",
            "[balance]\n\nmissing_threshold = 1.5\n",
            &defaults(),
        )
        .expect_err("range");
        assert_eq!(err.line, Some(3));
        assert!(err.message.contains("missing_threshold"), "{err}");

        let err = parse("svc.toml", "[balance\n", &defaults()).expect_err("syntax");
        assert_eq!(err.line, Some(1));

        let err = parse("svc.toml", "colour = 1\n", &defaults()).expect_err("unknown table");
        assert!(err.message.contains("colour"), "{err}");

        let err = parse("svc.toml", "\n[locality.z]\na = 0\n", &defaults()).expect_err("zero");
        assert_eq!(err.line, Some(2));

        let err =
            parse("svc.toml", "[balance]\ncycle_ms = \"fast\"\n", &defaults()).expect_err("type");
        assert_eq!(err.line, Some(2));
    }

    #[test]
    fn a_gain_override_out_of_range_points_at_its_line() {
        let err = parse("svc.toml", "[balance.pid]\nkd = 11.0\n", &defaults()).expect_err("kd");
        assert_eq!(err.line, Some(2));
        assert!(err.message.contains("pid.kd"), "{err}");
    }
}
