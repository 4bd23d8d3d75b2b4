use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Tensor};
use half::f16;

use super::*;
use crate::act_quant::testing::{bits_differ, candle_product, data, xorshift_data};

const FORMATS: [(KFormat, GgmlDType); 3] = [
    (KFormat::Q4K, GgmlDType::Q4K),
    (KFormat::Q5K, GgmlDType::Q5K),
    (KFormat::Q6K, GgmlDType::Q6K),
];

/// Rows past whole groups of eight, and two super-blocks a row.
const ROWS: usize = 19;
const COLS: usize = 512;

fn quantized(dtype: GgmlDType, rows: usize, seed: u32) -> QTensor {
    let w = Tensor::from_vec(data(rows * COLS, seed), (rows, COLS), &Device::Cpu).unwrap();
    QTensor::quantize(&w, dtype).unwrap()
}

/// GGML super-blocks of every bit pattern: random bytes, with each `d` and `dmin` a
/// finite f16 of either sign.
fn random_blocks(format: KFormat, rows: usize, seed: u64) -> Vec<u8> {
    let n = rows * COLS / QK_K;
    let mut bytes: Vec<u8> = xorshift_data(n * format.ggml_bytes(), seed, 256.0)
        .into_iter()
        .map(|v| (v + 128.0) as u8)
        .collect();
    let halves: Vec<usize> = match format {
        KFormat::Q4K | KFormat::Q5K => vec![0, 2],
        KFormat::Q6K => vec![208],
    };
    for (i, sb) in bytes.chunks_exact_mut(format.ggml_bytes()).enumerate() {
        for &at in &halves {
            let v = f16::from_f32((i % 7) as f32 * 0.003 - 0.01 + at as f32 * 1e-5);
            sb[at..at + 2].copy_from_slice(&v.to_le_bytes());
        }
    }
    bytes
}

/// GGML super-blocks whose every weight and scale is at its largest (Q6_K's scales at
/// -128 and 127 in turn), where the integer sums are largest.
fn extreme_blocks(format: KFormat, rows: usize) -> Vec<u8> {
    let mut bytes = random_blocks(format, rows, 1);
    for sb in bytes.chunks_exact_mut(format.ggml_bytes()) {
        match format {
            KFormat::Q4K | KFormat::Q5K => sb[4..].fill(0xFF),
            KFormat::Q6K => {
                sb[..192].fill(0xFF);
                for (i, sc) in sb[192..208].iter_mut().enumerate() {
                    *sc = if i % 2 == 0 { 0x80 } else { 0x7F };
                }
            }
        }
    }
    bytes
}

/// The paths this CPU runs.
fn paths() -> Vec<Path> {
    let mut all = vec![Path::Scalar];
    match Path::detect() {
        Path::Scalar => {}
        Path::Avx2 => all.push(Path::Avx2),
        Path::Vnni => all.extend([Path::Avx2, Path::Vnni]),
        Path::Vnni512 => all.extend([Path::Avx2, Path::Vnni, Path::Vnni512]),
    }
    all
}

#[test]
fn holds_exactly_the_weights_ggml_dequantizes() {
    for (format, dtype) in FORMATS {
        let q = quantized(dtype, ROWS, 3);
        let ours = KMatrix::from_ggml(format, &q.data().unwrap(), ROWS, COLS).unwrap();
        let want: Vec<Vec<f32>> = q.dequantize(&Device::Cpu).unwrap().to_vec2().unwrap();
        for (r, want) in want.iter().enumerate() {
            assert_eq!(&ours.dequantized_row(r), want, "{format:?} row {r}");
        }
        // Every bit pattern reads back as candle reads it.
        let bytes = random_blocks(format, ROWS, 9);
        let ours = KMatrix::from_ggml(format, &bytes, ROWS, COLS).unwrap();
        let theirs = candle_core::quantized::ggml_file::qtensor_from_ggml(
            dtype,
            &bytes,
            vec![ROWS, COLS],
            &Device::Cpu,
        )
        .unwrap();
        let want: Vec<Vec<f32>> = theirs.dequantize(&Device::Cpu).unwrap().to_vec2().unwrap();
        for (r, want) in want.iter().enumerate() {
            assert_eq!(bits_differ(&ours.dequantized_row(r), want), 0, "{format:?}");
        }
    }
}

#[test]
fn multiplies_within_rounding_of_candles_product() {
    for (format, dtype) in FORMATS {
        let q = quantized(dtype, ROWS, 5);
        let ours = KMatrix::from_ggml(format, &q.data().unwrap(), ROWS, COLS).unwrap();
        let reference = QMatMul::from_qtensor(q).unwrap();
        for n in [1, 4, 9] {
            let x = data(n * COLS, 11 + n as u32);
            let (got, want) = (ours.matmul(&x, n), candle_product(&reference, &x, n, COLS));
            let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
            let mut differ = 0;
            for (g, w) in got.iter().zip(&want) {
                // The same integers but where candle rounds an activation's half away
                // from zero, summed in another order.
                assert!(
                    (g - w).abs() <= scale * 2e-3,
                    "{format:?}: {g} against candle's {w}"
                );
                differ += usize::from(g != w);
            }
            assert!(differ > 0, "{format:?}: is this candle's sum?");
        }
    }
}

/// Each output is the dequantized weights times the Q8_K activations (each `d * q`) to
/// within the roundings of its floats: the integer sums, scales and minimums are the
/// format's, for weights of every bit pattern.
#[test]
fn multiplies_the_dequantized_weights_by_the_quantized_activations() {
    for (format, _) in FORMATS {
        for bytes in [
            random_blocks(format, ROWS, 29),
            extreme_blocks(format, ROWS),
        ] {
            let ours = KMatrix::from_ggml(format, &bytes, ROWS, COLS).unwrap();
            let n = 5;
            let x = xorshift_data(n * COLS, 31, 6.0);
            let got = ours.matmul(&x, n);
            let q = Q8KRows::quantize(&x, COLS);
            for y in 0..n {
                let row = q.row(y);
                let act = |i: usize| f64::from(row.d[i / QK_K]) * f64::from(row.qs[i]);
                for r in 0..ROWS {
                    let w = ours.dequantized_row(r);
                    let terms = (0..COLS).map(|i| f64::from(w[i]) * act(i));
                    let (want, size) = terms.fold((0f64, 0f64), |(s, a), t| (s + t, a + t.abs()));
                    let g = f64::from(got[y * ROWS + r]);
                    assert!(
                        (g - want).abs() <= size * 1e-5,
                        "{format:?}, row {y}, output {r}: {g} against {want}"
                    );
                }
            }
        }
    }
}

/// Every path, on weights of every bit pattern and on weights at their largest against
/// activations at the edges of Q8_K's range (every value 127, or -127, or ±127), gives
/// the scalar path's bits, whose integers are wide: no sum overflows on the way. A row's
/// outputs do not depend on the rows beside it. Of three groups, 512-bit registers take
/// two together and the third alone; of four, the second pair padded. Of [`UNPACKED_ROWS`],
/// every tile reads super-blocks unpacked before the tiles, in each width of tile.
#[test]
fn every_path_gives_the_same_bits_and_rows_never_depend_on_their_batch() {
    for (format, _) in FORMATS {
        for rows in [ROWS, ROWS + GROUP] {
            for bytes in [
                random_blocks(format, rows, 17),
                extreme_blocks(format, rows),
            ] {
                every_path_agrees(format, &bytes, rows);
            }
        }
    }
}

/// Activation rows enough for the x86 kernels to unpack super-blocks before the tiles.
const UNPACKED_ROWS: usize = 135;
#[cfg(target_arch = "x86_64")]
const _: () = assert!(UNPACKED_ROWS >= x86::UNPACK_FROM_ROWS);

fn every_path_agrees(format: KFormat, bytes: &[u8], rows: usize) {
    let ours = KMatrix::from_ggml(format, bytes, rows, COLS).unwrap();
    for n in [1, 3, 4, 5, 8, 9, 12, 13, 17, UNPACKED_ROWS] {
        let mut x = xorshift_data(n * COLS, n as u64, 10.0);
        for (y, row) in x.chunks_exact_mut(COLS).take(3).enumerate() {
            for v in row {
                *v = match y {
                    0 => 4.0,
                    1 => -4.0,
                    _ => 4f32.copysign(*v),
                };
            }
        }
        let want = ours.matmul_on(Path::Scalar, &x, n);
        for path in paths() {
            let got = ours.matmul_on(path, &x, n);
            assert_eq!(bits_differ(&got, &want), 0, "{format:?} {path:?}, {n} rows");
        }
        for (y, xs) in x.chunks_exact(COLS).enumerate() {
            assert_eq!(
                bits_differ(&ours.matmul(xs, 1), &want[y * rows..][..rows]),
                0,
                "{format:?}: row {y} of {n}"
            );
        }
    }
}

#[test]
fn a_stack_of_types_gives_each_matrix_its_own_outputs() {
    let parts: Vec<(KFormat, usize, Vec<u8>)> = vec![
        (KFormat::Q4K, 16, random_blocks(KFormat::Q4K, 16, 1)),
        (KFormat::Q6K, 11, random_blocks(KFormat::Q6K, 11, 2)),
        (KFormat::Q5K, 8, random_blocks(KFormat::Q5K, 8, 3)),
    ];
    let stack: Vec<KPart<'_>> = parts
        .iter()
        .map(|(format, rows, bytes)| KPart {
            format: *format,
            bytes,
            rows: *rows,
        })
        .collect();
    let joined = KMatrix::stack(&stack, COLS).unwrap();
    let rows: usize = parts.iter().map(|p| p.1).sum();
    let n = 6;
    let x = xorshift_data(n * COLS, 4, 3.0);
    let got = joined.matmul(&x, n);
    let mut col = 0;
    for (format, r, bytes) in &parts {
        let alone = KMatrix::from_ggml(*format, bytes, *r, COLS)
            .unwrap()
            .matmul(&x, n);
        for y in 0..n {
            assert_eq!(
                bits_differ(&got[y * rows + col..][..*r], &alone[y * r..][..*r]),
                0,
                "{format:?}, row {y}"
            );
        }
        col += r;
    }
}

#[test]
fn refuses_data_of_the_wrong_size() {
    for (format, _) in FORMATS {
        let b = format.ggml_bytes();
        assert!(KMatrix::from_ggml(format, &vec![0; b - 1], 1, 256).is_err());
        assert!(KMatrix::from_ggml(format, &vec![0; b], 1, 255).is_err());
        assert!(KMatrix::from_ggml(format, &vec![0; b], 1, 256).is_ok());
        // A tensor no column wide (a hostile file's) is refused, not divided into.
        assert!(KMatrix::from_ggml(format, &[], 1, 0).is_err());
    }
}

#[test]
fn a_group_block_holds_each_rows_super_block_as_decoded() {
    for (format, _) in FORMATS {
        let bytes = random_blocks(format, GROUP, 23);
        let mut block = vec![0u8; format.group_bytes()];
        let row_bytes = COLS / QK_K * format.ggml_bytes();
        let decoded: Vec<SuperBlock> = bytes
            .chunks_exact(row_bytes)
            .map(|row| SuperBlock::from_ggml(format, &row[..format.ggml_bytes()]))
            .collect();
        for (lane, sb) in decoded.iter().enumerate() {
            sb.put(format, &mut block, lane);
        }
        for (lane, sb) in decoded.iter().enumerate() {
            assert_eq!(&SuperBlock::get(format, &block, lane), sb, "{format:?}");
        }
    }
}

/// As Q4_1's: the next pair's group blocks (a padded last group among them), every line of
/// them and no other.
#[cfg(target_arch = "x86_64")]
#[test]
fn the_next_pair_is_asked_for_whole() {
    let bytes = random_blocks(KFormat::Q4K, 5 * GROUP + 3, 5);
    let m = KMatrix::from_ggml(KFormat::Q4K, &bytes, 5 * GROUP + 3, COLS).unwrap();
    let lines = |gs: &[usize]| {
        let runs: Vec<&[u8]> = gs.iter().map(|&g| m.blocks(g)).collect();
        crate::ahead::lines_of(&runs)
    };
    assert_eq!(m.ahead(2).lines(COLS / QK_K), lines(&[2, 3]));
    assert_eq!(m.ahead(5).lines(COLS / QK_K), lines(&[5]));
    assert!(m.ahead(6).lines(COLS / QK_K).is_empty());
}
