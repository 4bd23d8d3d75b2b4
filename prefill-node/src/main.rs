use clap::Parser;
use prefill_node::Config;

fn main() -> anyhow::Result<()> {
    runtime::cpu::require_cpu_features();
    runtime::fit_compute_threads();
    tokio::runtime::Runtime::new()?.block_on(run())
}

async fn run() -> anyhow::Result<()> {
    let mut cfg = Config::parse();
    runtime::init_tracing(&cfg.log);
    cfg.model = runtime::resolve_model(&cfg.model).await?.path;
    let listener = tokio::net::TcpListener::bind(cfg.listen).await?;
    prefill_node::serve(listener, &cfg, runtime::shutdown_signal()).await?;
    Ok(())
}
