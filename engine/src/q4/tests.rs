use super::*;
use crate::act_quant::testing::{candle_product, data};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

/// The largest error candle's or our sum can have: a few roundings per block, each
/// relative to the size of the terms so far.
fn rounding_bound(w: WRow<'_>, y: &Q81Row) -> f32 {
    let size: f32 = (0..w.d.len())
        .map(|b| (block_sumi(w, y, b) as f32 * w.d[b] * y.d[b]).abs() + (w.m[b] * y.s[b]).abs())
        .sum();
    size * 1e-5
}

/// Activation rows enough for the 512-bit kernel to unpack a pair's blocks before its tiles.
const UNPACKED_ROWS: usize = 141;
#[cfg(target_arch = "x86_64")]
const _: () = assert!(UNPACKED_ROWS >= avx2::UNPACK_FROM_ROWS);

#[test]
fn within_rounding_of_candle_and_the_same_bits_on_every_path_and_batch() {
    // 11 blocks a row (eight, then three single ones on the plain path); five groups
    // of eight rows (where 512-bit registers take two groups at once, two pairs and one
    // alone) and three loose rows.
    let (rows, cols) = (43, 352);
    let w = Tensor::from_vec(data(rows * cols, 1), (rows, cols), &Device::Cpu).unwrap();
    let q = QTensor::quantize(&w, GgmlDType::Q4_1).unwrap();
    let ours = Q41Matrix::from_ggml(q.data().unwrap().to_vec(), rows, cols).unwrap();
    let reference = candle_core::quantized::QMatMul::from_qtensor(q).unwrap();
    // Each weight row in the plain layout, for the rounding bound.
    let wrows: Vec<OwnedRow> = (0..rows)
        .map(|r| {
            if r < rows / GROUP * GROUP {
                group_row(ours.group(r / GROUP), r % GROUP)
            } else {
                let w = ours.loose_row(r);
                OwnedRow {
                    d: w.d.to_vec(),
                    m: w.m.to_vec(),
                    qs: w.qs.to_vec(),
                }
            }
        })
        .collect();
    let alone = |x: &[f32]| ours.matmul(x, 1);
    // Every mix of tiles of four and single rows; and of eight, four and one on blocks
    // unpacked before the tiles.
    for n in [1, 3, 4, 5, 7, 8, 9, 12, 15, 16, 17, 32, 33, UNPACKED_ROWS] {
        let x = data(n * cols, 7 + n as u32);
        let want = candle_product(&reference, &x, n, cols);
        let got = ours.matmul(&x, n);
        let q = Q81Rows::quantize(&x, cols);
        let q = q.rows();
        let mut differ = 0;
        for (y, row) in q.iter().enumerate() {
            for r in 0..rows {
                let (g, c) = (got[y * rows + r], want[y * rows + r]);
                assert!(
                    (g - c).abs() <= rounding_bound(wrows[r].view(), row),
                    "row {y}, output {r}: {g} against candle's {c}"
                );
                differ += usize::from(g != c);
            }
        }
        assert!(
            differ > 0 || n < 4,
            "no value differs from candle's: is this the new sum?"
        );
        // A row's outputs do not depend on the rows beside it.
        for (y, xs) in x.chunks_exact(cols).enumerate() {
            assert_eq!(alone(xs)[..], got[y * rows..][..rows], "row {y} of {n}");
        }
        // Every group kernel this CPU runs gives the same values: the dispatch above
        // takes only the best one. Likewise the loose rows' AVX2 and scalar paths.
        for (name, kernel) in group_kernels() {
            let mut each = vec![0f32; n * rows];
            for g in 0..(rows / GROUP) {
                kernel(ours.group(g), &q, &mut |y, vals| {
                    each[y * rows + g * GROUP..][..GROUP].copy_from_slice(&vals)
                });
            }
            for r in (rows / GROUP) * GROUP..rows {
                for (y, row) in q.iter().enumerate() {
                    each[y * rows + r] = scalar_dot_one(ours.loose_row(r), row);
                }
            }
            assert_eq!(each, got, "the {name} path agrees, {n} rows");
        }
    }
}

type Emit<'a> = &'a mut dyn FnMut(usize, [f32; GROUP]);
/// A group kernel, by name.
type Kernel = (&'static str, fn(WGroup<'_>, &[Q81Row], Emit<'_>));

/// The group kernels this CPU can run.
fn group_kernels() -> Vec<Kernel> {
    let mut kernels: Vec<Kernel> = vec![("scalar", |w, q, emit| scalar_dot_group(w, q, emit))];
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            // SAFETY: AVX2 and FMA are present, checked just above.
            kernels.push(("AVX2", |w, q, emit| unsafe { avx2::dot_group(w, q, emit) }));
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && has_vnni() {
            // SAFETY: AVX2, FMA and AVX-512 VNNI/VL are present, checked just above.
            kernels.push(("VNNI", |w, q, emit| unsafe {
                avx2::dot_group_vnni(w, q, emit)
            }));
        }
    }
    kernels
}

#[test]
fn refuses_data_of_the_wrong_size() {
    assert!(Q41Matrix::from_ggml(vec![0; 19], 1, 32).is_err());
    assert!(Q41Matrix::from_ggml(vec![0; 20], 1, 31).is_err());
}

#[test]
fn a_packed_matrix_is_taken_only_for_its_own_bytes_with_its_scales_aligned() {
    let (rows, cols) = (11, 64);
    let w = Tensor::from_vec(data(rows * cols, 9), (rows, cols), &Device::Cpu).unwrap();
    let q = QTensor::quantize(&w, GgmlDType::Q4_1).unwrap();
    let m = Q41Matrix::from_ggml(q.data().unwrap().to_vec(), rows, cols).unwrap();
    let x = data(3 * cols, 4);
    let again = Q41Matrix::from_packed(rows, cols, m.data.clone()).unwrap();
    assert_eq!(again.matmul(&x, 3), m.matmul(&x, 3));
    assert!(Q41Matrix::from_packed(rows + 1, cols, m.data.clone()).is_err());
    assert!(Q41Matrix::from_packed(rows, cols - 32, m.data.clone()).is_err());
    assert!(Q41Matrix::from_packed(0, 0, bytes::Bytes::new()).is_err());
    // The same bytes one byte into an aligned buffer: scales that cannot be read as f32
    // in place.
    let len = m.data().len();
    let mut buf = vec![0f32; len / 4 + 1];
    bytemuck::cast_slice_mut::<f32, u8>(&mut buf)[1..=len].copy_from_slice(m.data());
    let shifted = crate::pack::aligned_bytes(buf).slice(1..=len);
    assert!(Q41Matrix::from_packed(rows, cols, shifted).is_err());
}

/// The pair kernel asks for the next pair's bytes while it computes: over its blocks, every
/// line of groups `g` and `g + 1` (scales, minimums, nibbles), those of them the matrix
/// has, and no other.
#[test]
fn the_next_pair_is_asked_for_whole() {
    let (rows, cols) = (5 * GROUP + 3, 352);
    let w = Tensor::from_vec(data(rows * cols, 3), (rows, cols), &Device::Cpu).unwrap();
    let q = QTensor::quantize(&w, GgmlDType::Q4_1).unwrap();
    let m = Q41Matrix::from_ggml(q.data().unwrap().to_vec(), rows, cols).unwrap();
    let bytes = |g: usize| {
        let w = m.group(g);
        [bytemuck::cast_slice(w.d), bytemuck::cast_slice(w.m), w.qs]
    };
    let asked = |g: usize| {
        let next = m.next_pair(g).expect("a next pair");
        crate::ahead::lines_asked(&next, cols / QK)
    };
    let [a, b] = [bytes(2), bytes(3)];
    let both: Vec<&[u8]> = a.into_iter().chain(b).collect();
    assert_eq!(asked(2), crate::ahead::lines_of(&both));
    assert_eq!(asked(4), crate::ahead::lines_of(&bytes(4)));
    assert!(m.next_pair(5).is_none());
}
