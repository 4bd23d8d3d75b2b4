use super::*;
use crate::act_quant::testing::{candle_product, data};
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Tensor};

#[test]
fn within_rounding_of_candle_and_the_same_bits_on_every_path_and_batch() {
    if !Q80Matrix::supported() {
        eprintln!("skipped: this CPU lacks AVX2, FMA or F16C, so the kernel is never used");
        return;
    }
    // 11 blocks a row; five groups of eight rows (where 512-bit registers take two
    // groups at once, two pairs and one alone) and three loose rows.
    let (rows, cols) = (43, 352);
    let nb = cols / QK;
    let w = Tensor::from_vec(data(rows * cols, 1), (rows, cols), &Device::Cpu).unwrap();
    let mut bytes = QTensor::quantize(&w, GgmlDType::Q8_0)
        .unwrap()
        .data()
        .unwrap()
        .to_vec();
    // GGML never writes -128, but a file may hold it: |−128| wraps in candle's sign
    // trick, and the kernel must wrap the same way. Row 0 (grouped) and row 33 (loose).
    for blk in [0, 33 * cols / QK] {
        bytes[blk * Q80_BYTES + 2] = 0x80;
        bytes[blk * Q80_BYTES + 9] = 0x80;
    }
    let ours = Q80Matrix::from_ggml(&bytes, rows, cols).unwrap();
    let q = candle_core::quantized::ggml_file::qtensor_from_ggml(
        GgmlDType::Q8_0,
        &bytes,
        vec![rows, cols],
        &Device::Cpu,
    )
    .unwrap();
    let reference = QMatMul::from_qtensor(q).unwrap();
    // Each weight row alone: a matrix of one row, which takes the loose-row kernel.
    let row_bytes = nb * Q80_BYTES;
    let alone: Vec<Q80Matrix> = bytes
        .chunks_exact(row_bytes)
        .map(|b| Q80Matrix::from_ggml(b, 1, cols).unwrap())
        .collect();
    let mut kernels: Vec<(&str, GroupKernel)> = vec![("AVX2", avx2::dot_group)];
    if crate::act_quant::has_vnni() {
        kernels.push(("VNNI", avx2::dot_group_vnni));
    }
    for n in [1, 2, 3, 4, 5, 8, 16, 17, 33] {
        let x = data(n * cols, 7 + n as u32);
        let want = candle_product(&reference, &x, n, cols);
        let got = ours.matmul(&x, n);
        let q: Vec<Q80Row> = x.chunks_exact(cols).map(Q80Row::quantize).collect();
        let mut differ = 0;
        for (y, (xs, row)) in x.chunks_exact(cols).zip(&q).enumerate() {
            // A row's outputs do not depend on the rows beside it.
            assert_eq!(
                ours.matmul(xs, 1)[..],
                got[y * rows..][..rows],
                "row {y} of {n}"
            );
            for (r, w) in alone.iter().enumerate() {
                let g = got[y * rows + r];
                assert_eq!(w.matmul(xs, 1), [g], "weight row {r} alone");
                // The terms' size: the largest error a few roundings per block make.
                let size: f32 = (0..nb)
                    .map(|b| {
                        let dot: i32 = (0..QK)
                            .map(|j| (w.qs()[b * QK + j] as i32 * row.qs[b * QK + j] as i32).abs())
                            .sum();
                        dot as f32 * (w.d()[b].to_f32() * row.d[b]).abs()
                    })
                    .sum();
                let c = want[y * rows + r];
                assert!(
                    (g - c).abs() <= size * 1e-5,
                    "row {y}, output {r}: {g} against candle's {c}"
                );
                differ += usize::from(g != c);
            }
        }
        assert!(
            differ > 0,
            "no value differs from candle's: is this the new sum?"
        );
        // Every group kernel this CPU runs, not only the one `matmul` picks.
        for (name, kernel) in &kernels {
            for g in 0..rows / GROUP {
                let span = g * nb * GROUP..(g + 1) * nb * GROUP;
                let (d, qs) = (
                    &ours.d()[span.clone()],
                    &ours.qs()[span.start * QK..span.end * QK],
                );
                let mut check = |y: usize, vals: [f32; GROUP]| {
                    assert_eq!(
                        vals[..],
                        got[y * rows + g * GROUP..][..GROUP],
                        "{name}, {n} rows"
                    );
                };
                // SAFETY: `supported` (checked above) and `has_vnni` for VNNI.
                unsafe { kernel(d, qs, &q, &mut check) };
            }
        }
    }
}

/// Every Q5_0 value, converted, is the value candle dequantizes from the file's block.
#[test]
fn q5_0_blocks_become_q8_0_blocks_of_the_same_values() {
    let (rows, cols) = (9, 96);
    let w = Tensor::from_vec(data(rows * cols, 3), (rows, cols), &Device::Cpu).unwrap();
    let q5 = QTensor::quantize(&w, GgmlDType::Q5_0).unwrap();
    let mut bytes = q5.data().unwrap().to_vec();
    // Both extremes of five bits, in each half of a block.
    for (j, nibble) in [(6, 0x0F), (7, 0xF0), (8, 0x00)] {
        bytes[j] = nibble;
    }
    bytes[2..6].copy_from_slice(&[0xFF, 0x00, 0x01, 0x80]);
    let as_q8 = q5_0_as_q8_0(&bytes);
    let load = |dtype, b: &[u8]| {
        candle_core::quantized::ggml_file::qtensor_from_ggml(
            dtype,
            b,
            vec![rows, cols],
            &Device::Cpu,
        )
        .unwrap()
        .dequantize(&Device::Cpu)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
    };
    assert_eq!(load(GgmlDType::Q8_0, &as_q8), load(GgmlDType::Q5_0, &bytes));
}

#[test]
fn refuses_data_of_the_wrong_size() {
    assert!(Q80Matrix::from_ggml(&[0; 33], 1, 32).is_err());
    assert!(Q80Matrix::from_ggml(&[0; 34], 1, 31).is_err());
}

#[test]
fn a_packed_matrix_is_taken_only_for_its_own_bytes_with_its_scales_aligned() {
    let (rows, cols) = (11, 64);
    let w = Tensor::from_vec(data(rows * cols, 9), (rows, cols), &Device::Cpu).unwrap();
    let q = QTensor::quantize(&w, GgmlDType::Q8_0).unwrap();
    let m = Q80Matrix::from_ggml(&q.data().unwrap(), rows, cols).unwrap();
    let x = data(3 * cols, 4);
    let again = Q80Matrix::from_packed(rows, cols, m.data.clone()).unwrap();
    assert_eq!(again.matmul(&x, 3), m.matmul(&x, 3));
    assert!(Q80Matrix::from_packed(rows + 1, cols, m.data.clone()).is_err());
    assert!(Q80Matrix::from_packed(rows, cols - 32, m.data.clone()).is_err());
    assert!(Q80Matrix::from_packed(0, 0, Bytes::new()).is_err());
    // The same bytes one byte into an aligned buffer: scales that cannot be read as
    // f16 in place.
    let len = m.data().len();
    let mut buf = vec![f16::ZERO; len / 2 + 1];
    bytemuck::cast_slice_mut::<f16, u8>(&mut buf)[1..=len].copy_from_slice(m.data());
    let shifted = crate::pack::aligned_bytes(buf).slice(1..=len);
    assert!(Q80Matrix::from_packed(rows, cols, shifted).is_err());
}

/// As Q4_1's: over its blocks, the next pair's scales and values, every line of them and
/// no other.
#[test]
fn the_next_pair_is_asked_for_whole() {
    let (rows, cols) = (5 * GROUP + 3, 352);
    let w = Tensor::from_vec(data(rows * cols, 3), (rows, cols), &Device::Cpu).unwrap();
    let q = QTensor::quantize(&w, GgmlDType::Q8_0).unwrap();
    let m = Q80Matrix::from_ggml(&q.data().unwrap(), rows, cols).unwrap();
    let bytes = |g: usize| -> [&[u8]; 2] {
        let (d, qs) = m.group(g);
        [bytemuck::cast_slice(d), bytemuck::cast_slice(qs)]
    };
    let asked = |g: usize| {
        let next = m.next_pair(g).expect("a next pair");
        crate::ahead::lines_asked(&next, cols / QK)
    };
    let both = [bytes(2), bytes(3)].concat();
    assert_eq!(asked(2), crate::ahead::lines_of(&both));
    assert_eq!(asked(4), crate::ahead::lines_of(&bytes(4)));
    assert!(m.next_pair(5).is_none());
}
