use clap::Parser;
use router::Config;

// The router allocates a little for every request and frees it soon after: mimalloc's
// thread-local free lists cost about a tenth of its CPU less than glibc's malloc here
// (bench/README.md, figure 4).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> anyhow::Result<()> {
    runtime::cpu::require_cpu_features();
    let mut cfg = Config::parse();
    let _traces = runtime::init_tracing(&cfg.log, "tandem-router")?;
    let model = runtime::resolve_model(&cfg.model)?;
    cfg.model = model.path;
    cfg.model_name = cfg.model_name.or(model.served_name);
    runtime::io_runtime(cfg.threads.map(usize::from))?.block_on(async move {
        let listeners = router::Listeners {
            api: tokio::net::TcpListener::bind(cfg.listen).await?,
            ops: tokio::net::TcpListener::bind(cfg.metrics_listen).await?,
        };
        router::serve(listeners, cfg, runtime::shutdown_signal()).await?;
        Ok(())
    })
}
