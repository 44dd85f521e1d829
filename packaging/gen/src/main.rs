//! `ballast-packaging OUT_DIR`: writes the man pages and shell completions of
//! `ballast-agent`, `ballast-aggregator` and `ballast-relay`, generated from the same clap definitions the
//! binaries parse with, so the packaged documentation cannot drift from the flags.
//!
//! Layout under `OUT_DIR`:
//! - `man/NAME.1` and `man/NAME-SUBCOMMAND.1` (uncompressed; `packaging/build` gzips them);
//! - `completions/bash/NAME`, `completions/zsh/_NAME`, `completions/fish/NAME.fish`.

use anyhow::{Context, Result};
use clap::CommandFactory;
use clap_complete::Shell;
use std::path::{Path, PathBuf};

fn main() -> Result<()> {
    let out = std::env::args_os()
        .nth(1)
        .map(PathBuf::from)
        .context("usage: ballast-packaging OUT_DIR")?;
    for cmd in [
        ballast_agent::cli::Cli::command(),
        ballast_aggregator::cli::Cli::command(),
        ballast_relay::cli::Cli::command(),
    ] {
        write_for(cmd, &out)?;
    }
    Ok(())
}

/// Man pages (one per command and subcommand, as `man git-commit` works) and the three
/// completion scripts for one binary.
fn write_for(cmd: clap::Command, out: &Path) -> Result<()> {
    let name = cmd.get_name().to_string();
    let man = out.join("man");
    std::fs::create_dir_all(&man).with_context(|| format!("creating {}", man.display()))?;
    clap_mangen::generate_to(cmd.clone(), &man)
        .with_context(|| format!("writing man pages of {name} to {}", man.display()))?;
    for shell in [Shell::Bash, Shell::Zsh, Shell::Fish] {
        let dir = out.join("completions").join(shell.to_string());
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let mut cmd = cmd.clone();
        clap_complete::generate_to(shell, &mut cmd, &name, &dir)
            .with_context(|| format!("writing {shell} completion of {name}"))?;
    }
    Ok(())
}
