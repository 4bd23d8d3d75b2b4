//! Fetches a model named on the Hub into the cache and prints its local path: what a
//! Kubernetes init container runs so that the serving containers find the model offline,
//! on a volume they mount read-only.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

/// Configuration of `tandem-fetch`.
#[derive(Debug, clap::Parser)]
#[command(
    version,
    name = "tandem-fetch",
    about = "Fetch a model named on the Hugging Face Hub into its cache; print its local path",
    after_help = hub::ENV_HELP
)]
struct Config {
    /// The Hub name (`org/name[@rev][:QUANT]`, `hf://` allowed), as the serving binaries
    /// take it; a path that exists here is printed as it is.
    #[arg(long, env = "TANDEM_MODEL")]
    model: PathBuf,
}

fn main() -> ExitCode {
    let cfg = Config::parse();
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    // The log goes to stderr: stdout carries the path alone, for a script to read.
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    match hub::resolve(&cfg.model, &hub::Options::from_env()) {
        Ok(got) => {
            println!("{}", got.path.display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            tracing::error!("{e}");
            ExitCode::FAILURE
        }
    }
}
