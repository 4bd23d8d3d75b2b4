//! Router overhead against sglang-router and vllm-router (`bench::overhead`): prints a
//! table and writes the measurements as JSON.

use anyhow::Context;
use bench::overhead::{run, OverheadConfig};
use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cfg = OverheadConfig::parse();
    let report = run(&cfg).await?;
    print!("{}", report.table());
    if let Some(path) = &cfg.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
