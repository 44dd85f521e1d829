//! Headless Chromium, driven over the Chrome DevTools Protocol on a pipe
//! (`--remote-debugging-pipe`: commands on the child's fd 3, answers and events on its
//! fd 4, each a JSON message ended by a NUL byte), so no port and no WebSocket client
//! are needed. One page per browser. Every JavaScript exception, console error and
//! error log entry the page produces is collected for the test to check.
//!
//! Chromium comes from Debian's `chromium` package (`/usr/bin/chromium`); a missing
//! binary fails the test, naming the package.

use serde_json::{json, Value};
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Where Debian's `chromium` package puts the browser.
pub const CHROMIUM: &str = "/usr/bin/chromium";

/// How long one protocol command may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// What the page reported as an error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageError {
    /// `exception`, `console` or the log entry's source (`network`, `security`, …).
    pub kind: String,
    /// The message, with the URL when there is one.
    pub text: String,
}

/// A running headless Chromium with one page. Killed, with every process it started,
/// on drop.
pub struct Browser {
    child: Child,
    commands: File,
    replies: Receiver<Value>,
    errors: Arc<Mutex<Vec<PageError>>>,
    navigations: Arc<Mutex<u64>>,
    session: String,
    next_id: u64,
    // Last, so that the browser is gone before its profile is removed.
    _profile: tempfile::TempDir,
}

/// A pipe with both ends close-on-exec: (read, write).
fn pipe() -> (OwnedFd, OwnedFd) {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: `fds` is a valid array of two descriptors for pipe2 to fill.
    let rc = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) };
    assert_eq!(rc, 0, "pipe2: {}", std::io::Error::last_os_error());
    // SAFETY: pipe2 succeeded, so both descriptors are open and owned by nobody else.
    unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
}

impl Browser {
    /// Starts Chromium headless with a fresh profile and opens a blank page,
    /// `width`×`height` CSS pixels.
    pub fn launch(width: u32, height: u32) -> Browser {
        assert!(
            Path::new(CHROMIUM).is_file(),
            "{CHROMIUM} not found: the dashboard test drives a real browser. Install \
             Debian's `chromium` package (apt-get install chromium; tests/run does)."
        );
        let profile = tempfile::Builder::new()
            .prefix("ballast-chromium-")
            .tempdir()
            .expect("a profile directory");
        let log = File::create(profile.path().join("chromium.log")).expect("a log file");
        let (child_reads, commands) = pipe();
        let (answers, child_writes) = pipe();
        let (to_child, from_child): (RawFd, RawFd) = {
            use std::os::fd::AsRawFd;
            (child_reads.as_raw_fd(), child_writes.as_raw_fd())
        };
        let mut cmd = Command::new(CHROMIUM);
        cmd.args([
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--remote-debugging-pipe",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-extensions",
            "--disable-sync",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-default-apps",
            "--hide-scrollbars",
            "--mute-audio",
            &format!("--window-size={width},{height}"),
            &format!("--user-data-dir={}", profile.path().display()),
            "about:blank",
        ])
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("log"))
        .stderr(log)
        // Its own process group, so that drop kills the renderers too.
        .process_group(0);
        // SAFETY: between fork and exec only async-signal-safe calls (fcntl, dup2,
        // prctl) on descriptors this process owns.
        unsafe {
            cmd.pre_exec(move || {
                // Out of the way of 3 and 4 first, whatever numbers the pipes got.
                let r = libc::fcntl(to_child, libc::F_DUPFD_CLOEXEC, 10);
                let w = libc::fcntl(from_child, libc::F_DUPFD_CLOEXEC, 10);
                if r < 0 || w < 0 || libc::dup2(r, 3) < 0 || libc::dup2(w, 4) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("start {CHROMIUM}: {e}"));
        drop((child_reads, child_writes));

        let (tx, replies) = mpsc::channel();
        let errors = Arc::new(Mutex::new(Vec::new()));
        let navigations = Arc::new(Mutex::new(0u64));
        {
            let errors = errors.clone();
            let navigations = navigations.clone();
            let mut reader = BufReader::new(File::from(answers));
            std::thread::spawn(move || loop {
                let mut buf = Vec::new();
                match reader.read_until(0, &mut buf) {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
                buf.pop();
                let Ok(msg) = serde_json::from_slice::<Value>(&buf) else {
                    continue;
                };
                if msg.get("id").is_some() {
                    let _ = tx.send(msg);
                } else {
                    note_event(&msg, &errors, &navigations);
                }
            });
        }
        let mut browser = Browser {
            child,
            commands: File::from(commands),
            replies,
            errors,
            navigations,
            session: String::new(),
            next_id: 0,
            _profile: profile,
        };
        let target = browser
            .send(None, "Target.createTarget", json!({ "url": "about:blank" }))
            .unwrap_or_else(|e| panic!("open a page: {e}\n{}", browser.log()));
        let attached = browser
            .send(
                None,
                "Target.attachToTarget",
                json!({ "targetId": target["targetId"], "flatten": true }),
            )
            .expect("attach to the page");
        browser.session = attached["sessionId"]
            .as_str()
            .expect("a session id")
            .to_string();
        for domain in ["Page.enable", "Runtime.enable", "Log.enable"] {
            browser.call(domain, json!({})).expect(domain);
        }
        browser
            .call(
                "Emulation.setDeviceMetricsOverride",
                json!({ "width": width, "height": height, "deviceScaleFactor": 1, "mobile": false }),
            )
            .expect("set the viewport");
        browser
    }

    fn send(
        &mut self,
        session: Option<&str>,
        method: &str,
        params: Value,
    ) -> Result<Value, String> {
        self.next_id += 1;
        let id = self.next_id;
        let mut msg = json!({ "id": id, "method": method, "params": params });
        if let Some(s) = session {
            msg["sessionId"] = json!(s);
        }
        let mut bytes = serde_json::to_vec(&msg).map_err(|e| e.to_string())?;
        bytes.push(0);
        self.commands
            .write_all(&bytes)
            .map_err(|e| format!("{method}: write to chromium: {e}"))?;
        let deadline = Instant::now() + CALL_TIMEOUT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.replies.recv_timeout(left) {
                Ok(reply) if reply["id"] == json!(id) => {
                    return match reply.get("error") {
                        Some(e) => Err(format!("{method}: {e}")),
                        None => Ok(reply["result"].clone()),
                    };
                }
                // The late answer to a call that timed out.
                Ok(_) => continue,
                Err(RecvTimeoutError::Timeout) => {
                    return Err(format!("{method}: no answer in {CALL_TIMEOUT:?}"))
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(format!("{method}: chromium exited\n{}", self.log()))
                }
            }
        }
    }

    /// One protocol command on the page; its result.
    pub fn call(&mut self, method: &str, params: Value) -> Result<Value, String> {
        let session = self.session.clone();
        self.send(Some(&session), method, params)
    }

    /// Loads `url` and waits until its document and subresources have loaded.
    pub fn navigate(&mut self, url: &str) {
        let nav = self
            .call("Page.navigate", json!({ "url": url }))
            .unwrap_or_else(|e| panic!("navigate to {url}: {e}"));
        if let Some(e) = nav.get("errorText").and_then(Value::as_str) {
            panic!("navigate to {url}: {e}");
        }
        super::wait::wait_for(
            Duration::from_secs(15),
            &format!("{url} to load"),
            || match self.eval("document.readyState") {
                Ok(Value::String(s)) if s == "complete" => Ok(()),
                other => Err(format!("{other:?}")),
            },
        );
    }

    /// Evaluates `expression` in the page, awaiting it if it is a promise; its value
    /// (JSON), or the exception it threw.
    pub fn eval(&mut self, expression: &str) -> Result<Value, String> {
        let r = self.call(
            "Runtime.evaluate",
            json!({ "expression": expression, "returnByValue": true, "awaitPromise": true }),
        )?;
        if let Some(ex) = r.get("exceptionDetails") {
            return Err(format!(
                "{expression}: {}",
                ex["exception"]["description"]
                    .as_str()
                    .or(ex["text"].as_str())
                    .unwrap_or("an exception")
            ));
        }
        Ok(r["result"]["value"].clone())
    }

    /// Every error the page has reported so far.
    pub fn errors(&self) -> Vec<PageError> {
        self.errors.lock().expect("errors").clone()
    }

    /// Forgets the errors reported so far.
    pub fn clear_errors(&self) {
        self.errors.lock().expect("errors").clear();
    }

    /// How many times the page's main frame has navigated (loads and reloads).
    pub fn navigations(&self) -> u64 {
        *self.navigations.lock().expect("navigations")
    }

    /// A PNG of the whole page at `path`: as wide as the viewport, as tall as the
    /// document's content (beyond the viewport if need be, not padded to it).
    pub fn screenshot(&mut self, path: &Path) {
        let size = self
            .eval(
                "(() => { const r = document.body.getBoundingClientRect(); \
                 return [document.documentElement.clientWidth, Math.ceil(r.bottom + window.scrollY)]; })()",
            )
            .expect("the page's size");
        let (w, h) = (
            size[0].as_f64().unwrap_or(1280.0),
            size[1].as_f64().unwrap_or(900.0),
        );
        let shot = self
            .call(
                "Page.captureScreenshot",
                json!({
                    "format": "png",
                    "captureBeyondViewport": true,
                    "clip": { "x": 0, "y": 0, "width": w, "height": h, "scale": 1 },
                }),
            )
            .expect("a screenshot");
        let png = base64_decode(shot["data"].as_str().expect("screenshot data"));
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).expect("screenshot directory");
        }
        std::fs::write(path, png).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    }

    /// The end of Chromium's own log.
    pub fn log(&self) -> String {
        super::process::tail(&self._profile.path().join("chromium.log"), 30)
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let pid = self.child.id() as libc::pid_t;
        // SAFETY: a signal to the process group this browser leads.
        unsafe {
            libc::kill(-pid, libc::SIGKILL);
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Files an event: errors into `errors`, main-frame navigations into `navigations`.
fn note_event(msg: &Value, errors: &Mutex<Vec<PageError>>, navigations: &Mutex<u64>) {
    let p = &msg["params"];
    let error = match msg["method"].as_str() {
        Some("Runtime.exceptionThrown") => {
            let d = &p["exceptionDetails"];
            Some(PageError {
                kind: "exception".to_string(),
                text: d["exception"]["description"]
                    .as_str()
                    .or(d["text"].as_str())
                    .unwrap_or("an exception")
                    .to_string(),
            })
        }
        Some("Runtime.consoleAPICalled")
            if matches!(p["type"].as_str(), Some("error" | "assert")) =>
        {
            let text = p["args"]
                .as_array()
                .map(|args| {
                    args.iter()
                        .map(|a| {
                            a["value"]
                                .as_str()
                                .map(str::to_string)
                                .or_else(|| a["description"].as_str().map(str::to_string))
                                .unwrap_or_else(|| a["value"].to_string())
                        })
                        .collect::<Vec<_>>()
                        .join(" ")
                })
                .unwrap_or_default();
            Some(PageError {
                kind: "console".to_string(),
                text,
            })
        }
        Some("Log.entryAdded") if p["entry"]["level"] == json!("error") => {
            let e = &p["entry"];
            Some(PageError {
                kind: e["source"].as_str().unwrap_or("log").to_string(),
                text: format!(
                    "{} {}",
                    e["text"].as_str().unwrap_or_default(),
                    e["url"].as_str().unwrap_or_default()
                ),
            })
        }
        Some("Page.frameNavigated") => {
            if p["frame"].get("parentId").is_none() {
                *navigations.lock().expect("navigations") += 1;
            }
            None
        }
        _ => None,
    };
    if let Some(e) = error {
        errors.lock().expect("errors").push(e);
    }
}

/// Standard base64 with padding, as the protocol sends binary data.
fn base64_decode(text: &str) -> Vec<u8> {
    let value = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => u32::from(c - b'A'),
            b'a'..=b'z' => u32::from(c - b'a') + 26,
            b'0'..=b'9' => u32::from(c - b'0') + 52,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("not base64: {:?}", char::from(c)),
        }
    };
    let bytes: Vec<u8> = text.bytes().filter(|&c| c != b'=').collect();
    let mut out = Vec::with_capacity(bytes.len() * 3 / 4);
    for chunk in bytes.chunks(4) {
        let mut n = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            n |= value(c) << (18 - 6 * i);
        }
        let full = n.to_be_bytes();
        out.extend_from_slice(&full[1..chunk.len()]);
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn base64_decodes_every_padding() {
        assert_eq!(super::base64_decode("TWFu"), b"Man");
        assert_eq!(super::base64_decode("TWE="), b"Ma");
        assert_eq!(super::base64_decode("TQ=="), b"M");
        assert_eq!(super::base64_decode(""), b"");
    }
}
