use clap::Parser;
use decode_node::Config;

fn main() -> anyhow::Result<()> {
    runtime::cpu::require_cpu_features();
    runtime::hold_freed_memory();
    runtime::fit_compute_threads();
    let mut cfg = Config::parse();
    let _traces = runtime::init_tracing(&cfg.log, "tandem-decode")?;
    cfg.model.path = runtime::resolve_model(&cfg.model.path)?.path;
    tokio::runtime::Runtime::new()?.block_on(run(cfg))
}

async fn run(cfg: Config) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(cfg.listen).await?;
    decode_node::serve(listener, &cfg, runtime::shutdown_signal()).await?;
    Ok(())
}
