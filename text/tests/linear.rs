//! Preparing a chat's prompt grows linearly with the chat: eight times the tool results
//! cost at most ten times the memory allocated. Joining each result to a copy of those
//! before it made a run of 40,000 results allocate about 64 times what 5,000 did.
//!
//! Bytes allocated, not time: they count the copying that made the work quadratic, and
//! the same on any machine. The count is this thread's, so nothing else the test process
//! does can disturb it.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use serde_json::{json, Value};
use text::ChatInput;

/// The system allocator, counting the bytes each thread asks for.
struct Counting;

thread_local! {
    static ALLOCATED: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: every call is passed to the system allocator unchanged; the count is a
// thread-local `Cell` with a const initializer, which never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATED.with(|a| a.set(a.get() + layout.size()));
        // SAFETY: the caller's contract for `alloc` is the system allocator's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator, which is the system allocator.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATED.with(|a| a.set(a.get() + new_size));
        // SAFETY: the caller's contract for `realloc` is the system allocator's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// A chat of one question, one call and `results` tool results in a row.
fn chat(results: usize) -> ChatInput {
    let mut messages = vec![
        json!({"role": "user", "content": "Look everything up."}),
        json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function",
            "function": {"name": "look_up", "arguments": "{}"}}]}),
    ];
    messages.extend(
        (0..results).map(
            |i| json!({"role": "tool", "tool_call_id": "c", "content": format!("result {i}")}),
        ),
    );
    ChatInput {
        messages: Value::Array(messages),
        tools: Some(json!([{"type": "function", "function": {"name": "look_up"}}])),
        add_generation_prompt: true,
        kwargs: Default::default(),
    }
}

/// Bytes allocated by writing `input`'s tools and tool turns into its messages.
fn allocated(input: &ChatInput) -> usize {
    let before = ALLOCATED.with(Cell::get);
    let prompted = text::tools::prompted(input);
    let after = ALLOCATED.with(Cell::get);
    drop(prompted);
    after - before
}

#[test]
fn a_run_of_tool_results_is_prepared_in_linear_memory() {
    let (small, large) = (chat(5_000), chat(40_000));
    let (a, b) = (allocated(&small), allocated(&large));
    assert!(
        b < a * 10,
        "5,000 results allocated {a} bytes and 40,000 allocated {b}: {:.1} times",
        b as f64 / a as f64
    );
}
