//! In-flight requests from nginx's `stub_status` page (`ngx_http_stub_status_module`):
//!
//! ```text
//! Active connections: 3
//! server accepts handled requests
//!  17 17 40
//! Reading: 0 Writing: 2 Waiting: 1
//! ```
//!
//! `Writing` counts the connections whose request nginx has read and not yet answered in
//! full: working on it, waiting for an upstream, or sending the response. The status
//! request itself is one of them, so the count is `Writing - 1`. `Waiting` (idle
//! keep-alive connections) and `Reading` (request headers arriving) are not in flight.

use super::prometheus::{http_get, HttpUrl};
use super::{InflightSource, SampleError};

/// The counts of a `stub_status` page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StubStatus {
    /// `Active connections`.
    pub active: u64,
    /// `Reading`.
    pub reading: u64,
    /// `Writing`, the status request included.
    pub writing: u64,
    /// `Waiting`.
    pub waiting: u64,
}

impl StubStatus {
    /// Parses a page. Every one of the four counts must be there, once.
    pub fn parse(text: &str) -> Result<Self, SampleError> {
        let what = "nginx stub_status page";
        let find = |key: &str| -> Result<u64, SampleError> {
            let mut found = None;
            let mut words = text.split_whitespace();
            while let Some(w) = words.next() {
                if w == key {
                    let v = words
                        .next()
                        .ok_or_else(|| SampleError::parse(what, format!("`{key}` has no value")))?;
                    let v = v.parse::<u64>().map_err(|_| {
                        SampleError::parse(what, format!("`{key}` {v:?} is not a count"))
                    })?;
                    if found.replace(v).is_some() {
                        return Err(SampleError::parse(what, format!("`{key}` twice")));
                    }
                }
            }
            found.ok_or_else(|| {
                SampleError::parse(
                    what,
                    format!("no `{key}`: is the URL nginx's stub_status location?"),
                )
            })
        };
        Ok(StubStatus {
            active: find("connections:")?,
            reading: find("Reading:")?,
            writing: find("Writing:")?,
            waiting: find("Waiting:")?,
        })
    }

    /// Requests in flight: `Writing` less the status request itself. A page with
    /// `Writing: 0` was not served by the nginx it describes (a cache or another
    /// server between): an error, not a zero.
    pub fn inflight(&self) -> Result<u64, SampleError> {
        self.writing.checked_sub(1).ok_or_else(|| {
            SampleError::Negative(format!(
                "nginx stub_status Writing {} does not count the status request itself",
                self.writing
            ))
        })
    }
}

/// The `nginx` preset's source.
#[derive(Debug)]
pub(crate) struct NginxInflight {
    original: String,
    url: HttpUrl,
    last: Option<StubStatus>,
}

impl NginxInflight {
    /// Validates the URL; does not fetch it (the service may start after the agent).
    pub(crate) fn new(url: &str) -> Result<Self, SampleError> {
        Ok(NginxInflight {
            original: url.to_string(),
            url: HttpUrl::parse(url)?,
            last: None,
        })
    }
}

impl InflightSource for NginxInflight {
    fn sample(&mut self) -> Result<u32, SampleError> {
        self.last = None;
        let body = http_get(&self.url, &self.original)?;
        let status = StubStatus::parse(&String::from_utf8_lossy(&body))?;
        let n = status.inflight()?;
        self.last = Some(status);
        Ok(u32::try_from(n).unwrap_or(u32::MAX))
    }

    fn describe(&self) -> String {
        format!("nginx:{} (stub_status Writing - 1)", self.original)
    }

    fn detail(&self) -> Option<String> {
        self.last.map(|s| {
            format!(
                "Writing {} - 1 (this status request) = {}; Reading {}, Waiting {}, active {}",
                s.writing,
                s.writing.saturating_sub(1),
                s.reading,
                s.waiting,
                s.active
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: &str = "Active connections: 7 \nserver accepts handled requests\n 17 17 40 \n\
                        Reading: 0 Writing: 5 Waiting: 2 \n";

    #[test]
    fn writing_less_the_status_request() {
        let s = StubStatus::parse(PAGE).unwrap();
        assert_eq!(
            s,
            StubStatus {
                active: 7,
                reading: 0,
                writing: 5,
                waiting: 2
            }
        );
        assert_eq!(s.inflight().unwrap(), 4);
        let idle = StubStatus::parse(&PAGE.replace("Writing: 5", "Writing: 1")).unwrap();
        assert_eq!(idle.inflight().unwrap(), 0);
    }

    #[test]
    fn other_pages_are_errors() {
        let zero = StubStatus::parse(&PAGE.replace("Writing: 5", "Writing: 0")).unwrap();
        assert!(matches!(zero.inflight(), Err(SampleError::Negative(_))));
        for bad in [
            "",
            "<html>Welcome to nginx!</html>",
            &PAGE.replace("Writing: 5", "Writing: -5"),
            &PAGE.replace("Writing: 5", "Writing:"),
            &PAGE.replace(" Waiting: 2 \n", ""),
            &format!("{PAGE}{PAGE}"),
        ] {
            assert!(StubStatus::parse(bad).is_err(), "{bad:?}");
        }
    }
}
