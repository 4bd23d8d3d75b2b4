//! The K-quant types as GGML stores them, one row's super-block decoded, and the layout
//! our kernels keep them in: eight rows' super-blocks interleaved into one group block.
//!
//! A group block holds, for super-block `b` of eight rows, a header, then each chunk of 32
//! weights, so that a kernel reads it front to back (with the header after the chunks and
//! the planes apart, Q6_K streamed from memory at 13 GB/s where Q4_K took 30):
//! - the header: the sub-blocks' scales in pairs (for pair `p`, 16 bytes, row `r`'s at `2r`
//!   for sub-block `2p` and `2r + 1` for `2p + 1`, signed bytes), Q4_K's and Q5_K's minimums
//!   likewise, each row's `d`, then (Q4_K, Q5_K) each row's `dmin`, f16;
//! - each chunk's low four bits: four runs of 32 bytes, run `k` holding bytes `4k .. 4k + 4`
//!   of each row's 16 in row order, byte `i` of a row's 16 being weight `i` (low nibble) and
//!   weight `i + 16` (high nibble), as in Q4_1. So the low nibbles of run `k` are weights
//!   `4k .. 4k + 4` of every row, four to a 32-bit lane, and the high ones weights
//!   `16 + 4k ..`: eight registers a chunk, `t` for `t < 4` the low nibbles of run `t`, else
//!   the high ones of run `t - 4`;
//! - then, Q5_K: the chunk's fifth bits in 32 bytes, byte `p` holding in bit `t` the bit of
//!   the weight at byte `p` of register `t`; Q6_K: its fifth and sixth bits in 64 bytes,
//!   byte `p` of the first 32 holding those of registers 0-3 in bits `2t, 2t + 1`, of the
//!   second registers 4-7.
//!
//! Q6_K's group block is its eight super-blocks' bytes exactly; Q4_K's and Q5_K's are 32
//! bytes more (the scales unpacked from six bits to eight).

use candle_core::quantized::GgmlDType;
use half::f16;

use crate::split::GROUP;

/// Weights in a super-block.
pub(crate) const QK_K: usize = 256;
/// Weights in a chunk: one register of each of the eight rows per bit plane read.
pub(crate) const CHUNK: usize = 32;
/// Bytes of a chunk's low nibbles.
const NIBBLE_BYTES: usize = GROUP * CHUNK / 2;

/// A K-quant type that our kernels multiply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum KFormat {
    /// 4-bit weights, a 6-bit scale and minimum per 32 (the bulk of a Q4_K_M file).
    Q4K,
    /// 5-bit weights, a 6-bit scale and minimum per 32 (the bulk of a Q5_K_M file).
    Q5K,
    /// 6-bit weights offset by 32, a signed 8-bit scale per 16 (the rest of both).
    Q6K,
}

impl KFormat {
    /// The format of GGML's `dtype`, where it is one of ours.
    pub fn of(dtype: GgmlDType) -> Option<Self> {
        match dtype {
            GgmlDType::Q4K => Some(Self::Q4K),
            GgmlDType::Q5K => Some(Self::Q5K),
            GgmlDType::Q6K => Some(Self::Q6K),
            _ => None,
        }
    }

    /// Bytes of one GGML super-block.
    pub(crate) const fn ggml_bytes(self) -> usize {
        match self {
            Self::Q4K => 144,
            Self::Q5K => 176,
            Self::Q6K => 210,
        }
    }

    /// Bits of each weight above the low four.
    const fn high_bits(self) -> usize {
        match self {
            Self::Q4K => 0,
            Self::Q5K => 1,
            Self::Q6K => 2,
        }
    }

    /// Sub-blocks in a super-block, each with its own scale.
    pub(crate) const fn sub_blocks(self) -> usize {
        match self {
            Self::Q4K | Self::Q5K => 8,
            Self::Q6K => 16,
        }
    }

    /// Whether each sub-block has a minimum (Q6_K instead subtracts 32 from every weight).
    pub(crate) const fn has_mins(self) -> bool {
        !matches!(self, Self::Q6K)
    }

    /// Where a group block's scales start: first, in its header.
    pub(crate) const fn scales_at(self) -> usize {
        0
    }

    /// Where its minimums start (Q4_K, Q5_K).
    pub(crate) const fn mins_at(self) -> usize {
        GROUP * self.sub_blocks()
    }

    /// Where its `d` start.
    pub(crate) const fn d_at(self) -> usize {
        GROUP * self.sub_blocks() * if self.has_mins() { 2 } else { 1 }
    }

    /// Where its `dmin` start (Q4_K, Q5_K).
    pub(crate) const fn dmin_at(self) -> usize {
        self.d_at() + 2 * GROUP
    }

    /// Where chunk `c` starts: its low nibbles, then its high bits.
    pub(crate) const fn chunk_at(self, c: usize) -> usize {
        self.d_at() + 2 * GROUP * if self.has_mins() { 2 } else { 1 } + c * self.chunk_bytes()
    }

    /// Where chunk `c`'s high bits start.
    pub(crate) const fn high_at(self, c: usize) -> usize {
        self.chunk_at(c) + NIBBLE_BYTES
    }

    /// Bytes of one chunk: eight rows' 32 weights.
    const fn chunk_bytes(self) -> usize {
        NIBBLE_BYTES + GROUP * CHUNK * self.high_bits() / 8
    }

    /// Bytes our layout takes for each super-block of a row: an eighth of a group block.
    pub(crate) const fn held_bytes(self) -> usize {
        self.group_bytes() / GROUP
    }

    /// Bytes of one group block.
    pub(crate) const fn group_bytes(self) -> usize {
        self.chunk_at(QK_K / CHUNK)
    }
}

/// One row's super-block: each weight `d * scale * q - dmin * min` of its sub-block (Q4_K,
/// Q5_K; `d * scale` taken first), or `d * scale * (q - 32)` (Q6_K).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct SuperBlock {
    /// Each weight's unsigned value: under 16, 32 or 64.
    pub(crate) q: [u8; QK_K],
    /// Each sub-block's scale (the first eight for Q4_K and Q5_K, each under 64).
    pub(crate) scales: [i8; 16],
    /// Each sub-block's minimum (Q4_K, Q5_K; each under 64).
    pub(crate) mins: [u8; 8],
    pub(crate) d: f16,
    pub(crate) dmin: f16,
}

impl SuperBlock {
    /// GGML's super-block of `format`, decoded as GGML dequantizes it.
    pub(crate) fn from_ggml(format: KFormat, b: &[u8]) -> Self {
        assert_eq!(b.len(), format.ggml_bytes(), "one super-block");
        let half = |at: usize| f16::from_le_bytes([b[at], b[at + 1]]);
        let mut s = Self {
            q: [0; QK_K],
            scales: [0; 16],
            mins: [0; 8],
            d: f16::ZERO,
            dmin: f16::ZERO,
        };
        match format {
            KFormat::Q4K | KFormat::Q5K => {
                (s.d, s.dmin) = (half(0), half(2));
                let packed: &[u8; 12] = b[4..16].try_into().expect("12 bytes of scales");
                for j in 0..8 {
                    let (sc, m) = scale_min(j, packed);
                    (s.scales[j], s.mins[j]) = (sc as i8, m);
                }
                let (qh, qs) = if format == KFormat::Q5K {
                    (Some(&b[16..48]), &b[48..])
                } else {
                    (None, &b[16..])
                };
                for (i, q) in s.q.iter_mut().enumerate() {
                    // Sub-blocks 2c and 2c + 1 are the low and high nibbles of the same 32
                    // bytes; Q5_K's fifth bit of weight `l` of sub-block `j` is bit `j` of
                    // `qh[l]`.
                    let (j, l) = (i / CHUNK, i % CHUNK);
                    let byte = qs[j / 2 * CHUNK + l];
                    let low = if j % 2 == 0 { byte & 0x0F } else { byte >> 4 };
                    let high = qh.map_or(0, |qh| (qh[l] >> j) & 1);
                    *q = low | (high << 4);
                }
            }
            KFormat::Q6K => {
                let (ql, qh) = (&b[..128], &b[128..192]);
                for (sc, &byte) in s.scales.iter_mut().zip(&b[192..208]) {
                    *sc = byte as i8;
                }
                s.d = half(208);
                for (i, q) in s.q.iter_mut().enumerate() {
                    // Each 128 weights take 64 bytes of `ql` and 32 of `qh`; their four
                    // quarters are the low and high nibbles of the two halves of those
                    // 64, with bits 2k, 2k + 1 of the same `qh` byte on top.
                    let (n, quarter, l) = (i / 128, i % 128 / 32, i % 32);
                    let byte = ql[64 * n + 32 * (quarter % 2) + l];
                    let low = if quarter < 2 { byte & 0x0F } else { byte >> 4 };
                    let high = (qh[32 * n + l] >> (2 * quarter)) & 3;
                    *q = low | (high << 4);
                }
            }
        }
        s
    }

    /// Weight `i`'s value, with GGML's operations.
    #[cfg(test)]
    pub(crate) fn weight(&self, format: KFormat, i: usize) -> f32 {
        let d = self.d.to_f32();
        match format {
            KFormat::Q4K | KFormat::Q5K => {
                let j = i / CHUNK;
                let d1 = d * f32::from(self.scales[j]);
                let m1 = self.dmin.to_f32() * f32::from(self.mins[j]);
                d1 * f32::from(self.q[i]) - m1
            }
            KFormat::Q6K => d * f32::from(self.scales[i / 16]) * f32::from(self.q[i] as i8 - 32),
        }
    }

    /// Writes this super-block as row `lane` of a group block of `format`.
    pub(crate) fn put(&self, format: KFormat, block: &mut [u8], lane: usize) {
        for (i, &q) in self.q.iter().enumerate() {
            let at = Place::of(format, i, lane);
            let nibble = &mut block[at.nibble];
            if at.high_nibble {
                *nibble = (*nibble & 0x0F) | ((q & 0x0F) << 4);
            } else {
                *nibble = (*nibble & 0xF0) | (q & 0x0F);
            }
            let (chunk, t, p) = (i / CHUNK, at.register, at.byte);
            match format {
                KFormat::Q4K => {}
                KFormat::Q5K => {
                    block[format.high_at(chunk) + p] |= (q >> 4) << t;
                }
                KFormat::Q6K => {
                    let at = format.high_at(chunk) + t / 4 * 32 + p;
                    block[at] |= (q >> 4) << (2 * (t % 4));
                }
            }
        }
        for (j, &sc) in self.scales[..format.sub_blocks()].iter().enumerate() {
            block[format.scales_at() + pair_byte(j, lane)] = sc as u8;
            if format.has_mins() {
                block[format.mins_at() + pair_byte(j, lane)] = self.mins[j];
            }
        }
        block[format.d_at() + 2 * lane..][..2].copy_from_slice(&self.d.to_le_bytes());
        if format.has_mins() {
            block[format.dmin_at() + 2 * lane..][..2].copy_from_slice(&self.dmin.to_le_bytes());
        }
    }

    /// Row `lane` of a group block of `format`: what [`SuperBlock::put`] wrote there.
    pub(crate) fn get(format: KFormat, block: &[u8], lane: usize) -> Self {
        let half = |at: usize| f16::from_le_bytes([block[at], block[at + 1]]);
        let mut s = Self {
            q: [0; QK_K],
            scales: [0; 16],
            mins: [0; 8],
            d: half(format.d_at() + 2 * lane),
            dmin: if format.has_mins() {
                half(format.dmin_at() + 2 * lane)
            } else {
                f16::ZERO
            },
        };
        for (i, q) in s.q.iter_mut().enumerate() {
            let at = Place::of(format, i, lane);
            let byte = block[at.nibble];
            let low = if at.high_nibble {
                byte >> 4
            } else {
                byte & 0x0F
            };
            let (chunk, t, p) = (i / CHUNK, at.register, at.byte);
            let high = match format {
                KFormat::Q4K => 0,
                KFormat::Q5K => (block[format.high_at(chunk) + p] >> t) & 1,
                KFormat::Q6K => {
                    let at = format.high_at(chunk) + t / 4 * 32 + p;
                    (block[at] >> (2 * (t % 4))) & 3
                }
            };
            *q = low | (high << 4);
        }
        for j in 0..format.sub_blocks() {
            s.scales[j] = block[format.scales_at() + pair_byte(j, lane)] as i8;
            if format.has_mins() {
                s.mins[j] = block[format.mins_at() + pair_byte(j, lane)];
            }
        }
        s
    }
}

/// Where a weight sits in a group block.
struct Place {
    /// The byte of its low four bits.
    nibble: usize,
    high_nibble: bool,
    /// The register of its chunk it is unpacked into (0-7), and its byte there.
    register: usize,
    byte: usize,
}

impl Place {
    /// Weight `i` of row `lane`'s super-block in a group block of `format`.
    fn of(format: KFormat, i: usize, lane: usize) -> Self {
        let (chunk, w) = (i / CHUNK, i % CHUNK);
        let (b, high_nibble) = (w % 16, w >= 16);
        let (run, j) = (b / 4, b % 4);
        let byte = lane * 4 + j;
        Self {
            nibble: format.chunk_at(chunk) + run * 32 + byte,
            high_nibble,
            register: run + if high_nibble { 4 } else { 0 },
            byte,
        }
    }
}

/// The byte of sub-block `j`'s scale (or minimum) for row `lane` among a group block's.
fn pair_byte(j: usize, lane: usize) -> usize {
    j / 2 * 16 + 2 * lane + j % 2
}

/// Sub-block `j`'s 6-bit scale and minimum, as GGML packs them (`get_scale_min_k4`):
/// sub-blocks 0-3 in the low six bits of bytes `j` and `j + 4`; 4-7 in the nibbles of
/// byte `j + 4` with their top two bits in the high bits of bytes `j - 4` and `j`.
fn scale_min(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}
