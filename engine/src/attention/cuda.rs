//! [`step`] on a GPU: our two kernels (`step.cu`, compiled to PTX by the build script for
//! `CUDA_COMPUTE_CAP`'s architecture and loaded by candle's device once). candle's ops
//! would take a dozen launches for each sequence and layer (`generic`), or gather every
//! cache into one padded tensor each layer: a batch of 64 on a 28-layer model made about
//! 20,000 launches a step.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
use candle_core::cuda_backend::cudarc::driver::{
    CudaStream, CudaView, DevicePtr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CpuStorage, CudaStorage, CustomOp3, DType, Layout, Shape, Storage, Tensor};
use half::f16;

use super::splits::key_runs;
use super::Scores;
use crate::error::{EngineError, Result};
use crate::kv_cache::SeqCache;

/// The kernels' PTX, built from `step.cu`.
const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/step.ptx"));
/// The name candle's device keeps the loaded module under.
const MODULE: &str = "tandem_attention_step";
/// `step.cu`'s `WARPS`: the warps of one attention block.
const WARPS: usize = 4;
/// The widest head `step.cu` takes: `MAX_DIMS` dimensions in each of a warp's 32 lanes.
const MAX_HEAD_DIM: usize = 32 * 8;

/// See [`super::step`].
pub(crate) fn step(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    caches: &[&SeqCache],
    layer: usize,
    scores: Scores,
) -> Result<Tensor> {
    let (n, heads, t, head_dim) = q.dims4()?;
    let (kn, kv_heads, kt, khd) = k.dims4()?;
    let fits = t == 1
        && kt == 1
        && kn == n
        && khd == head_dim
        && v.dims() == k.dims()
        && caches.len() == n
        && kv_heads > 0
        && heads.is_multiple_of(kv_heads)
        && head_dim <= MAX_HEAD_DIM;
    if !fits {
        return Err(EngineError::InvalidInput(format!(
            "a GPU decode step of {:?} queries, {:?} keys and {} caches",
            q.dims(),
            k.dims(),
            caches.len()
        )));
    }
    let slots = caches
        .iter()
        .map(|c| CacheSlot::of(c, layer, kv_heads, head_dim))
        .collect::<Result<Vec<_>>>()?;
    let op = Step {
        slots,
        heads,
        kv_heads,
        head_dim,
        scores,
    };
    let out = q
        .contiguous()?
        .apply_op3_no_bwd(&k.contiguous()?, &v.contiguous()?, &op)?;
    Ok(out.reshape((n, heads * head_dim))?)
}

/// One sequence's cache in the layer the step runs: its K and V storage (held, so it
/// outlives the launches) and where the new row goes.
struct CacheSlot {
    k: Tensor,
    v: Tensor,
    /// Elements from one K/V head to the next.
    head_stride: usize,
    /// The new row's position: the positions stored before it.
    pos: usize,
}

impl CacheSlot {
    /// The slot of `cache`'s layer `layer`, checked against what the kernels assume: f16
    /// `(kv_heads, capacity, head_dim)`, contiguous, with room for the new row.
    fn of(cache: &SeqCache, layer: usize, kv_heads: usize, head_dim: usize) -> Result<Self> {
        let l = cache.layer(layer);
        let pos = cache.len();
        let (heads, capacity, hd) = l.k.dims3()?;
        let fits = l.k.dtype() == DType::F16
            && l.v.dtype() == DType::F16
            && l.k.is_contiguous()
            && l.v.is_contiguous()
            && l.v.dims() == l.k.dims()
            && (heads, hd) == (kv_heads, head_dim)
            && pos < capacity;
        if !fits {
            return Err(EngineError::KvCache(format!(
                "layer {layer} of a cache of {pos} positions is not {kv_heads} f16 heads of \
                 {head_dim} with room for one more: {:?}",
                l.k.dims()
            )));
        }
        Ok(Self {
            k: l.k.clone(),
            v: l.v.clone(),
            head_stride: capacity * head_dim,
            pos,
        })
    }
}

/// The step as one candle op over the new rows `q`, `k` and `v`, so candle hands over
/// their device memory and wraps the output.
struct Step {
    slots: Vec<CacheSlot>,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    scores: Scores,
}

impl CustomOp3 for Step {
    fn name(&self) -> &'static str {
        "attention-step"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("the CPU's decode step attends with attention::causal")
    }

    fn cuda_fwd(
        &self,
        qs: &CudaStorage,
        ql: &Layout,
        ks: &CudaStorage,
        kl: &Layout,
        vs: &CudaStorage,
        vl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = qs.device().clone();
        let stream = dev.cuda_stream();
        let (q, k, v) = (rows(qs, ql)?, rows(ks, kl)?, rows(vs, vl)?);
        let n = self.slots.len();
        let mut words = Vec::with_capacity(4 * n);
        for s in &self.slots {
            words.extend([
                address(&s.k, &stream)?,
                address(&s.v, &stream)?,
                s.head_stride as u64,
                s.pos as u64,
            ]);
        }
        let slots = dev.clone_htod(&words)?;
        let (kv_heads, head_dim) = (self.kv_heads as i32, self.head_dim as i32);

        let append = dev.get_or_load_custom_func("kv_append", MODULE, PTX)?;
        let mut args = append.builder();
        args.arg(&k)
            .arg(&v)
            .arg(&slots)
            .arg(&kv_heads)
            .arg(&head_dim);
        let grid = (self.kv_heads as u32, n as u32, 1);
        // SAFETY: the arguments are `kv_append`'s, in its order and types; each slot's K
        // and V hold `kv_heads * head_stride` f16 (checked in `CacheSlot::of`) and its row
        // `pos` is below their capacity, so every write lands inside them. The caches'
        // storage is held by `self` until the launch is queued, and candle frees device
        // memory in the order of its one stream, after the kernels that use it.
        unsafe { args.launch(launch(grid, self.head_dim, 0)) }.w()?;

        let attend = dev.get_or_load_custom_func("step_attention", MODULE, PTX)?;
        let runs = key_runs(n * self.heads, self.longest(), multiprocessors(&stream)?);
        // SAFETY: every element is written by `step_attention` below, or with runs by
        // `merge_splits` after it.
        let out = unsafe { dev.alloc::<f32>(n * self.heads * self.head_dim)? };
        // Each run's values, max and sum (one element where unused, as no launch takes a
        // null pointer).
        let width = if runs > 1 { self.head_dim + 2 } else { 0 };
        // SAFETY: with runs, every element is written by `step_attention` below, before
        // `merge_splits` reads it; without, no kernel touches it.
        let partial = unsafe { dev.alloc::<f32>((n * self.heads * runs * width).max(1))? };
        let heads = self.heads as i32;
        let scale = self.scores.scale as f32;
        let softcap = self.scores.softcap.map_or(0.0, |c| c as f32);
        let window = self
            .scores
            .window
            .map_or(0, |w| w.min(i32::MAX as usize) as i32);
        let splits = runs as i32;
        let mut args = attend.builder();
        args.arg(&q).arg(&slots).arg(&out).arg(&partial);
        args.arg(&heads).arg(&kv_heads).arg(&head_dim);
        args.arg(&scale).arg(&softcap).arg(&window).arg(&splits);
        let grid = (self.heads as u32, n as u32, runs as u32);
        let shared = (WARPS * self.head_dim * std::mem::size_of::<f32>()) as u32;
        // SAFETY: the arguments are `step_attention`'s, in its order and types; it reads
        // each slot's keys `..= pos` (written, the last by `kv_append` just before on the
        // same stream) and writes `out`, `n * heads * head_dim` f32, or with runs
        // `partial`, `n * heads * runs * (head_dim + 2)`, within bounds.
        unsafe { args.launch(launch(grid, 32 * WARPS, shared)) }.w()?;
        if runs > 1 {
            let merge = dev.get_or_load_custom_func("merge_splits", MODULE, PTX)?;
            let mut args = merge.builder();
            args.arg(&partial)
                .arg(&out)
                .arg(&heads)
                .arg(&head_dim)
                .arg(&splits);
            let grid = (self.heads as u32, n as u32, 1);
            // SAFETY: the arguments are `merge_splits`'s, in its order and types; it reads
            // `partial` as written above on the same stream and writes `out`, within
            // bounds.
            unsafe { args.launch(launch(grid, self.head_dim, 0)) }.w()?;
        }
        let shape = Shape::from((n, self.heads, 1, self.head_dim));
        Ok((CudaStorage::wrap_cuda_slice(out, dev), shape))
    }
}

impl Step {
    /// The most keys a sequence of the step attends: its positions, or its window.
    fn longest(&self) -> usize {
        let most = self.slots.iter().map(|s| s.pos + 1).max().unwrap_or(0);
        self.scores.window.map_or(most, |w| most.min(w))
    }
}

/// The multiprocessors of the GPU `stream` runs on.
fn multiprocessors(stream: &CudaStream) -> candle_core::Result<usize> {
    let count = stream
        .context()
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .w()?;
    Ok(count.max(1) as usize)
}

/// A launch of `threads` threads a block (at most 1,024) over `grid`.
fn launch(grid: (u32, u32, u32), threads: usize, shared: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (threads.min(1024) as u32, 1, 1),
        shared_mem_bytes: shared,
    }
}

/// The f32 elements of a contiguous tensor's storage.
fn rows<'a>(s: &'a CudaStorage, l: &Layout) -> candle_core::Result<CudaView<'a, f32>> {
    match l.contiguous_offsets() {
        Some((from, to)) => Ok(s.as_cuda_slice::<f32>()?.slice(from..to)),
        None => candle_core::bail!("attention step inputs must be contiguous"),
    }
}

/// The device address of a cache tensor's first element.
fn address(t: &Tensor, stream: &CudaStream) -> candle_core::Result<u64> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(cs) = &*storage else {
        candle_core::bail!("a GPU decode step's cache is not in GPU memory")
    };
    // The event this records on drop marks a read for another stream to wait on; candle
    // runs every op on its device's one stream, which orders the kernels already.
    let (base, _read) = cs.as_cuda_slice::<f16>()?.device_ptr(stream);
    Ok(base + (layout.start_offset() * std::mem::size_of::<f16>()) as u64)
}
