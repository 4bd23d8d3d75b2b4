//! `product-bench`: the quantized products alone, at SmolLM2-135M's shapes (and, for the
//! K-quants, whose blocks are 256 wide, a 1.5B Qwen2's), on every core: microseconds and
//! GMAC/s per product for each batch size; the K-quants on our kernels and on candle's,
//! side by side. A kernel change is measured
//! here first, alternated against the build before it, since a decode step's other work
//! and these machines' noise hide a change of a few percent in `engine-bench`. The
//! weights are made up: the kernels do the same work for any values. Each product's runs
//! alternate with runs of the cores' bare ceiling for the widest integer product they
//! have (VNNI's on 512-bit registers where the CPU has it), and its row gives its share of
//! the fastest of those: a noisy neighbour then slows both sides of the ratio alike. The
//! last rows are each ceiling over the whole run.

use std::time::Instant;

use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use clap::Parser;
use engine::dense_matrix::{DenseMatrix, Stored};
use engine::kquant::{KFormat, KMatrix};
use engine::q4::Q41Matrix;
use engine::q8::Q80Matrix;
use engine::weights::Linear;
use half::f16;

#[derive(Debug, Parser)]
#[command(about = "Quantized product throughput at SmolLM2's shapes")]
struct Config {
    /// Activation rows per product (the decode batch).
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    rows: Vec<usize>,
    /// Timed runs per product and batch; the fastest counts.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Only the products whose names contain this.
    #[arg(long)]
    only: Option<String>,
}

/// `x Wᵀ` for `n` rows of `x`.
type Matmul = Box<dyn Fn(&[f32], usize) -> Vec<f32>>;

/// A weight matrix under test: its name, shape and product.
struct Product {
    name: String,
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

/// GGML blocks of `block` bytes for every `per` weights: f16 scales (and a minimum) then
/// made-up values.
fn blocks(rows: usize, cols: usize, per: usize, block: usize, halves: &[f32]) -> Vec<u8> {
    let values = noise(rows * cols / per * block, (rows * cols) as u64);
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
        let w = Q41Matrix::from_ggml(blocks(rows, cols, 32, 20, &[0.01, -0.05]), rows, cols)?;
        all.push(Product {
            name: name.to_string(),
            rows,
            cols,
            matmul: Box::new(move |x, n| w.matmul(x, n)),
        });
    }
    if Q80Matrix::supported() {
        let (rows, cols) = (49152, 576);
        let w = Q80Matrix::from_ggml(&blocks(rows, cols, 32, 34, &[0.01]), rows, cols)?;
        all.push(Product {
            name: "q8_0 head".to_string(),
            rows,
            cols,
            matmul: Box::new(move |x, n| w.matmul(x, n)),
        });
    }
    all.extend(k_products()?);
    all.extend(dense_products()?);
    Ok(all)
}

/// A 1.5B Qwen2's q and down projections as a Hugging Face folder's matrices, in each type
/// the engine can hold one in (`engine::weights::DenseMatrices`), through the engine's own
/// projection: what widening bf16 and f16 matrices to f32 on the CPU buys; and on our
/// kernel, over the matrix's own bytes (`DenseMatrices::InPlace`). The down projection's
/// 8,960-wide rows do not fit a core's L1 at a tile of six activation rows (215 KB).
fn dense_products() -> anyhow::Result<Vec<Product>> {
    let mut all = Vec::new();
    for (name, rows, cols) in [("q", 1536, 1536), ("down", 1536, 8960)] {
        let values: Vec<f32> = noise(rows * cols, 11)
            .into_iter()
            .map(|b| b as f32 / 2048.0 - 0.0625)
            .collect();
        let f32s = Tensor::from_vec(values, (rows, cols), &Device::Cpu)?;
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let linear = Linear::dense(f32s.to_dtype(dtype)?);
            all.push(Product {
                name: format!("dense {name} {dtype:?} (candle)"),
                rows,
                cols,
                matmul: on_tensors(cols, move |x| {
                    linear.forward(x).expect("the engine's product")
                }),
            });
        }
        if DenseMatrix::supported() {
            for stored in [Stored::Bf16, Stored::F16, Stored::F32] {
                all.extend(in_place(&format!("dense {name}"), &f32s, stored)?);
            }
        }
    }
    Ok(all)
}

/// `f32s` stored as `stored`, on our kernel: on 256-bit registers where the CPU runs them
/// beside wider ones, and on the widest.
fn in_place(name: &str, f32s: &Tensor, stored: Stored) -> anyhow::Result<Vec<Product>> {
    let (rows, cols) = f32s.dims2()?;
    let tensor = f32s.to_dtype(stored_dtype(stored))?.flatten_all()?;
    let bytes: Vec<u8> = match stored {
        Stored::Bf16 => le_bytes(tensor.to_vec1::<half::bf16>()?, half::bf16::to_le_bytes),
        Stored::F16 => le_bytes(tensor.to_vec1::<f16>()?, f16::to_le_bytes),
        Stored::F32 => le_bytes(tensor.to_vec1::<f32>()?, f32::to_le_bytes),
    };
    let bytes = bytes::Bytes::from(bytes);
    let m = DenseMatrix::new(stored, rows, cols, bytes.clone())?;
    let narrow = DenseMatrix::new(stored, rows, cols, bytes)?;
    let mut all = Vec::new();
    if let Some(narrow) = narrow.on_256_bit_registers() {
        all.push(Product {
            name: format!("{name} {stored:?} (ours, in place, 256-bit)"),
            rows,
            cols,
            matmul: Box::new(move |x, n| narrow.matmul(x, n)),
        });
    }
    all.push(Product {
        name: format!("{name} {stored:?} (ours, in place)"),
        rows,
        cols,
        matmul: Box::new(move |x, n| m.matmul(x, n)),
    });
    Ok(all)
}

/// candle's type for values stored as `stored`.
fn stored_dtype(stored: Stored) -> DType {
    match stored {
        Stored::Bf16 => DType::BF16,
        Stored::F16 => DType::F16,
        Stored::F32 => DType::F32,
    }
}

/// `values` as their little-endian bytes, one after another.
fn le_bytes<T, const N: usize>(values: Vec<T>, bytes: fn(T) -> [u8; N]) -> Vec<u8> {
    values.into_iter().flat_map(bytes).collect()
}

/// A product over `cols`-wide rows computed on candle tensors by `forward`.
fn on_tensors(cols: usize, forward: impl Fn(&Tensor) -> Tensor + 'static) -> Matmul {
    Box::new(move |x, n| {
        let x = Tensor::from_slice(x, (n, cols), &Device::Cpu).expect("activations");
        let y = forward(&x);
        y.flatten_all().and_then(|y| y.to_vec1()).expect("outputs")
    })
}

/// A 1.5B Qwen2 layer's K-quant products, as a Q4_K_M file (or, for Q5_K, a Q5_K_M one)
/// types them, each on our kernel and on candle's.
fn k_products() -> anyhow::Result<Vec<Product>> {
    let mut all = Vec::new();
    for (name, format, dtype, rows, cols) in [
        ("q4_k qkv", KFormat::Q4K, GgmlDType::Q4K, 2048, 1536),
        ("q4_k gate+up", KFormat::Q4K, GgmlDType::Q4K, 17920, 1536),
        ("q5_k gate+up", KFormat::Q5K, GgmlDType::Q5K, 17920, 1536),
        ("q6_k down", KFormat::Q6K, GgmlDType::Q6K, 1536, 8960),
    ] {
        let bytes = k_blocks(dtype, rows, cols);
        let ours = KMatrix::from_ggml(format, &bytes, rows, cols)?;
        let storage = QStorage::from_data(bytes.into(), &Device::Cpu, dtype)?;
        let candle = QMatMul::from_qtensor(QTensor::new(storage, (rows, cols))?)?;
        all.push(Product {
            name: format!("{name} (ours)"),
            rows,
            cols,
            matmul: Box::new(move |x, n| ours.matmul(x, n)),
        });
        all.push(Product {
            name: format!("{name} (candle)"),
            rows,
            cols,
            matmul: on_tensors(cols, move |x| candle.forward(x).expect("candle's product")),
        });
    }
    Ok(all)
}

/// GGML super-blocks of a K-quant `dtype`: made-up values, with small f16 scales where
/// the type keeps them (first for Q4_K and Q5_K, last for Q6_K).
fn k_blocks(dtype: GgmlDType, rows: usize, cols: usize) -> Vec<u8> {
    let size = dtype.type_size();
    let mut bytes = noise(rows * cols / 256 * size, (rows * cols) as u64);
    let halves: &[(usize, f32)] = match dtype {
        GgmlDType::Q6K => &[(208, 0.01)],
        _ => &[(0, 0.01), (2, 0.002)],
    };
    for block in bytes.chunks_exact_mut(size) {
        for &(at, v) in halves {
            block[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
        }
    }
    bytes
}

fn main() -> anyhow::Result<()> {
    // As the nodes and engine-bench do. Without it each product's output came from a fresh
    // mapping, or not, as glibc's moving mmap threshold had it: its pages faulted in on
    // every call, Q4_1's gate and up at 16 rows ran at 180 or 410 GMAC/s from run to run.
    runtime::hold_freed_memory();
    runtime::fit_compute_threads();
    let cfg = Config::parse();
    println!("| product | shape | rows | µs | GMAC/s | of the ceiling beside it |");
    println!("| --- | --- | ---: | ---: | ---: | ---: |");
    let wanted = |p: &Product| {
        cfg.only
            .as_ref()
            .is_none_or(|o| p.name.contains(o.as_str()))
    };
    for p in products()?.into_iter().filter(wanted) {
        for &n in &cfg.rows {
            let x: Vec<f32> = noise(n * p.cols, 7)
                .into_iter()
                .map(|b| b as f32 / 128.0 - 1.0)
                .collect();
            let macs = (p.rows * p.cols * n) as f64;
            // About 50 ms a run.
            let iters = (5e9 / macs).clamp(3.0, 5000.0) as usize;
            let (mut best, mut ceiling) = (f64::MAX, 0f64);
            for _ in 0..cfg.runs {
                let t = Instant::now();
                for _ in 0..iters {
                    std::hint::black_box((p.matmul)(&x, n));
                }
                best = best.min(t.elapsed().as_secs_f64() / iters as f64);
                ceiling = ceiling.max(beside());
            }
            let gmacs = macs / best / 1e9;
            let share = if ceiling > 0.0 {
                format!("{:.0}%", 100.0 * gmacs / ceiling)
            } else {
                "-".into()
            };
            println!(
                "| {} | {}x{} | {n} | {:.1} | {gmacs:.1} | {share} |",
                p.name,
                p.rows,
                p.cols,
                best * 1e6,
            );
        }
    }
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        let threads = runtime::usable_cpus();
        let best = (0..cfg.runs)
            .map(|_| ceiling::gmacs(threads))
            .fold(0f64, f64::max);
        println!("| ceiling: `vpmaddubsw` + `vpaddw` alone | | | | {best:.1} | |");
        // The kernels' VNNI paths sum with `vpdpbusd` where the CPU has it: their ceiling.
        if is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl") {
            let best = (0..cfg.runs)
                .map(|_| ceiling::gmacs_vnni(threads))
                .fold(0f64, f64::max);
            println!("| ceiling: `vpdpbusd` alone | | | | {best:.1} | |");
        }
        if has_512() {
            let best = (0..cfg.runs)
                .map(|_| ceiling::gmacs_512(threads))
                .fold(0f64, f64::max);
            println!("| ceiling: `vpdpbusd` on 512-bit registers | | | | {best:.1} | |");
        }
    }
    Ok(())
}

/// A short run of the widest integer product this CPU has, in GMAC/s; 0 where there is
/// none. Where 512-bit registers run at full width (Zen 5: twice the 256-bit rate), that is
/// the cores' ceiling, though the kernels' VNNI paths use 256-bit registers.
fn beside() -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        let threads = runtime::usable_cpus();
        if has_512() {
            return ceiling::short_512(threads);
        }
        if is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl") {
            return ceiling::short_vnni(threads);
        }
        if is_x86_feature_detected!("avx2") {
            return ceiling::short(threads);
        }
    }
    0.0
}

/// Whether the CPU has `vpdpbusd` on 512-bit registers.
#[cfg(target_arch = "x86_64")]
fn has_512() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vnni")
}

/// The most u8 x i8 multiply-adds these cores do with AVX2's integer product, the one the
/// kernels' AVX2 paths are built on: eight independent sums, each step one `vpmaddubsw` (32
/// products added in pairs) and one `vpaddw`, with no loads, unpacking or scales; and with
/// VNNI's `vpdpbusd` (32 products summed into eight i32 lanes), which their VNNI paths take.
/// A kernel's GMAC/s against its path's says how much room its other instructions leave.
#[cfg(target_arch = "x86_64")]
mod ceiling {
    use std::arch::x86_64::*;
    use std::time::Instant;

    /// Rounds of eight pairs per thread, about 0.2 s here.
    const ROUNDS: usize = 80_000_000;
    /// Rounds of a run beside a product's, about 20 ms.
    const SHORT_ROUNDS: usize = ROUNDS / 10;

    /// GMAC/s over `threads` threads running the `vpmaddubsw` loop at once.
    pub fn gmacs(threads: usize) -> f64 {
        // SAFETY: the caller checked for AVX2.
        on_threads(threads, ROUNDS, |seed| unsafe { run(ROUNDS, seed) })
    }

    /// The same for the `vpdpbusd` loop.
    pub fn gmacs_vnni(threads: usize) -> f64 {
        // SAFETY: the caller checked for AVX-512 VNNI and VL.
        on_threads(threads, ROUNDS, |seed| unsafe { run_vnni(ROUNDS, seed) })
    }

    /// The `vpdpbusd` loop on 512-bit registers, 64 products a step.
    pub fn gmacs_512(threads: usize) -> f64 {
        // SAFETY: the caller checked for AVX-512 F, BW and VNNI.
        2.0 * on_threads(threads, ROUNDS, |seed| unsafe { run_512(ROUNDS, seed) })
    }

    /// [`gmacs_512`] over a tenth of the rounds.
    pub fn short_512(threads: usize) -> f64 {
        // SAFETY: the caller checked for AVX-512 F, BW and VNNI.
        2.0 * on_threads(threads, SHORT_ROUNDS, |seed| unsafe {
            run_512(SHORT_ROUNDS, seed)
        })
    }

    /// [`gmacs`] over a tenth of the rounds.
    pub fn short(threads: usize) -> f64 {
        // SAFETY: the caller checked for AVX2.
        on_threads(threads, SHORT_ROUNDS, |seed| unsafe {
            run(SHORT_ROUNDS, seed)
        })
    }

    /// [`gmacs_vnni`] over a tenth of the rounds.
    pub fn short_vnni(threads: usize) -> f64 {
        // SAFETY: the caller checked for AVX-512 VNNI and VL.
        on_threads(threads, SHORT_ROUNDS, |seed| unsafe {
            run_vnni(SHORT_ROUNDS, seed)
        })
    }

    /// GMAC/s of `threads` threads each running `rounds` of eight 32-product steps at once,
    /// thread `i` held to the `i`th CPU this process may use. Left to the scheduler, two
    /// threads started while the product pool's workers still spun were often put on one
    /// core for the whole of a short run: half the ceiling, every other run.
    fn on_threads(threads: usize, rounds: usize, run: impl Fn(i8) -> i32 + Sync) -> f64 {
        let cpus = usable_cpu_ids();
        let t = Instant::now();
        std::thread::scope(|s| {
            for i in 0..threads {
                let (run, cpu) = (&run, cpus.get(i).copied());
                s.spawn(move || {
                    if let Some(cpu) = cpu {
                        pin_to(cpu);
                    }
                    std::hint::black_box(run(i as i8))
                });
            }
        });
        (threads * rounds * 8 * 32) as f64 / t.elapsed().as_secs_f64() / 1e9
    }

    /// The CPUs in this thread's affinity mask, in order; none where it cannot be read.
    fn usable_cpu_ids() -> Vec<usize> {
        // SAFETY: `set` is a plain bit array that `sched_getaffinity` fills; all zeros is
        // a valid value of it.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        let size = std::mem::size_of::<libc::cpu_set_t>();
        // SAFETY: `set` is `size` writable bytes; pid 0 is the calling thread.
        if unsafe { libc::sched_getaffinity(0, size, &mut set) } != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize)
            // SAFETY: `cpu` is under `CPU_SETSIZE`, within `set`.
            .filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) })
            .collect()
    }

    /// Holds the calling thread to `cpu`; where the kernel refuses, it runs where it may.
    fn pin_to(cpu: usize) {
        // SAFETY: as in `usable_cpu_ids`.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: `cpu` came from `usable_cpu_ids`, under `CPU_SETSIZE`; `set` is
        // `cpu_set_t`'s size, and pid 0 is the calling thread.
        unsafe {
            libc::CPU_SET(cpu, &mut set);
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
        }
    }

    /// # Safety
    /// The CPU has AVX2.
    #[target_feature(enable = "avx2")]
    unsafe fn run(rounds: usize, seed: i8) -> i32 {
        // SAFETY: AVX2, as this function's caller holds.
        let all = unsafe {
            eight_sums(rounds, seed, |sum, a, b| {
                _mm256_add_epi16(sum, _mm256_maddubs_epi16(a, b))
            })
        };
        i32::from(_mm256_extract_epi16::<0>(all) as i16)
    }

    /// # Safety
    /// The CPU has AVX-512 VNNI and VL.
    #[target_feature(enable = "avx2,avx512vnni,avx512vl")]
    unsafe fn run_vnni(rounds: usize, seed: i8) -> i32 {
        // SAFETY: AVX2, which VNNI's caller also holds.
        let all = unsafe { eight_sums(rounds, seed, |sum, a, b| _mm256_dpbusd_epi32(sum, a, b)) };
        _mm256_extract_epi32::<0>(all)
    }

    /// # Safety
    /// The CPU has AVX-512 F, BW and VNNI.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn run_512(rounds: usize, seed: i8) -> i32 {
        let one = _mm512_set1_epi8(1);
        let mut a = _mm512_set1_epi8(seed);
        let b: [__m512i; 8] = std::array::from_fn(|k| _mm512_set1_epi8(k as i8 + 1));
        let mut sums = [_mm512_setzero_si512(); 8];
        for _ in 0..rounds {
            // As in `eight_sums`: an operand the compiler cannot see through.
            a = _mm512_add_epi8(a, one);
            // SAFETY: an empty instruction that only claims to change `a`.
            unsafe {
                std::arch::asm!("/* {0} */", inout(zmm_reg) a, options(pure, nomem, nostack))
            };
            for (sum, &bk) in sums.iter_mut().zip(&b) {
                *sum = _mm512_dpbusd_epi32(*sum, a, bk);
            }
        }
        let all = sums
            .iter()
            .fold(_mm512_setzero_si512(), |x, &y| _mm512_xor_si512(x, y));
        _mm512_reduce_add_epi32(all)
    }

    /// `rounds` of eight independent `sum = step(sum, a, b)` on one operand `a`, the sums
    /// folded into one by xor. Inlined into each caller, so that `step` is compiled with
    /// the caller's target features.
    ///
    /// # Safety
    /// The CPU has AVX2.
    #[inline(always)]
    unsafe fn eight_sums(
        rounds: usize,
        seed: i8,
        step: impl Fn(__m256i, __m256i, __m256i) -> __m256i,
    ) -> __m256i {
        let one = _mm256_set1_epi8(1);
        let mut a = _mm256_set1_epi8(seed);
        let b: [__m256i; 8] = std::array::from_fn(|k| _mm256_set1_epi8(k as i8 + 1));
        let mut sums = [_mm256_setzero_si256(); 8];
        for _ in 0..rounds {
            // A new operand each round, which the compiler cannot see through, so that
            // the products are computed every round rather than hoisted out of the loop.
            a = _mm256_add_epi8(a, one);
            // SAFETY: an empty instruction that only claims to change `a`.
            unsafe {
                std::arch::asm!("/* {0} */", inout(ymm_reg) a, options(pure, nomem, nostack))
            };
            for (sum, &bk) in sums.iter_mut().zip(&b) {
                *sum = step(*sum, a, bk);
            }
        }
        sums.iter()
            .fold(_mm256_setzero_si256(), |x, &y| _mm256_xor_si256(x, y))
    }
}
