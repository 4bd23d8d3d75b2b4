//! `engine-bench`: prefill and decode throughput of a model next to the memory-bandwidth
//! ceiling measured in the same run. Prints a Markdown table and writes JSON.

use std::path::PathBuf;

use anyhow::Context;
use bench::perf_ctl::PerfControl;
use bench::{memory_read_bandwidth, prefill_tokens_per_s, Decoding};
use clap::Parser;
use serde_json::json;

#[derive(Debug, Parser)]
#[command(about = "Engine throughput against the memory-bandwidth ceiling")]
struct Config {
    /// Model folder or GGUF file.
    #[arg(long)]
    model: PathBuf,
    /// Decode batch sizes to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,32")]
    batches: Vec<usize>,
    /// Prompt length for the prefill measurement.
    #[arg(long, default_value_t = 512)]
    prefill_tokens: usize,
    /// Context each decoding sequence starts with.
    #[arg(long, default_value_t = 128)]
    context: usize,
    /// Decode steps per batch size.
    #[arg(long, default_value_t = 32)]
    steps: usize,
    /// Threads for the bandwidth probe (the engine uses every core).
    #[arg(long, default_value_t = runtime::usable_cpus())]
    threads: usize,
    /// Where to write the JSON results.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Map the K-quant weights from a pack in this folder (written by the first run), as
    /// the nodes' --weights-cache does.
    #[arg(long)]
    weights_cache: Option<PathBuf>,
    /// Where the model computes: `cpu`, or `cuda[:N]` in a build with the `cuda` feature.
    #[arg(long, default_value = "cpu")]
    device: engine::DeviceChoice,
    /// Copy a folder's matrices in f32 at load (bf16 and f16 ones widened), as a CPU without
    /// AVX2, FMA and F16C does, rather than use them where they lie.
    #[arg(long)]
    widen_folder: bool,
    /// What the KV caches hold, `f16` or `q8_0`, as the nodes' --kv-cache-dtype.
    #[arg(long, default_value = "f16")]
    kv_cache_dtype: engine::KvDtype,
    /// perf's command FIFO (`perf record -D -1 --control fifo:CTL,ACK`): sampling is turned
    /// on for the decode steps alone, not the load, the probe or the contexts' prefill.
    #[arg(long, requires = "perf_ack")]
    perf_ctl: Option<PathBuf>,
    /// perf's acknowledgement FIFO, with --perf-ctl.
    #[arg(long, requires = "perf_ctl")]
    perf_ack: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    // As the workers do: without it candle re-reads /proc/cpuinfo for every small matmul
    // (each attention product), which cost about a tenth of a batch-16 step.
    runtime::fit_compute_threads();
    // As the workers do: prompts' activations are blocks of tens of MB, which glibc
    // would map and unmap at every product.
    runtime::hold_freed_memory();
    let cfg = Config::parse();
    let mut perf = match (&cfg.perf_ctl, &cfg.perf_ack) {
        (Some(ctl), Some(ack)) => {
            Some(PerfControl::open(ctl, ack).context("opening perf's control FIFOs")?)
        }
        _ => None,
    };
    let device = cfg.device.open()?;
    let started = std::time::Instant::now();
    let options = engine::LoadOptions {
        pack_dir: cfg.weights_cache.clone(),
        reserve: engine::KvReserve {
            dtype: cfg.kv_cache_dtype,
            ..Default::default()
        },
        matrices: cfg
            .widen_folder
            .then_some(engine::weights::DenseMatrices::F32),
    };
    let loaded = engine::load_reporting(&cfg.model, &device, &options, &mut |_| {})
        .with_context(|| format!("loading {}", cfg.model.display()))?;
    // As the nodes do once their model has loaded.
    runtime::return_freed_memory();
    let load_s = started.elapsed().as_secs_f64();
    let model = loaded.model;
    // Before any step: the weights as loaded, against the bytes on disk; the part of it
    // that is mapped files is shared with every process that maps them.
    let resident = runtime::process::read()?.resident_memory_bytes;
    let split = runtime::process::resident_split()?;
    let file_bytes = model_file_bytes(&cfg.model)?;
    let bandwidth = memory_read_bandwidth(1 << 30, cfg.threads, 5);
    let prefill = prefill_tokens_per_s(&model, cfg.prefill_tokens, 3)?;
    println!("model: {}", cfg.model.display());
    println!(
        "weights read per step: {:.1} MB; measured read bandwidth: {:.2} GB/s ({} threads)",
        model.weight_bytes_per_step() as f64 / 1e6,
        bandwidth / 1e9,
        cfg.threads
    );
    println!(
        "loaded in {load_s:.1} s; resident after load {:.2} GB ({:.2} GB private, {:.2} GB \
         mapped files) for {:.2} GB of files",
        resident as f64 / 1e9,
        split.anon_bytes as f64 / 1e9,
        split.file_bytes as f64 / 1e9,
        file_bytes as f64 / 1e9
    );
    if let Some(pack) = &loaded.pack {
        println!(
            "weight pack {}: {} matrices mapped, {} built",
            pack.path.display(),
            pack.mapped,
            pack.built
        );
    }
    println!(
        "prefill of {} tokens: {prefill:.0} tokens/s",
        cfg.prefill_tokens
    );
    println!();
    println!(
        "| batch | decode tokens/s | ceiling tokens/s | % of ceiling | vs batch 1 | median step tokens/s | vs batch 1 |"
    );
    println!("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    let mut rows = Vec::new();
    let mut base = None;
    for &b in &cfg.batches {
        let decoding = Decoding::prefill(&model, b, cfg.context, cfg.steps)?;
        if let Some(perf) = &mut perf {
            perf.enable()?;
        }
        let r = decoding.steps(cfg.steps)?;
        if let Some(perf) = &mut perf {
            perf.disable()?;
        }
        let ceiling = b as f64 * bandwidth / r.bytes_per_step as f64;
        let (base_tps, base_median) =
            *base.get_or_insert((r.tokens_per_s / b as f64, r.median_tokens_per_s / b as f64));
        println!(
            "| {b} | {:.1} | {:.1} | {:.0}% | {:.1}x | {:.1} | {:.1}x |",
            r.tokens_per_s,
            ceiling,
            100.0 * r.tokens_per_s / ceiling,
            r.tokens_per_s / base_tps,
            r.median_tokens_per_s,
            r.median_tokens_per_s / base_median
        );
        rows.push(
            json!({"batch": b, "tokens_per_s": r.tokens_per_s, "ceiling_tokens_per_s": ceiling,
                   "median_step_tokens_per_s": r.median_tokens_per_s,
                   "bytes_per_step": r.bytes_per_step}),
        );
    }
    if let Some(path) = cfg.json {
        let doc = json!({"model": cfg.model, "bandwidth_bytes_per_s": bandwidth,
                         "prefill_tokens": cfg.prefill_tokens, "prefill_tokens_per_s": prefill,
                         "context": cfg.context, "steps": cfg.steps, "decode": rows,
                         "load_s": load_s, "resident_after_load_bytes": resident,
                         "private_after_load_bytes": split.anon_bytes,
                         "mapped_after_load_bytes": split.file_bytes,
                         "weights_cache": cfg.weights_cache,
                         "file_bytes": file_bytes});
        std::fs::write(&path, serde_json::to_string_pretty(&doc)?)?;
    }
    Ok(())
}

/// The bytes of a GGUF file, or of every file in a model folder.
fn model_file_bytes(path: &std::path::Path) -> anyhow::Result<u64> {
    if !path.is_dir() {
        return Ok(std::fs::metadata(path)?.len());
    }
    let mut total = 0;
    for entry in std::fs::read_dir(path)? {
        total += entry?.metadata()?.len();
    }
    Ok(total)
}
