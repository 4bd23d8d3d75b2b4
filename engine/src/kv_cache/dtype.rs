//! The element types a cache's K and V are stored in, and what they take.

use candle_core::{DType, Device};
use half::f16;

use crate::error::{EngineError, Result};

/// The element type of a cache's K and V, in memory and on the wire, where it travels by
/// [`KvDtype::name`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KvDtype {
    /// IEEE half precision, as llama.cpp's caches are by default.
    #[default]
    F16,
    /// GGML's Q8_0 blocks along each head's row: for every 32 values an f16 scale `d`,
    /// then 32 signed bytes `q`, the values being `d * q` (llama.cpp's `-ctk q8_0 -ctv
    /// q8_0`). 34 bytes for 32 values, 53% of f16's, for every decode step to read. Heads
    /// must be a whole number of blocks.
    Q8_0,
}

/// A name that is no [`KvDtype`]'s: on the wire, or on a command line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("KV dtype {0:?} is not one an engine stores (f16, q8_0)")]
pub struct UnknownKvDtype(pub String);

impl std::str::FromStr for KvDtype {
    type Err = UnknownKvDtype;

    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        Self::from_name(s).ok_or_else(|| UnknownKvDtype(s.to_owned()))
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Values in one Q8_0 block of a cache row.
pub const Q8_0_VALUES: usize = 32;
/// Bytes of one Q8_0 block: its f16 scale, then a signed byte a value.
pub const Q8_0_BYTES: usize = 2 + Q8_0_VALUES;

impl KvDtype {
    /// Its name on the wire, in worker registrations and on the command line.
    pub const fn name(self) -> &'static str {
        match self {
            Self::F16 => "f16",
            Self::Q8_0 => "q8_0",
        }
    }

    /// Every element type an engine stores, the default first.
    pub const ALL: [Self; 2] = [Self::F16, Self::Q8_0];

    /// The element type a name on the wire stands for; `None` for a name no engine stores.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|d| d.name() == name)
    }

    /// Whether a cache of this type can hold rows of `head_dim` values.
    pub const fn holds(self, head_dim: usize) -> bool {
        match self {
            Self::F16 => true,
            Self::Q8_0 => head_dim.is_multiple_of(Q8_0_VALUES),
        }
    }

    /// Whether caches of this type can hold rows of `head_dim` values on `device`: a Q8_0
    /// cache needs whole blocks, and the CPU, where the only kernels that read it run.
    pub fn check(self, head_dim: usize, device: &Device) -> Result<()> {
        if self.holds(head_dim) && (self == Self::F16 || device.is_cpu()) {
            return Ok(());
        }
        Err(EngineError::KvDtypeUnsupported {
            dtype: self.name(),
            head_dim,
            device: format!("{:?}", device.location()),
        })
    }

    /// Bytes of one head's row of `head_dim` values (a whole number of blocks for Q8_0:
    /// see [`KvDtype::holds`]).
    pub const fn row_bytes(self, head_dim: usize) -> usize {
        match self {
            Self::F16 => F16_BYTES * head_dim,
            Self::Q8_0 => head_dim.div_ceil(Q8_0_VALUES) * Q8_0_BYTES,
        }
    }

    /// [`KvDtype::row_bytes`], `None` where it overflows.
    pub(super) const fn checked_row_bytes(self, head_dim: usize) -> Option<usize> {
        match self {
            Self::F16 => head_dim.checked_mul(F16_BYTES),
            Self::Q8_0 => (head_dim / Q8_0_VALUES).checked_mul(Q8_0_BYTES),
        }
    }

    /// The candle type of the storage: f16 values, or a Q8_0 row's bytes.
    pub(crate) const fn storage(self) -> DType {
        match self {
            Self::F16 => DType::F16,
            Self::Q8_0 => DType::U8,
        }
    }

    /// The element type stored as `dtype`, as [`KvDtype::storage`] maps it.
    pub(crate) fn of_storage(dtype: DType) -> Option<Self> {
        Self::ALL.into_iter().find(|d| d.storage() == dtype)
    }

    /// Storage elements of one head's row of `head_dim` values.
    pub(crate) const fn row_elems(self, head_dim: usize) -> usize {
        match self {
            Self::F16 => head_dim,
            Self::Q8_0 => self.row_bytes(head_dim),
        }
    }

    /// The values in a head's row of `elems` storage elements, as [`KvDtype::row_elems`]
    /// lays them out; `None` where they are not whole Q8_0 blocks.
    pub(crate) const fn head_dim_of(self, elems: usize) -> Option<usize> {
        match self {
            Self::F16 => Some(elems),
            Self::Q8_0 if elems.is_multiple_of(Q8_0_BYTES) => {
                Some(elems / Q8_0_BYTES * Q8_0_VALUES)
            }
            Self::Q8_0 => None,
        }
    }
}

/// The element type an engine's caches hold unless told otherwise.
pub const KV_DTYPE: KvDtype = KvDtype::F16;
/// Bytes of one value of an f16 cache.
pub(crate) const F16_BYTES: usize = std::mem::size_of::<f16>();
