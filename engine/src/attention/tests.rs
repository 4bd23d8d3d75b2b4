use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{DType, Device, Tensor};

use super::*;
use crate::act_quant::testing::{bits_differ, values, xorshift_data};
use crate::kv_cache::quantize_row;

/// (kv heads, query heads per kv head, head width, cached positions, new rows):
/// SmolLM2's and Qwen2.5's shapes, decode steps and prompts, on and off a cached prefix,
/// key counts off the multiple of 8, one query head per K/V head, and a head width off
/// the vector width (the scalar code).
const SHAPES: [(usize, usize, usize, usize, usize); 8] = [
    (3, 3, 64, 0, 40),
    (3, 3, 64, 85, 1),
    (3, 3, 64, 130, 23),
    (2, 7, 128, 5, 19),
    (2, 7, 128, 600, 1),
    (1, 1, 64, 0, 9),
    (4, 2, 32, 70, 3),
    (2, 2, 12, 7, 6),
];

/// The shapes a cache of `dtype` holds (Q8_0: heads of whole blocks).
fn shapes(dtype: KvDtype) -> impl Iterator<Item = (usize, (usize, usize, usize, usize, usize))> {
    SHAPES
        .into_iter()
        .enumerate()
        .filter(move |(_, s)| dtype.holds(s.2))
}

/// Query, keys and values for a shape, the keys and values as narrowed views of cache
/// storage of `dtype` with room past them, as the model views its cache.
fn inputs(
    i: usize,
    (kv, group, hd, len, t): (usize, usize, usize, usize, usize),
    dtype: KvDtype,
) -> [Tensor; 3] {
    let dev = Device::Cpu;
    let cap = len + 37;
    let seed = i as u64 * 3;
    let data = |n, s| xorshift_data(n, s, 4.0);
    let cache = |s| {
        let values = data(kv * cap * hd, s);
        let t = match dtype {
            KvDtype::F16 => Tensor::from_vec(values, (kv, cap, hd), &dev)
                .unwrap()
                .to_dtype(DType::F16),
            KvDtype::Q8_0 => {
                let mut bytes = vec![0u8; values.len() / 32 * 34];
                quantize_row(&values, &mut bytes);
                Tensor::from_vec(bytes, (kv, cap, hd / 32 * 34), &dev)
            }
        };
        t.unwrap().narrow(1, 0, len).unwrap()
    };
    let (k, v) = (cache(seed), cache(seed + 1));
    let q = Tensor::from_vec(
        data(kv * group * t * hd, seed + 2),
        (kv * group, t, hd),
        &dev,
    );
    [q.unwrap(), k, v]
}

/// What a cache view holds, in f32: an f16 cache widened; a Q8_0 cache's blocks as
/// candle's own dequantization reads them.
fn meaning(cache: &Tensor, hd: usize) -> Tensor {
    if cache.dtype() == DType::F16 {
        return cache.to_dtype(DType::F32).unwrap();
    }
    let (kv, len, row) = cache.dims3().unwrap();
    let bytes: Vec<u8> = cache.flatten_all().unwrap().to_vec1().unwrap();
    assert_eq!(row, hd / 32 * 34);
    let storage = QStorage::from_data(bytes.into(), &Device::Cpu, GgmlDType::Q8_0).unwrap();
    let q = QTensor::new(storage, (kv * len, hd)).unwrap();
    q.dequantize(&Device::Cpu)
        .unwrap()
        .reshape((kv, len, hd))
        .unwrap()
}

/// Attention of rows `rows` of `q` over the keys up to the last of them.
fn part(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    pos: usize,
    rows: std::ops::Range<usize>,
    spread: bool,
    (window, softcap): Case,
) -> Vec<f32> {
    let end = pos + rows.end;
    let q = q.narrow(1, rows.start, rows.len()).unwrap();
    let (k, v) = (k.narrow(1, 0, end).unwrap(), v.narrow(1, 0, end).unwrap());
    let scores = Scores {
        scale: 1.0 / (q.dim(2).unwrap() as f64).sqrt(),
        softcap,
        window,
    };
    values(&causal(&q, &k, &v, scores, spread).unwrap())
}

/// A window and a soft cap.
type Case = (Option<usize>, Option<f64>);

/// No window, windows shorter than a block's spread of positions and one past them;
/// soft caps with and without a window.
const WINDOWS: [Case; 6] = [
    (None, None),
    (Some(1), None),
    (Some(5), None),
    (Some(64), None),
    (None, Some(2.0)),
    (Some(5), Some(2.0)),
];

#[test]
fn a_row_gives_the_same_bits_however_the_rows_are_split() {
    for dtype in KvDtype::ALL {
        for window in WINDOWS {
            for (i, shape) in shapes(dtype) {
                split_anywhere(i, shape, window, dtype);
            }
        }
    }
}

/// Shape `i`'s rows attended whole, one by one and in two parts at every row.
fn split_anywhere(
    i: usize,
    (kv, group, hd, pos, t): (usize, usize, usize, usize, usize),
    window: Case,
    dtype: KvDtype,
) {
    let [q, k, v] = inputs(i, (kv, group, hd, pos + t, t), dtype);
    let whole = part(&q, &k, &v, pos, 0..t, false, window);
    let width = kv * group * hd;
    // Each row alone, as a decode step would run it, spread or not.
    for r in 0..t {
        let alone = part(&q, &k, &v, pos, r..r + 1, r % 2 == 0, window);
        let differ = bits_differ(&alone, &whole[r * width..][..width]);
        assert_eq!(
            differ, 0,
            "{dtype:?} shape {i}, window {window:?}, row {r} alone: {differ} values differ"
        );
    }
    // Two parts, split at every row.
    for split in 1..t {
        let mut parts = part(&q, &k, &v, pos, 0..split, false, window);
        parts.extend(part(&q, &k, &v, pos, split..t, true, window));
        let differ = bits_differ(&parts, &whole);
        assert_eq!(
            differ, 0,
            "{dtype:?} shape {i}, window {window:?}, split at {split}: {differ} values differ"
        );
    }
}

#[test]
fn agrees_with_candles_scale_mask_softmax_and_products() {
    for dtype in KvDtype::ALL {
        for window in WINDOWS {
            for (i, shape) in shapes(dtype) {
                agrees_with_candle(i, shape, window, dtype);
            }
        }
    }
}

/// Shape `i` attended by our kernels and by candle's ops ([`generic`], the path off the
/// CPU) over what the cache means (for Q8_0, candle's dequantization of its blocks, and of
/// the query's own Q8_0 blocks), each row of it also alone, as a decode step attends it.
fn agrees_with_candle(
    i: usize,
    (kv, group, hd, pos, t): (usize, usize, usize, usize, usize),
    (window, softcap): Case,
    dtype: KvDtype,
) {
    let [q, k, v] = inputs(i, (kv, group, hd, pos + t, t), dtype);
    let ours = part(&q, &k, &v, pos, 0..t, true, (window, softcap));
    let (k, v) = (meaning(&k, hd), meaning(&v, hd));
    let q = match dtype {
        KvDtype::F16 => q,
        // Over a Q8_0 cache the scores are llama.cpp's: of the query's own Q8_0 blocks.
        KvDtype::Q8_0 => {
            let quantized = QTensor::quantize(&q, GgmlDType::Q8_0).unwrap();
            quantized.dequantize(&Device::Cpu).unwrap()
        }
    };
    let scores = Scores {
        scale: 1.0 / (hd as f64).sqrt(),
        softcap,
        window,
    };
    let mut theirs = values(&generic(&q, &k, &v, scores).unwrap());
    let width = kv * group * hd;
    assert_eq!(theirs.len(), t * width, "shape {i}");
    for r in 0..t {
        let end = pos + r + 1;
        let (k, v) = (k.narrow(1, 0, end).unwrap(), v.narrow(1, 0, end).unwrap());
        let row = generic(&q.narrow(1, r, 1).unwrap(), &k, &v, scores).unwrap();
        theirs.extend(values(&row));
    }
    let ours = [ours.clone(), ours].concat();
    let window = (window, softcap);
    for (j, (&a, &b)) in ours.iter().zip(&theirs).enumerate() {
        assert!(
            (a - b).abs() <= 1e-5,
            "{dtype:?} shape {i}, window {window:?}, value {j}: {a} against {b}"
        );
    }
}

#[test]
fn the_vector_kernels_give_the_scalar_bits() {
    // Up to eight rows against key counts on and off the multiple of 8, rows seeing
    // different numbers of keys (a prompt's rows, which the 512-bit kernel takes four at a
    // time) or the same (a decode step's query heads), head widths of an odd number of
    // vectors.
    for (i, &(rows, hd, len, same)) in [
        (3, 64, 86, false),
        (3, 64, 86, true),
        (8, 64, 203, false),
        (7, 64, 40, true),
        (5, 24, 17, false),
        (1, 128, 9, false),
        (3, 128, 30, true),
        (7, 40, 64, false),
        (3, 48, 35, true),
        (2, 256, 24, true),
        (4, 80, 21, true),
        (6, 128, 77, false),
    ]
    .iter()
    .enumerate()
    {
        for dtype in KvDtype::ALL.into_iter().filter(|d| d.holds(hd)) {
            kernels_agree(i, (rows, hd, len, same), dtype);
        }
    }
}

/// Case `i` of [`the_vector_kernels_give_the_scalar_bits`] over a cache of `dtype`.
fn kernels_agree(i: usize, (rows, hd, len, same): (usize, usize, usize, bool), dtype: KvDtype) {
    let seed = i as u64 * 5;
    let mut q = xorshift_data(rows * hd, seed, 4.0);
    let wide = xorshift_data(len * hd, seed + 1, 4.0);
    let keys: Vec<u8> = match dtype {
        KvDtype::F16 => wide
            .into_iter()
            .flat_map(|x| f16::from_f32(x).to_le_bytes())
            .collect(),
        KvDtype::Q8_0 => {
            let row = dtype.row_bytes(hd);
            let mut bytes = vec![0u8; row * len];
            quantize_row(&wide, &mut bytes);
            // The largest products a kernel sums: a query row of 127s against a key of
            // -128s (which no quantizer writes, but a peer's cache may hold) and of 127s.
            q[..hd].fill(4.0);
            for (key, byte) in bytes.chunks_exact_mut(row).zip([i8::MIN, i8::MAX]) {
                for block in key.chunks_exact_mut(34) {
                    block[2..].fill(byte as u8);
                }
            }
            bytes
        }
    };
    let probs = xorshift_data(rows * len, seed + 2, 1.0);
    let visible: Vec<usize> = (0..rows)
        .map(|r| {
            if same {
                len
            } else {
                len - (r * 3) % len.min(7)
            }
        })
        .collect();
    let run = |kernel| {
        let products = match dtype {
            KvDtype::F16 => products::<format::F16>,
            KvDtype::Q8_0 => products::<format::Q8>,
        };
        products(kernel, &q, &keys, &probs, &visible, hd)
    };
    let scalar = run(Kernel::Scalar);
    let kernels = Kernel::available(hd);
    if kernels.len() == 1 {
        eprintln!("case {i}: only the scalar code runs on this CPU");
    }
    for &kernel in &kernels[1..] {
        let [scores, values] = run(kernel);
        let case = format!("{kernel:?}, {dtype:?}, case {i}");
        assert_eq!(bits_differ(&scores, &scalar[0]), 0, "scores, {case}");
        assert_eq!(bits_differ(&values, &scalar[1]), 0, "values, {case}");
    }
}

/// A block's scores (scaled by 1/8) of `q` against every key, and its weighted values of
/// the same rows (as values), by `kernel`.
fn products<F: Format>(
    kernel: Kernel,
    q: &[f32],
    keys: &[u8],
    probs: &[f32],
    visible: &[usize],
    hd: usize,
) -> [Vec<f32>; 2] {
    let rows = q.len() / hd;
    let len = keys.len() / format::row_bytes::<F>(hd);
    let mut scores = vec![0f32; rows * len];
    let mut work = kernels::Working::default();
    kernels::scores::<F>(kernel, q, keys, len, hd, 0.125, &mut scores, &mut work);
    let mut values = vec![0f32; rows * hd];
    kernels::weighted_values::<F>(kernel, probs, len, visible, keys, hd, &mut values);
    [scores, values]
}

#[test]
fn refuses_more_rows_than_keys() {
    let [q, k, v] = inputs(0, (3, 3, 64, 4, 5), KvDtype::F16);
    let scores = Scores {
        scale: 0.125,
        softcap: None,
        window: None,
    };
    assert!(causal(&q, &k, &v, scores, false).is_err());
}
