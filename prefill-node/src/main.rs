use clap::Parser;
use prefill_node::Config;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cfg = Config::parse();
    runtime::init_tracing();
    let listener = tokio::net::TcpListener::bind(cfg.listen).await?;
    prefill_node::serve(listener, &cfg, runtime::shutdown_signal()).await?;
    Ok(())
}
