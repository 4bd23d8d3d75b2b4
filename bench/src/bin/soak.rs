//! The endurance run (`bench::soak`): steady mixed load on a cluster of a router, two
//! prefill and two decode nodes, clients leaving mid-stream, one P and one D killed and
//! restarted; prints the checks, writes them as JSON, and exits non-zero when one fails.

use anyhow::Context;
use bench::soak::{run, SoakConfig};
use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cfg = SoakConfig::parse();
    let report = run(&cfg).await?;
    print!("{}", report.summary());
    if let Some(path) = &cfg.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    let failed: Vec<&str> = report
        .checks
        .iter()
        .filter(|c| !c.passed)
        .map(|c| c.name.as_str())
        .collect();
    anyhow::ensure!(failed.is_empty(), "failed checks: {}", failed.join(", "));
    Ok(())
}
