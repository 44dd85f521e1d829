//! The token file: `[[token]]` entries, each a name, a role and the argon2 hash of the
//! token (a PHC string), and the store that verifies tokens against it.
//!
//! Verifying an argon2 hash costs tens of milliseconds on purpose. A token once
//! verified is cached under its SHA-256, so that the next requests cost a hash; the
//! cache is emptied whenever the token file changes, so that a token removed from the
//! file is refused from its next request on. Verifications run off the async threads,
//! two at a time, so that a flood of bad tokens cannot stall the rest of the listener.

use crate::{AuthCounts, Role};
use argon2::password_hash::{PasswordHash, PasswordHasher, PasswordVerifier, SaltString};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tokio::sync::Semaphore;

/// What can be wrong with the token file or a token.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// The file cannot be read.
    #[error("cannot read the token file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The file does not parse, or an entry is unusable.
    #[error("token file {path}: {reason}")]
    Invalid {
        /// The file.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// A token too weak to hash, or hashing failed.
    #[error("{0}")]
    Token(String),
}

/// The token file as written.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenFile {
    #[serde(default)]
    token: Vec<TokenEntry>,
}

/// One `[[token]]` entry.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenEntry {
    name: String,
    role: Role,
    /// The argon2 hash, as a PHC string (`$argon2id$v=19$m=...`).
    hash: String,
}

/// The shortest token `token hash` takes.
pub const MIN_TOKEN_LEN: usize = 16;

/// The entries of a token file's text; `path` names it in errors.
fn parse_tokens(text: &str, path: &Path) -> Result<Vec<TokenEntry>, AuthError> {
    let invalid = |reason: String| AuthError::Invalid {
        path: path.display().to_string(),
        reason,
    };
    let file: TokenFile = toml::from_str(text).map_err(|e| invalid(e.to_string()))?;
    let mut names = std::collections::HashSet::new();
    for entry in &file.token {
        if entry.name.is_empty() || !ballast_shared::wire::is_valid_name(&entry.name) {
            return Err(invalid(format!("{:?} is not a valid name", entry.name)));
        }
        if !names.insert(entry.name.as_str()) {
            return Err(invalid(format!("{:?} has two entries", entry.name)));
        }
        let hash = PasswordHash::new(&entry.hash)
            .map_err(|e| invalid(format!("{}: the hash is not a PHC string: {e}", entry.name)))?;
        if !hash.algorithm.as_str().starts_with("argon2") {
            return Err(invalid(format!(
                "{}: the hash is {}, not argon2 (make one with `ballast-aggregator token hash`)",
                entry.name, hash.algorithm
            )));
        }
    }
    Ok(file.token)
}

/// The names of the entries of a token file's text (`path` names it in errors), for a
/// caller that adds one.
pub fn token_names(text: &str, path: &Path) -> Result<Vec<String>, AuthError> {
    Ok(parse_tokens(text, path)?
        .into_iter()
        .map(|e| e.name)
        .collect())
}

/// A `[[token]]` entry of the token file for `token`, hashed with argon2id and a
/// random salt: what `ballast-aggregator token hash` prints.
pub fn hash_entry(name: &str, role: Role, token: &str) -> Result<String, AuthError> {
    if name.is_empty() || !ballast_shared::wire::is_valid_name(name) {
        return Err(AuthError::Token(format!("{name:?} is not a valid name")));
    }
    if token.chars().count() < MIN_TOKEN_LEN || token.chars().any(|c| !c.is_ascii_graphic()) {
        return Err(AuthError::Token(format!(
            "a token must be at least {MIN_TOKEN_LEN} printable ASCII characters without \
             blanks (e.g. `openssl rand -hex 32`)"
        )));
    }
    let salt: [u8; 16] = rand::random();
    let salt = SaltString::encode_b64(&salt).map_err(|e| AuthError::Token(e.to_string()))?;
    let hash = argon2::Argon2::default()
        .hash_password(token.as_bytes(), &salt)
        .map_err(|e| AuthError::Token(e.to_string()))?;
    Ok(format!(
        "[[token]]\nname = {name:?}\nrole = \"{}\"\nhash = \"{hash}\"\n",
        role.label()
    ))
}

/// The token file's entries in force, and the tokens verified against them.
#[derive(Default)]
struct Tokens {
    entries: Arc<Vec<TokenEntry>>,
    /// SHA-256 of a verified token, to the index of its entry.
    cache: HashMap<[u8; 32], usize>,
    /// Counts changes of `entries`: a verification begun before one is not cached.
    generation: u64,
}

/// The token file, as read last.
pub struct TokenStore {
    path: PathBuf,
    tokens: RwLock<Tokens>,
    /// Verifications running at once.
    verifying: Semaphore,
}

impl std::fmt::Debug for TokenStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenStore")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// How many argon2 verifications run at once.
const VERIFYING_AT_ONCE: usize = 2;

impl TokenStore {
    /// Reads the token file at `path`.
    pub fn load(path: &Path) -> Result<Arc<TokenStore>, AuthError> {
        let text = std::fs::read_to_string(path).map_err(|source| AuthError::Read {
            path: path.display().to_string(),
            source,
        })?;
        let entries = parse_tokens(&text, path)?;
        Ok(Arc::new(TokenStore {
            path: path.to_path_buf(),
            tokens: RwLock::new(Tokens {
                entries: Arc::new(entries),
                ..Tokens::default()
            }),
            verifying: Semaphore::new(VERIFYING_AT_ONCE),
        }))
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Tokens> {
        self.tokens.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Tokens> {
        self.tokens.write().unwrap_or_else(|p| p.into_inner())
    }

    /// How many entries are in force.
    pub fn len(&self) -> usize {
        self.read().entries.len()
    }

    /// Whether no entry is in force.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Puts `entries` in force and forgets every verified token.
    fn replace(&self, entries: Vec<TokenEntry>) {
        let mut tokens = self.write();
        tokens.entries = Arc::new(entries);
        tokens.cache.clear();
        tokens.generation = tokens.generation.wrapping_add(1);
    }

    /// The name and role of the entry `token` matches, if any.
    pub async fn verify(&self, token: &str) -> Option<(String, Role)> {
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        // A file that changes during a verification is verified against once more: its
        // entry may be gone, or new.
        for _ in 0..2 {
            let (entries, generation) = {
                let tokens = self.read();
                if let Some(entry) = tokens
                    .cache
                    .get(&digest)
                    .and_then(|&i| tokens.entries.get(i))
                {
                    return Some((entry.name.clone(), entry.role));
                }
                (tokens.entries.clone(), tokens.generation)
            };
            let permit = self.verifying.acquire().await.ok()?;
            let token = token.to_string();
            let candidates = entries.clone();
            let found = tokio::task::spawn_blocking(move || {
                candidates.iter().position(|e| {
                    PasswordHash::new(&e.hash).is_ok_and(|hash| {
                        argon2::Argon2::default()
                            .verify_password(token.as_bytes(), &hash)
                            .is_ok()
                    })
                })
            })
            .await
            .ok()?;
            drop(permit);
            let mut tokens = self.write();
            if tokens.generation != generation {
                continue;
            }
            let index = found?;
            tokens.cache.insert(digest, index);
            let entry = entries.get(index)?;
            return Some((entry.name.clone(), entry.role));
        }
        None
    }

    /// Takes the file's new contents: parsed, they replace the entries in force; a
    /// file that does not parse leaves them, a file removed leaves none.
    pub(crate) fn take(
        &self,
        contents: &Result<Vec<u8>, std::io::ErrorKind>,
        counts: &dyn AuthCounts,
    ) {
        let result = match contents {
            Ok(bytes) => parse_tokens(&String::from_utf8_lossy(bytes), &self.path),
            Err(std::io::ErrorKind::NotFound) => {
                tracing::warn!(file = %self.path.display(),
                    "the token file is gone: every token is refused until it is back");
                Ok(Vec::new())
            }
            Err(kind) => Err(AuthError::Read {
                path: self.path.display().to_string(),
                source: std::io::Error::from(*kind),
            }),
        };
        match result {
            Ok(entries) => {
                tracing::info!(file = %self.path.display(), tokens = entries.len(),
                    "token file reloaded");
                self.replace(entries);
                counts.tokens_reload("applied");
            }
            Err(e) => {
                tracing::error!(error = %e, "token file refused; the tokens in force stay");
                counts.tokens_reload("invalid");
            }
        }
    }

    /// Watches the file until the task ends, looking every `every`, and takes each
    /// change (see [`TokenStore::take`]).
    pub async fn watch(self: Arc<Self>, every: Duration, counts: Arc<dyn AuthCounts>) {
        let read = || async { tokio::fs::read(&self.path).await.map_err(|e| e.kind()) };
        let mut seen = read().await;
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let now = read().await;
            if now != seen {
                self.take(&now, counts.as_ref());
                seen = now;
            }
        }
    }
}
