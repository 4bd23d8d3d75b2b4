use bytes::Bytes;
use candle_core::{Device, Tensor};

use super::*;
use crate::act_quant::testing::{bits_differ, xorshift_data};

/// The sums' defining order ([`DenseMatrix`]'s module notes), one value at a time.
fn reference(stored: Stored, w: &[u8], x: &[f32]) -> f32 {
    let mut chains = [0f32; LANES];
    for k in 0..x.len().next_multiple_of(LANES) {
        let (wk, xk) = match x.get(k) {
            Some(&xk) => (stored.widen(&w[stored.size() * k..]), xk),
            None => (0.0, 0.0),
        };
        chains[k % LANES] = wk.mul_add(xk, chains[k % LANES]);
    }
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for i in 0..width {
            chains[i] += chains[i + width];
        }
    }
    chains[0]
}

/// Every type a matrix is stored in.
const ALL: [Stored; 3] = [Stored::F16, Stored::Bf16, Stored::F32];

fn encode(stored: Stored, values: &[f32]) -> Vec<u8> {
    let bytes = |v: &f32| match stored {
        Stored::F16 => half::f16::from_f32(*v).to_le_bytes().to_vec(),
        Stored::Bf16 => half::bf16::from_f32(*v).to_le_bytes().to_vec(),
        Stored::F32 => v.to_le_bytes().to_vec(),
    };
    values.iter().flat_map(bytes).collect()
}

/// Weights with the types' edges among random ones: zeros of both signs, subnormals,
/// infinities, the largest finite values.
fn weights(len: usize, seed: u64) -> Vec<f32> {
    let mut w = xorshift_data(len, seed, 4.0);
    let edges = [0.0, -0.0, 6e-8, -1e-40, 65504.0, -3e38, f32::INFINITY];
    for (i, e) in edges.into_iter().enumerate() {
        if let Some(v) = w.get_mut(i * 13 + 5) {
            *v = e;
        }
    }
    w
}

/// Whether a test of the kernel must be skipped, said on stderr: this CPU runs none.
pub(crate) fn skip() -> bool {
    if !DenseMatrix::supported() {
        eprintln!("skipped: this CPU runs no dense matrix kernel");
        return true;
    }
    false
}

/// The matrix on each kernel this CPU runs.
fn on_each_kernel(stored: Stored, rows: usize, cols: usize, bytes: &[u8]) -> Vec<DenseMatrix> {
    let kernels = Kernel::available();
    assert!(
        kernels.len() == 2 || !is_x86_feature_detected!("avx512f"),
        "an AVX-512 CPU runs both kernels"
    );
    kernels
        .into_iter()
        .map(|kernel| DenseMatrix {
            kernel,
            ..DenseMatrix::new(stored, rows, cols, Bytes::from(bytes.to_vec())).unwrap()
        })
        .collect()
}

#[test]
fn every_output_has_the_bits_of_the_defining_order() {
    if skip() {
        return;
    }
    for stored in ALL {
        for (rows, cols) in [
            (8, 16),
            (21, 576),
            (3, 37),
            (17, 5),
            (16, 1),
            (9, 130),
            (41, 70),
            (140, 33),
        ] {
            let w = encode(stored, &weights(rows * cols, (rows * cols) as u64));
            for m in on_each_kernel(stored, rows, cols, &w) {
                for n in [1, 2, 4, 5, 8, 9, 17] {
                    let x = xorshift_data(n * cols, n as u64 + 7, 3.0);
                    let got = m.matmul(&x, n);
                    let want: Vec<f32> = x
                        .chunks_exact(cols)
                        .flat_map(|x| {
                            let rows = w.chunks_exact(stored.size() * cols);
                            rows.map(|w| reference(stored, w, x))
                        })
                        .collect();
                    let differ = bits_differ(&got, &want);
                    let kernel = m.kernel;
                    assert_eq!(
                        differ, 0,
                        "{kernel:?} {stored:?} [{rows}, {cols}] × {n} rows"
                    );
                }
            }
        }
    }
}

#[test]
fn a_row_gives_the_same_bits_alone_as_among_others() {
    if skip() {
        return;
    }
    let (rows, cols) = (19, 200);
    let x = xorshift_data(11 * cols, 5, 2.0);
    for stored in [Stored::Bf16, Stored::F32] {
        let w = encode(stored, &weights(rows * cols, 3));
        for m in on_each_kernel(stored, rows, cols, &w) {
            let all = m.matmul(&x, 11);
            for (y, row) in x.chunks_exact(cols).enumerate() {
                let alone = m.matmul(row, 1);
                let differ = bits_differ(&alone, &all[y * rows..(y + 1) * rows]);
                assert_eq!(differ, 0, "{:?} {stored:?}, row {y}", m.kernel);
            }
        }
    }
}

#[test]
fn the_product_is_the_widened_matrix_s() {
    if skip() {
        return;
    }
    let (rows, cols, n) = (40, 96, 6);
    for stored in ALL {
        let values = xorshift_data(rows * cols, 11, 2.0);
        let bytes = encode(stored, &values);
        let widened: Vec<f32> = bytes
            .chunks_exact(stored.size())
            .map(|b| stored.widen(b))
            .collect();
        let m = DenseMatrix::new(stored, rows, cols, Bytes::from(bytes)).unwrap();
        let x = xorshift_data(n * cols, 12, 2.0);
        let dev = Device::Cpu;
        let wt = Tensor::from_vec(widened, (rows, cols), &dev).unwrap();
        let xt = Tensor::from_vec(x.clone(), (n, cols), &dev).unwrap();
        let want = xt.matmul(&wt.t().unwrap()).unwrap();
        let want: Vec<f32> = want.flatten_all().unwrap().to_vec1().unwrap();
        let got = m.matmul(&x, n);
        for (g, w) in got.iter().zip(&want) {
            assert!(
                (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                "{stored:?}: {g} against {w}"
            );
        }
    }
}

#[test]
fn data_that_is_not_the_matrix_is_refused() {
    if skip() {
        return;
    }
    let bytes = Bytes::from(vec![0u8; 2 * 6 * 8]);
    assert!(DenseMatrix::new(Stored::F16, 6, 8, bytes.clone()).is_ok());
    assert!(DenseMatrix::new(Stored::F32, 6, 4, bytes.clone()).is_ok());
    assert!(DenseMatrix::new(Stored::F32, 6, 8, bytes.clone()).is_err());
    assert!(DenseMatrix::new(Stored::F16, 6, 9, bytes.clone()).is_err());
    assert!(DenseMatrix::new(Stored::F16, 48, 0, bytes.clone()).is_err());
    assert!(DenseMatrix::new(Stored::F16, usize::MAX, 2, bytes).is_err());
}
