//! `ballast-relay`: flags, logging and messages for people. The work is in the library.

use ballast_relay::cli::Cli;
use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = Cli::parse();
    ballast_shared::config::init_logging(cli.args.common.log_json, "info");
    match ballast_relay::cli::run(&cli.args, "ballast-relay") {
        Ok(code) => code,
        Err(e) => {
            eprintln!("ballast-relay: {}", ballast_shared::error_chain(&e));
            ExitCode::FAILURE
        }
    }
}
