//! Room a kernel unpacks weights into before a prompt's many activation rows read them:
//! one region a thread, kept between calls and grown to the largest asked for, so that a
//! product allocates nothing. Its size is bounded by the model: a kernel asks for one
//! group's row of unpacked blocks, at most a few hundred KiB at the widest inputs here.

use std::cell::RefCell;

/// A cache line of bytes, aligned as one: any vector fits its alignment.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

thread_local! {
    static ROOM: RefCell<Vec<Line>> = const { RefCell::new(Vec::new()) };
}

/// Room for `n` values of `T`: this thread's, until its next call.
///
/// A pointer out rather than a closure run inside the borrow: a kernel's code in such a
/// closure is not compiled with the kernel's target features, and called every intrinsic
/// out of line (the K-quant kernels ran 50x slower that way).
///
/// # Safety
/// Any bits are a `T` (vectors and numbers); the room is used before this thread calls
/// `room` again (no kernel calls another while it holds its room).
#[inline(always)]
pub(crate) unsafe fn room<T>(n: usize) -> *mut T {
    const { assert!(align_of::<T>() <= align_of::<Line>()) };
    let lines = (n * size_of::<T>()).div_ceil(size_of::<Line>());
    ROOM.with_borrow_mut(|room| {
        room.resize(room.len().max(lines), Line([0; 64]));
        room.as_mut_ptr().cast()
    })
}
