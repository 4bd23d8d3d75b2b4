//! The K-quant products without vector units: the AVX2 kernels' integers and their float
//! operations in the same order, so the same bits on any CPU.

use super::format::{KFormat, SuperBlock, QK_K};
use super::q8k::Q8KRow;
use crate::split::GROUP;

/// A group of `format` against every activation row, as the AVX2 group kernels emit it.
pub(super) fn group(
    format: KFormat,
    blocks: &[u8],
    q: &[Q8KRow<'_>],
    emit: &mut dyn FnMut(usize, [f32; GROUP]),
) {
    let rows: Vec<[SuperBlock; GROUP]> = blocks
        .chunks_exact(format.group_bytes())
        .map(|blk| std::array::from_fn(|lane| SuperBlock::get(format, blk, lane)))
        .collect();
    for (y, row) in q.iter().enumerate() {
        emit(
            y,
            std::array::from_fn(|lane| {
                rows.iter().enumerate().fold(0f32, |acc, (b, sbs)| {
                    add_super_block(format, &sbs[lane], row, b, acc)
                })
            }),
        );
    }
}

/// `acc` with super-block `b`'s terms for one weight row and one activation row added.
pub(super) fn add_super_block(
    format: KFormat,
    w: &SuperBlock,
    y: &Q8KRow<'_>,
    b: usize,
    acc: f32,
) -> f32 {
    let ys = &y.qs[b * QK_K..(b + 1) * QK_K];
    let width = QK_K / format.sub_blocks();
    let sumi: i32 = (0..format.sub_blocks())
        .map(|j| {
            let span = j * width..(j + 1) * width;
            let dot: i32 = w.q[span.clone()]
                .iter()
                .zip(&ys[span])
                .map(|(&q, &y)| i32::from(q) * i32::from(y))
                .sum();
            i32::from(w.scales[j]) * dot
        })
        .sum();
    let dy = y.d[b];
    let d = w.d.to_f32() * dy;
    if format.has_mins() {
        let sums = &y.sums32[b * 8..(b + 1) * 8];
        let summ: i32 = (0..8)
            .map(|j| i32::from(w.mins[j]) * i32::from(sums[j]))
            .sum();
        let acc = (sumi as f32).mul_add(d, acc);
        (-(summ as f32)).mul_add(w.dmin.to_f32() * dy, acc)
    } else {
        let sums = &y.sums16[b * 16..(b + 1) * 16];
        let offset: i32 = (0..16)
            .map(|j| i32::from(w.scales[j]) * i32::from(sums[j]))
            .sum();
        ((sumi - 32 * offset) as f32).mul_add(d, acc)
    }
}
