//! `product-bench`: the quantized products alone, at SmolLM2-135M's shapes, on every core:
//! microseconds and GMAC/s per product for each batch size. A kernel change is measured
//! here first, alternated against the build before it, since a decode step's other work
//! and these machines' noise hide a change of a few percent in `engine-bench`. The
//! weights are made up: the kernels do the same work for any values.

use std::time::Instant;

use clap::Parser;
use engine::q4::Q41Matrix;
use engine::q8::Q80Matrix;
use half::f16;

#[derive(Debug, Parser)]
#[command(about = "Quantized product throughput at SmolLM2's shapes")]
struct Config {
    /// Activation rows per product (the decode batch).
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    rows: Vec<usize>,
    /// Timed runs per product and batch; the fastest counts.
    #[arg(long, default_value_t = 5)]
    runs: usize,
}

/// `x Wᵀ` for `n` rows of `x`.
type Matmul = Box<dyn Fn(&[f32], usize) -> Vec<f32>>;

/// A weight matrix under test: its name, shape and product.
struct Product {
    name: &'static str,
    rows: usize,
    cols: usize,
    matmul: Matmul,
}

/// Deterministic bytes.
fn noise(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s as u8
        })
        .collect()
}

/// GGML blocks of `block` bytes: f16 scales (and Q4_1's minimum) then made-up values.
fn blocks(rows: usize, cols: usize, block: usize, halves: &[f32]) -> Vec<u8> {
    let values = noise(rows * cols / 32 * block, (rows * cols) as u64);
    let mut out = Vec::with_capacity(values.len());
    for chunk in values.chunks_exact(block) {
        for &h in halves {
            out.extend_from_slice(&f16::from_f32(h).to_le_bytes());
        }
        out.extend_from_slice(&chunk[2 * halves.len()..]);
    }
    out
}

fn products() -> anyhow::Result<Vec<Product>> {
    let mut all = Vec::new();
    // A layer's Q4_1 products, as the model stacks them (q, k and v in one; gate and up).
    for (name, rows, cols) in [
        ("q4_1 qkv", 960, 576),
        ("q4_1 o", 576, 576),
        ("q4_1 gate+up", 3072, 576),
        ("q4_1 down", 576, 1536),
    ] {
        let w = Q41Matrix::from_ggml(blocks(rows, cols, 20, &[0.01, -0.05]), rows, cols)?;
        all.push(Product {
            name,
            rows,
            cols,
            matmul: Box::new(move |x, n| w.matmul(x, n)),
        });
    }
    if Q80Matrix::supported() {
        let (rows, cols) = (49152, 576);
        let w = Q80Matrix::from_ggml(&blocks(rows, cols, 34, &[0.01]), rows, cols)?;
        all.push(Product {
            name: "q8_0 head",
            rows,
            cols,
            matmul: Box::new(move |x, n| w.matmul(x, n)),
        });
    }
    Ok(all)
}

fn main() -> anyhow::Result<()> {
    runtime::fit_compute_threads();
    let cfg = Config::parse();
    println!("| product | shape | rows | µs | GMAC/s |");
    println!("| --- | --- | ---: | ---: | ---: |");
    for p in products()? {
        for &n in &cfg.rows {
            let x: Vec<f32> = noise(n * p.cols, 7)
                .into_iter()
                .map(|b| b as f32 / 128.0 - 1.0)
                .collect();
            let macs = (p.rows * p.cols * n) as f64;
            // About 50 ms a run.
            let iters = (5e9 / macs).clamp(3.0, 5000.0) as usize;
            let mut best = f64::MAX;
            for _ in 0..cfg.runs {
                let t = Instant::now();
                for _ in 0..iters {
                    std::hint::black_box((p.matmul)(&x, n));
                }
                best = best.min(t.elapsed().as_secs_f64() / iters as f64);
            }
            println!(
                "| {} | {}x{} | {n} | {:.1} | {:.1} |",
                p.name,
                p.rows,
                p.cols,
                best * 1e6,
                macs / best / 1e9
            );
        }
    }
    Ok(())
}
